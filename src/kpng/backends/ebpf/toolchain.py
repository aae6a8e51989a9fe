"""Compiling ``sockets.bpf.c``: at first start, into a cache, unless an object is given.

The object is compiled where it runs, once per source: clang's output depends only on the
source and the kernel headers' UAPI, and compiling takes under a second. A node that must not
carry clang is given an object built beforehand: ``--bpf-object FILE``, made with
``python -m kpng.backends.ebpf.toolchain FILE``. To compile: clang 14 or later, libbpf-dev
(``bpf/bpf_helpers.h``) and linux-libc-dev; to run: libbpf1 only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from kpng.backends.ebpf.libbpf import BpfError

SOURCE = Path(__file__).with_name("sockets.bpf.c")
CLANGS = ("clang", *(f"clang-{v}" for v in range(21, 13, -1)))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kpng" / "ebpf"


def object_path(cache: Path | None = None) -> Path:
    """Where the object of this source is cached: its name holds the source's hash."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return (cache or cache_dir()) / f"sockets-{digest}.o"


def compile_object(output: Path, source: Path = SOURCE) -> Path:
    """Compile ``source`` (the programs) into ``output``; ``BpfError`` with clang's message on
    failure."""
    clang = next((c for c in CLANGS if shutil.which(c)), None)
    if clang is None:
        raise BpfError(
            "to-ebpf compiles its programs at first start and needs clang for that "
            "(Debian: apt-get install clang libbpf-dev), or give it a compiled object with "
            "--bpf-object"
        )
    argv = [clang, "-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        # <linux/types.h> includes <asm/types.h>, which Debian keeps under the multiarch triplet.
        argv.append(f"-I/usr/include/{multiarch}")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(f".{os.getpid()}.tmp")
    argv += ["-c", str(source), "-o", str(partial)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BpfError(f"cannot compile {source.name} ({' '.join(argv)}):\n{proc.stderr.strip()}")
    partial.rename(output)  # another kpng compiling meanwhile finds a whole file or none
    return output


def unavailable() -> str | None:
    """Why to-ebpf cannot compile and load its programs here, or None."""
    from kpng.backends.ebpf.libbpf import library

    try:
        library()
    except BpfError as exc:
        return str(exc)
    if (
        not any(shutil.which(c) for c in CLANGS)
        or not Path("/usr/include/bpf/bpf_helpers.h").is_file()
    ):
        return "to-ebpf compiles its programs with clang and libbpf-dev (Debian: clang libbpf-dev)"
    return None


def ensure_object(given: Path | None = None) -> Path:
    """The object to load: ``given``, or the cached compile of this source (made if missing)."""
    if given is not None:
        if not given.is_file():
            raise BpfError(f"no BPF object at {given}")
        return given
    path = object_path()
    return path if path.is_file() else compile_object(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kpng.backends.ebpf.toolchain OUTPUT.o")
    try:
        compile_object(Path(sys.argv[1]))
    except BpfError as exc:
        sys.exit(str(exc))
