"""kpng.heap: free memory scattered between live chunks goes back to the kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kpng import heap

_FRAGMENTED = """
import sys
from kpng import heap

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
assert heap.trim()
print(before, rss_kib(), len(kept))
"""


@pytest.mark.skipif(heap._malloc_trim() is None, reason="this C library has no malloc_trim")
def test_trim_gives_scattered_free_memory_back() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True, check=True
    ).stdout
    before, after, _ = (int(x) for x in out.split())
    assert before > 150_000  # the freed chunks still count in RSS
    assert after < before - 100_000, (before, after)
