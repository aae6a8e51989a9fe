"""The compiled programs: ``sockets.bpf.o`` and ``udp_destroy.bpf.o``, made from their ``.c``
and shipped beside them.

Each object is compiled once, by whoever changes its source (``make bpf-object``, that is
``python -m kpng.backends.ebpf.toolchain --regenerate``), and committed with
``sockets.bpf.json``: each source's digest, each object's and the compiler that made them. The
wheel and the image carry them, so that no node, no image build and no ``pip install`` needs
clang; ``tests/packaging/test_ebpf_object.py`` fails while an object is older than its source.

Why committed rather than compiled by a setuptools build step: a build step would put clang and
libbpf-dev on every machine that builds a wheel or installs kpng from its sdist, and the image's
bytes would depend on whichever clang that machine has. A committed object is the same bytes
everywhere (clang's output depends on nothing else: the source is compiled from its own directory,
under a relative name, for a fixed target, ``-mcpu=v2``), and a change to it is reviewed.

``sockets.bpf.o``, the cgroup programs, is one object for every kernel: they read only their
context (``struct bpf_sock_addr`` and the ``struct bpf_sock`` it points to), which is UAPI that
the verifier itself rewrites to each kernel's layout, and never a kernel-internal struct. So it
has no CO-RE relocations and needs no kernel BTF (``/sys/kernel/btf/vmlinux``);
``core_relocations`` checks that it stays so. ``udp_destroy.bpf.o``, the iterator that destroys
connected UDP sockets, reads ``struct sock`` and calls a kfunc: it needs the kernel's BTF and
Linux 6.5, and is a separate object so that ``sockets.bpf.o`` loads without them.
Both are built for little-endian kernels (``bpfel``: amd64, arm64); on a big-endian machine the
sources are compiled at first start, as when a source was changed after its object: with clang
14 or later, libbpf-dev (``bpf/bpf_helpers.h``) and linux-libc-dev, into a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kpng.backends.ebpf.libbpf import BpfError, library
from kpng.backends.ebpf.system import kernel_too_old

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """A source, the headers of kpng's it includes, and the object kpng ships compiled from
    them."""

    source: Path
    object: Path
    headers: tuple[Path, ...] = ()

    @property
    def inputs(self) -> tuple[Path, ...]:
        return (self.source, *self.headers)


_HERE = Path(__file__).parent
MAPS_HEADER = _HERE / "maps.bpf.h"
SOCKETS = Unit(_HERE / "sockets.bpf.c", _HERE / "sockets.bpf.o", (MAPS_HEADER,))
UDP_DESTROY = Unit(_HERE / "udp_destroy.bpf.c", _HERE / "udp_destroy.bpf.o", (MAPS_HEADER,))
UNITS = (SOCKETS, UDP_DESTROY)
SOURCE, OBJECT = SOCKETS.source, SOCKETS.object
MANIFEST = Path(__file__).with_name("sockets.bpf.json")
CLANGS = ("clang", *(f"clang-{v}" for v in range(21, 13, -1)))
FLAGS = ("-O2", "-g", "-target", "bpfel", "-mcpu=v2", "-Wall", "-Werror")
"""``-g``: the maps are defined with BTF (``__type``), and the verifier's log quotes the source
lines from it. ``-fdebug-compilation-dir=.`` (added below) keeps the checkout's path out."""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kpng" / "ebpf"


def inputs_digest(unit: Unit) -> str:
    """One hash of the source and its headers."""
    return hashlib.sha256("".join(digest(p) for p in unit.inputs).encode()).hexdigest()


def object_path(cache: Path | None = None, unit: Unit = SOCKETS) -> Path:
    """Where a compile of ``unit``'s source is cached: its name holds the inputs' hash."""
    stem = unit.source.name.removesuffix(".bpf.c")
    return (cache or cache_dir()) / f"{stem}-{inputs_digest(unit)[:16]}.o"


def clang() -> str | None:
    return next((c for c in CLANGS if shutil.which(c)), None)


def compile_object(output: Path, source: Path = SOURCE) -> Path:
    """Compile ``source`` (the programs) into ``output``; ``BpfError`` with clang's message on
    failure."""
    compiler = clang()
    if compiler is None:
        raise BpfError(
            "compiling sockets.bpf.c needs clang (Debian: apt-get install clang libbpf-dev); "
            "or give to-ebpf a compiled object with --bpf-object"
        )
    source = source.resolve()
    argv = [compiler, *FLAGS, "-fdebug-compilation-dir=."]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        # <linux/types.h> includes <asm/types.h>, which Debian keeps under the multiarch triplet.
        argv.append(f"-I/usr/include/{multiarch}")
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(f".{os.getpid()}.tmp")
    # From the source's directory, by its bare name: the object then holds no path of this
    # machine, and is the same bytes wherever it is compiled.
    argv += ["-c", source.name, "-o", str(partial)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=source.parent)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BpfError(f"cannot compile {source.name} ({' '.join(argv)}):\n{proc.stderr.strip()}")
    partial.rename(output)  # another kpng compiling meanwhile finds a whole file or none
    return output


