"""libbpf through ctypes: the calls to-ebpf makes, and nothing more.

Why libbpf and ctypes: libbpf is the kernel's own loader (it resolves the maps' pinning, checks
a pinned map against the program's definition, attaches through BPF links), Debian ships it as
``libbpf1``, and ctypes needs no compiler at install time, as to-nft's libnftables binding. The
Python bindings of BCC compile C at run time with LLVM in process, and those of other projects
are not packaged by Debian.

Every failure is a ``BpfError`` that says which call failed on what, with the errno's text and,
for a program the verifier refused, the verifier's log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from kpng.client import KpngError

_c_void_p = ctypes.c_void_p


class BpfError(KpngError):
    """A failure the kernel or libbpf explains: one line, not a bug's traceback."""


class _OpenOpts(ctypes.Structure):
    # struct bpf_object_open_opts of libbpf 1.x, up to kernel_log_level.
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("object_name", ctypes.c_char_p),
        ("relaxed_maps", ctypes.c_bool),
        ("pin_root_path", ctypes.c_char_p),
        ("_attach_prog_fd", ctypes.c_uint32),
        ("kconfig", ctypes.c_char_p),
        ("btf_custom_path", ctypes.c_char_p),
        ("kernel_log_buf", ctypes.c_void_p),
        ("kernel_log_size", ctypes.c_size_t),
        ("kernel_log_level", ctypes.c_uint32),
    ]


class _BatchOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """libbpf, loaded once; ``BpfError`` if it is not installed."""
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise BpfError(
                f"to-ebpf needs libbpf (Debian: apt-get install libbpf1): {exc}"
            ) from exc
        for fn, args, res in (
            ("bpf_object__open_file", [ctypes.c_char_p, ctypes.POINTER(_OpenOpts)], _c_void_p),
            ("bpf_object__load", [_c_void_p], ctypes.c_int),
            ("bpf_object__close", [_c_void_p], None),
            ("bpf_object__find_program_by_name", [_c_void_p, ctypes.c_char_p], _c_void_p),
            ("bpf_object__find_map_by_name", [_c_void_p, ctypes.c_char_p], _c_void_p),
            ("bpf_map__fd", [_c_void_p], ctypes.c_int),
            ("bpf_map__max_entries", [_c_void_p], ctypes.c_uint32),
            ("bpf_map_lookup_elem", [ctypes.c_int, _c_void_p, _c_void_p], ctypes.c_int),
            ("libbpf_num_possible_cpus", [], ctypes.c_int),
            ("bpf_program__attach_cgroup", [_c_void_p, ctypes.c_int], _c_void_p),
            ("bpf_link__open", [ctypes.c_char_p], _c_void_p),
            ("bpf_link__pin", [_c_void_p, ctypes.c_char_p], ctypes.c_int),
            ("bpf_link__update_program", [_c_void_p, _c_void_p], ctypes.c_int),
            ("bpf_link__destroy", [_c_void_p], ctypes.c_int),
            ("bpf_obj_get", [ctypes.c_char_p], ctypes.c_int),
            ("bpf_obj_pin", [ctypes.c_int, ctypes.c_char_p], ctypes.c_int),
            (
                "bpf_obj_get_info_by_fd",
                [ctypes.c_int, _c_void_p, ctypes.POINTER(ctypes.c_uint32)],
                ctypes.c_int,
            ),
            ("bpf_object__next_map", [_c_void_p, _c_void_p], _c_void_p),
            ("bpf_map__name", [_c_void_p], ctypes.c_char_p),
            ("bpf_map__pin_path", [_c_void_p], ctypes.c_char_p),
            ("bpf_program__fd", [_c_void_p], ctypes.c_int),
            ("bpf_map__initial_value", [_c_void_p, ctypes.POINTER(ctypes.c_size_t)], _c_void_p),
            ("bpf_program__attach_iter", [_c_void_p, _c_void_p], _c_void_p),
            ("bpf_link__fd", [_c_void_p], ctypes.c_int),
            ("bpf_iter_create", [ctypes.c_int], ctypes.c_int),
            (
                "bpf_map_update_batch",
                [ctypes.c_int, _c_void_p, _c_void_p, ctypes.POINTER(ctypes.c_uint32), _c_void_p],
                ctypes.c_int,
            ),
            (
                "bpf_map_delete_batch",
                [ctypes.c_int, _c_void_p, ctypes.POINTER(ctypes.c_uint32), _c_void_p],
                ctypes.c_int,
            ),
            (
                "bpf_map_lookup_batch",
                [
                    ctypes.c_int,
                    _c_void_p,
                    _c_void_p,
                    _c_void_p,
                    _c_void_p,
                    ctypes.POINTER(ctypes.c_uint32),
                    _c_void_p,
                ],
                ctypes.c_int,
            ),
        ):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, res
        _lib = lib
    return _lib


