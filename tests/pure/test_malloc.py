"""kpng.malloc: large buffers kept out of the heap, and free memory scattered between live chunks
given back to the kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kpng import malloc

_FRAGMENTED = """
import sys
from kpng import malloc

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

# 200 MB in 2 KiB chunks (glibc's heap, not Python's small-object arenas), every tenth kept:
# the freed chunks lie between live ones, where glibc keeps them.
chunks = [bytes(2048) for _ in range(100_000)]
kept = chunks[::10]
del chunks
before = rss_kib()
assert malloc.trim()
print(before, rss_kib(), len(kept))
"""


@pytest.mark.skipif(malloc._malloc_trim() is None, reason="this C library has no malloc_trim")
def test_trim_gives_scattered_free_memory_back() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True, check=True
    ).stdout
    before, after, _ = (int(x) for x in out.split())
    assert before > 150_000  # the freed chunks still count in RSS
    assert after < before - 100_000, (before, after)


_LARGE_BUFFERS = """
import sys
from kpng import malloc

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

if sys.argv[1] == "configured":
    assert malloc.configure()
# A large buffer freed: glibc's default then serves buffers up to its size from the heap.
buffer = bytearray(8 << 20)
del buffer
big, small = [], []
for _ in range(100):  # 100 MiB of 1 MiB buffers, each followed by a chunk that stays
    big.append(bytearray(1 << 20))
    small.append(bytearray(2048))
before = rss_kib()
del big
print(before, rss_kib())
"""


@pytest.mark.skipif(malloc._function("mallopt", []) is None, reason="this C library has no mallopt")
@pytest.mark.parametrize("configured", [False, True])
def test_freed_large_buffers_go_back_to_the_kernel_once_configured(configured: bool) -> None:
    """Without ``configure``, the 1 MiB buffers come from the heap, between chunks that stay,
    and their memory stays when they are freed; with it, each is a mapping of its own."""
    argv = [sys.executable, "-c", _LARGE_BUFFERS, "configured" if configured else "default"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    before, after = (int(x) for x in out.split())
    assert before > 100_000
    if configured:
        assert after < before - 90_000, (before, after)
    else:
        assert after > before - 10_000, (before, after)