def compiler_version() -> str:
    compiler = clang()
    if compiler is None:
        return ""
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return proc.stdout.splitlines()[0] if proc.stdout else ""


def regenerate() -> dict[str, str]:
    """Compile the shipped objects and write their manifest; the manifest."""
    manifest = {}
    for unit in UNITS:
        compile_object(unit.object, unit.source)
        for path in unit.inputs:
            manifest[f"{path.name} sha256"] = digest(path)
        manifest[f"{unit.object.name} sha256"] = digest(unit.object)
    manifest |= {"compiler": compiler_version(), "flags": " ".join(FLAGS)}
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def manifest() -> dict[str, str] | None:
    try:
        loaded: dict[str, str] = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return None
    return loaded


def shipped_object(unit: Unit = SOCKETS) -> Path | None:
    """The object shipped with kpng, if it is the compile of its source for this machine."""
    made = manifest()
    if made is None or not unit.object.is_file() or sys.byteorder != "little":
        return None
    if any(made.get(f"{path.name} sha256") != digest(path) for path in unit.inputs):
        return None
    if made.get(f"{unit.object.name} sha256") != digest(unit.object):
        return None
    return unit.object


def unavailable() -> str | None:
    """Why to-ebpf cannot load its programs here (libbpf, the kernel, the object), or None."""
    try:
        library()
    except BpfError as exc:
        return str(exc)
    old = kernel_too_old()
    if old is not None:
        return old
    if shipped_object() is None and compiler_unavailable() is not None:
        return "the shipped sockets.bpf.o is not this source's, and clang is missing to compile it"
    return None


def compiler_unavailable() -> str | None:
    """Why the source cannot be compiled here, or None."""
    if clang() is None or not Path("/usr/include/bpf/bpf_helpers.h").is_file():
        return "compiling sockets.bpf.c needs clang and libbpf-dev (Debian: clang libbpf-dev)"
    return None


def ensure_object(given: Path | None = None, unit: Unit = SOCKETS) -> Path:
    """The object of ``unit`` to load: ``given``, else the shipped one, else (a source changed
    since, or a big-endian machine) the cached compile of its source, made if missing."""
    if given is not None:
        if not given.is_file():
            raise BpfError(f"no BPF object at {given}")
        return given
    shipped = shipped_object(unit)
    if shipped is not None:
        return shipped
    path = object_path(unit=unit)
    if path.is_file():
        return path
    if clang() is None:
        raise BpfError(
            f"{unit.object} is not the compile of {unit.source.name} (changed since? `make "
            "bpf-object` makes it anew), and there is no clang to compile it here"
        )
    log.warning(
        "to-ebpf: %s is not the compile of %s; compiling it into %s (`make bpf-object` updates "
        "the shipped object)",
        unit.object.name,
        unit.source.name,
        path,
    )
    return compile_object(path, unit.source)


def sections(path: Path) -> dict[str, bytes]:
    """The sections of an ELF64 little-endian object, by name."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BpfError(f"{path} is not a little-endian ELF64 object")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    found = {}
    for name_at, _type, _flags, _addr, offset, size, *_ in headers:
        start = names_offset + name_at
        name = data[start : data.index(b"\0", start)].decode()
        found[name] = data[offset : offset + size]
    return found


def core_relocations(path: Path) -> int:
    """How many bytes of CO-RE relocation records the object holds (``.BTF.ext``'s core_relo
    part): each would need the kernel's BTF to be resolved at load."""
    ext = sections(path).get(".BTF.ext")
    if ext is None:
        return 0
    (hdr_len,) = struct.unpack_from("<I", ext, 4)
    if hdr_len < 32:  # a header from before CO-RE: no relocations
        return 0
    (core_relo_len,) = struct.unpack_from("<I", ext, 28)
    return int(core_relo_len)


def main(argv: list[str]) -> int:
    if argv == ["--regenerate"]:
        try:
            made = regenerate()
        except BpfError as exc:
            print(exc, file=sys.stderr)
            return 1
        for unit in UNITS:
            print(f"{unit.object} ({unit.object.stat().st_size} bytes, {made['compiler']})")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(
            "usage: python -m kpng.backends.ebpf.toolchain --regenerate | OUTPUT.o",
            file=sys.stderr,
        )
        return 2
    try:
        compile_object(Path(argv[0]))
    except BpfError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