def _failure(call: str, what: object, code: int | None = None) -> BpfError:
    number = ctypes.get_errno() if code is None else abs(code)
    return BpfError(f"{call} {what}: {os.strerror(number)} ({errno.errorcode.get(number, number)})")


class BpfObject:
    """A loaded object file: its programs and maps, pinned maps reused from ``pin_root``;
    ``rodata``, if given, is what its ``const volatile`` globals hold (the whole ``.rodata``
    section, set before the load: the verifier then knows them as constants)."""

    def __init__(self, path: Path, pin_root: Path, *, rodata: bytes | None = None) -> None:
        self._lib = library()
        self._path, self._pin_root, self._rodata = path, pin_root, rodata
        self._ptr = self._open(verifier_log=None)
        code = self._lib.bpf_object__load(self._ptr)
        if code < 0:
            self.close()
            raise self._refused(code)

    def _open(self, verifier_log: ctypes.Array[ctypes.c_char] | None) -> int:
        opts = _OpenOpts(sz=ctypes.sizeof(_OpenOpts), pin_root_path=str(self._pin_root).encode())
        if verifier_log is not None:
            opts.kernel_log_buf = ctypes.cast(verifier_log, _c_void_p)
            opts.kernel_log_size = len(verifier_log)
            opts.kernel_log_level = 1
        ptr = self._lib.bpf_object__open_file(str(self._path).encode(), ctypes.byref(opts))
        if not ptr:
            raise _failure("cannot open BPF object", self._path)
        if self._rodata is not None:
            try:
                self._set_rodata(int(ptr), self._rodata)
            except BpfError:
                self._lib.bpf_object__close(ptr)
                raise
        return int(ptr)

    def _set_rodata(self, ptr: int, data: bytes) -> None:
        found = self._lib.bpf_object__find_map_by_name(ptr, b".rodata")
        size = ctypes.c_size_t()
        initial = self._lib.bpf_map__initial_value(found, ctypes.byref(size)) if found else None
        if not initial or size.value != len(data):
            raise BpfError(
                f"{self._path} has no .rodata of {len(data)} bytes (an object of another source?)"
            )
        ctypes.memmove(initial, data, len(data))

    def _refused(self, code: int) -> BpfError:
        """The load's failure, with the verifier's log: the load again, logging this time."""
        log = ctypes.create_string_buffer(1 << 22)
        try:
            ptr = self._open(verifier_log=log)
        except BpfError:
            return _failure("cannot load BPF object", self._path, code)
        self._lib.bpf_object__load(ptr)
        self._lib.bpf_object__close(ptr)
        text = log.value.decode(errors="replace").strip()
        error = _failure("cannot load BPF object", self._path, code)
        if text:
            return BpfError(f"{error}; the verifier's log:\n{text}")
        return error

    def program(self, name: str) -> int:
        ptr = self._lib.bpf_object__find_program_by_name(self._ptr, name.encode())
        if not ptr:
            raise BpfError(f"no program {name} in {self._path}")
        return int(ptr)

    def _map(self, name: str) -> int:
        ptr = self._lib.bpf_object__find_map_by_name(self._ptr, name.encode())
        if not ptr:
            raise BpfError(f"no map {name} in {self._path}")
        return int(ptr)

    def map_fd(self, name: str) -> int:
        return int(self._lib.bpf_map__fd(self._map(name)))

    def map_capacity(self, name: str) -> int:
        """The map's ``max_entries``, as loaded."""
        return int(self._lib.bpf_map__max_entries(self._map(name)))

    def pinned_maps(self) -> dict[str, tuple[int, Path]]:
        """Every map pinned by name: its file descriptor and its pin's path."""
        found = {}
        ptr = self._lib.bpf_object__next_map(self._ptr, None)
        while ptr:
            path = self._lib.bpf_map__pin_path(ptr)
            if path:
                name = self._lib.bpf_map__name(ptr).decode()
                found[name] = (int(self._lib.bpf_map__fd(ptr)), Path(path.decode()))
            ptr = self._lib.bpf_object__next_map(self._ptr, ptr)
        return found

    def program_id(self, name: str) -> int:
        """The kernel's id of the loaded program: what a link running it names."""
        return object_id(int(self._lib.bpf_program__fd(self.program(name))))

    def close(self) -> None:
        if self._ptr:
            self._lib.bpf_object__close(self._ptr)
            self._ptr = 0


def attach(program: int, name: str, cgroup: Path, pin: Path) -> None:
    """Run ``program`` on ``cgroup``'s sockets through the link pinned at ``pin``: an existing
    link switches to it atomically (BPF_LINK_UPDATE), else a new link is made and pinned. The
    pin keeps the program attached after kpng exits, as rules outlive kube-proxy."""
    lib = library()
    link = lib.bpf_link__open(str(pin).encode()) if pin.exists() else None
    if link:
        code = lib.bpf_link__update_program(link, program)
        lib.bpf_link__destroy(link)
        if code == 0:
            return
        # A link of another attach type or program type: replaced below.
        pin.unlink()
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        link = lib.bpf_program__attach_cgroup(program, fd)
        if not link:
            raise _failure(f"cannot attach {name} to cgroup", cgroup)
    finally:
        os.close(fd)
    try:
        pin.parent.mkdir(parents=True, exist_ok=True)
        code = lib.bpf_link__pin(link, str(pin).encode())
        if code < 0:
            raise _failure(f"cannot pin the link of {name} at", pin, code)
    finally:
        lib.bpf_link__destroy(link)


class BpfIterator:
    """A BPF iterator program, attached: each ``run`` walks the kernel objects it iterates (for
    ``iter/udp``, the UDP sockets of the calling thread's network namespace at that moment) and
    returns what the program wrote."""

    def __init__(self, program: int, name: str) -> None:
        self._lib = library()
        self._name = name
        link = self._lib.bpf_program__attach_iter(program, None)
        if not link:
            raise _failure("cannot attach the iterator", name)
        self._link = int(link)

    def run(self) -> bytes:
        fd = self._lib.bpf_iter_create(self._lib.bpf_link__fd(self._link))
        if fd < 0:
            raise _failure("cannot create an iterator of", self._name, fd)
        chunks = []
        try:
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks)

    def close(self) -> None:
        if self._link:
            self._lib.bpf_link__destroy(self._link)
            self._link = 0


_INFO = struct.Struct("=III4xQ")
"""The head of struct bpf_map_info, bpf_prog_info and bpf_link_info: type and id, and for a link
its program's id and, for a cgroup link, the cgroup's id (0 once detached)."""


def _info(fd: int) -> tuple[int, int, int]:
    """The id of the object behind ``fd``; for a link, its program's id and cgroup's id."""
    buf = ctypes.create_string_buffer(_INFO.size)
    size = ctypes.c_uint32(_INFO.size)
    code = library().bpf_obj_get_info_by_fd(fd, buf, ctypes.byref(size))
    if code < 0:
        raise _failure("cannot read the information of BPF object fd", fd, code)
    _, number, program, cgroup = _INFO.unpack(buf.raw)
    return number, program, cgroup


def object_id(fd: int) -> int:
    """The kernel's id of the map, program or link behind ``fd``."""
    return _info(fd)[0]


def _open_pin(path: Path) -> int | None:
    fd = library().bpf_obj_get(str(path).encode())
    if fd >= 0:
        return int(fd)
    if abs(fd) in (errno.ENOENT, errno.ENOTDIR):
        return None
    raise _failure("cannot open the pin", path, fd)


def pinned_id(path: Path) -> int | None:
    """The id of the object pinned at ``path``; None if nothing is pinned there (nor can be:
    a part of the path is no directory)."""
    fd = _open_pin(path)
    if fd is None:
        return None
    try:
        return object_id(fd)
    finally:
        os.close(fd)


def pinned_link(path: Path) -> tuple[int, int] | None:
    """The program's id and the cgroup's id (0: detached) of the cgroup link pinned at
    ``path``; None if nothing is pinned there."""
    fd = _open_pin(path)
    if fd is None:
        return None
    try:
        _, program, cgroup = _info(fd)
    finally:
        os.close(fd)
    return program, cgroup


def pin(fd: int, path: Path) -> None:
    """Pin the object behind ``fd`` at ``path`` (nothing may be there)."""
    code = library().bpf_obj_pin(fd, str(path).encode())
    if code < 0:
        raise _failure("cannot pin at", path, code)


def pinned_map(path: Path) -> int:
    """A file descriptor of the map pinned at ``path`` (the caller closes it)."""
    fd = library().bpf_obj_get(str(path).encode())
    if fd < 0:
        raise _failure("cannot open the pinned map", path)
    return int(fd)


def update_batch(
    fd: int, name: str, entries: Sequence[tuple[bytes, bytes]], chunk: int = 65536
) -> None:
    """Write ``entries`` in batches of at most ``chunk`` (one system call each)."""
    lib = library()
    for start in range(0, len(entries), chunk):
        part = entries[start : start + chunk]
        keys = b"".join([k for k, _ in part])
        values = b"".join([v for _, v in part])
        count = ctypes.c_uint32(len(part))
        opts = _BatchOpts(sz=ctypes.sizeof(_BatchOpts))
        code = lib.bpf_map_update_batch(fd, keys, values, ctypes.byref(count), ctypes.byref(opts))
        if code < 0:
            raise _failure(f"cannot write {len(part)} entries of", name, code)


def delete_batch(fd: int, name: str, keys: Sequence[bytes], chunk: int = 65536) -> None:
    """Delete ``keys`` in batches; a key already gone is not an error (the programs' LRU maps
    and a takeover may have removed it)."""
    lib = library()
    opts = _BatchOpts(sz=ctypes.sizeof(_BatchOpts))
    pending = list(keys)
    while pending:
        part, pending = pending[:chunk], pending[chunk:]
        count = ctypes.c_uint32(len(part))
        code = lib.bpf_map_delete_batch(fd, b"".join(part), ctypes.byref(count), ctypes.byref(opts))
        if code < 0 and abs(code) != errno.ENOENT:
            raise _failure(f"cannot delete {len(part)} entries of", name, code)
        if code < 0:
            # The batch stops at a missing key: go on after it.
            pending = part[count.value + 1 :] + pending


def keys(fd: int, key_size: int, value_size: int, chunk: int = 8192) -> Iterator[bytes]:
    """Every key of a hash map, read in batches."""
    failure = "cannot read the keys of map fd"
    for buffer, _, n in _batches(fd, key_size, value_size, chunk, failure):
        raw = buffer.raw
        yield from [raw[i : i + key_size] for i in range(0, n * key_size, key_size)]


def count(fd: int, key_size: int, value_size: int, chunk: int = 8192) -> int:
    """How many entries a hash map holds: read in batches, as ``keys``, but never split into
    keys (the kernel's copy is most of the cost)."""
    failure = "cannot count the entries of map fd"
    return sum(n for _, _, n in _batches(fd, key_size, value_size, chunk, failure))


def possible_cpus() -> int:
    """How many values each entry of a per-CPU map holds."""
    cpus = int(library().libbpf_num_possible_cpus())
    if cpus < 0:
        raise _failure("cannot count the possible CPUs", "", cpus)
    return cpus


def per_cpu_stride(value_size: int) -> int:
    """The bytes of one CPU's value in a per-CPU map's entry (the kernel pads each to 8)."""
    return (value_size + 7) // 8 * 8


def per_cpu_entries(
    fd: int, key_size: int, value_size: int, chunk: int = 8192
) -> Iterator[tuple[bytes, list[bytes]]]:
    """Every entry of a per-CPU hash map, read in batches: its key and one value per possible
    CPU."""
    cpus, stride = possible_cpus(), per_cpu_stride(value_size)
    size = stride * cpus
    failure = "cannot read the entries of map fd"
    for keys_buf, values_buf, n in _batches(fd, key_size, size, chunk, failure):
        keys, values = keys_buf.raw, values_buf.raw
        for i in range(n):
            value = values[i * size : (i + 1) * size]
            yield (
                keys[i * key_size : (i + 1) * key_size],
                [value[c : c + value_size] for c in range(0, size, stride)],
            )


def _batches(
    fd: int, key_size: int, value_size: int, chunk: int, failure: str
) -> Iterator[tuple[ctypes.Array[ctypes.c_char], ctypes.Array[ctypes.c_char], int]]:
    """A hash map's entries, a batch at a time as the kernel copies them: the buffers of the
    batch's keys and values (reused by the next batch) and how many it holds."""
    lib = library()
    keys_buf = ctypes.create_string_buffer(key_size * chunk)
    values_buf = ctypes.create_string_buffer(value_size * chunk)
    token_in = ctypes.create_string_buffer(8)
    token_out = ctypes.create_string_buffer(8)
    opts = _BatchOpts(sz=ctypes.sizeof(_BatchOpts))
    first = True
    while True:
        n = ctypes.c_uint32(chunk)
        code = lib.bpf_map_lookup_batch(
            fd,
            None if first else token_in,
            token_out,
            keys_buf,
            values_buf,
            ctypes.byref(n),
            ctypes.byref(opts),
        )
        if code < 0 and abs(code) != errno.ENOENT:
            raise _failure(failure, fd, code)
        yield keys_buf, values_buf, n.value
        if code < 0:  # ENOENT: that was the last batch
            return
        ctypes.memmove(token_in, token_out, 8)
        first = False


def lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value of ``key`` in a (not per-CPU) map; None if it has none."""
    buf = ctypes.create_string_buffer(value_size)
    code = library().bpf_map_lookup_elem(fd, key, buf)
    if code < 0 and abs(code) == errno.ENOENT:
        return None
    if code < 0:
        raise _failure("cannot read an entry of map fd", fd, code)
    return buf.raw


def per_cpu(fd: int, key: bytes, value_size: int) -> list[bytes]:
    """The value of ``key`` in a per-CPU map, one per possible CPU (each padded to 8 bytes by
    the kernel, cut back to ``value_size`` here)."""
    lib = library()
    cpus = lib.libbpf_num_possible_cpus()
    if cpus < 0:
        raise _failure("cannot count the possible CPUs for map fd", fd, cpus)
    stride = (value_size + 7) // 8 * 8
    buf = ctypes.create_string_buffer(stride * cpus)
    code = lib.bpf_map_lookup_elem(fd, key, buf)
    if code < 0:
        raise _failure("cannot read an entry of map fd", fd, code)
    raw = buf.raw
    return [raw[i : i + value_size] for i in range(0, stride * cpus, stride)]
