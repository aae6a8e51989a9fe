"""The one module of the nft backend that talks to nftables and conntrack: libnftables in
process (``LibNft``), the ``nft`` command (``KernelNft``) and ``conntrack``.

Their failures become ``NftError`` here, and nowhere else.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, cast, overload

from kpng.backends._commands import CommandError, run_command
from kpng.backends._nftables.auditing import Probe
from kpng.backends._nftables.netlink import (
    NETLINK_NETFILTER,
    NLM_F_ACK,
    NLMSG_DONE,
    TABLE_F_DORMANT,
    TABLE_FLAGS_ATTR,
    Canonical,
    TableShape,
    attributes,
    canonical,
    dump_elements,
    dump_objects,
    elements_in,
    generation,
    get_element,
    get_generation,
    get_table,
    messages,
    shape_of,
)
from kpng.backends._nftables.nftables import (
    Map,
    Nft,
    NftError,
    Set,
    Table,
    TableObjects,
    Transaction,
    error_for_line,
    parse_objects,
    parse_tables,
)

log = logging.getLogger(__name__)

# nft names the failing line of its input as "NAME:LINE:COLS: Error: TEXT": "/dev/stdin" for
# `nft -f -`, "/proc/self/fd/N" for the file LibNft hands libnftables.
_ERROR_LINE = re.compile(
    r"^(?:/dev/stdin|-|<cmdline>|/proc/self/fd/\d+):(\d+):[\d-]+: Error: (.*)$", re.M
)
LIBNFTABLES = "libnftables.so.1"
TERSE = 1 << 11
"""libnftables' NFT_CTX_OUTPUT_TERSE (``nft -t``): listings without the elements of sets."""
TRIM_AFTER_BYTES = 1 << 20
"""Before and after a transaction this long (a full sync), the C heap is given back to the
system: see ``LibNft``."""
WRITE_BUFFER = 1 << 20
CLONE_NEWNET = 0x40000000
NLMSG_ERROR = 2
NLM_F_MULTI = 0x2
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33


def libnftables_version() -> str:
    """Which libnftables to-nft loads (its file), and the release of ``nft`` beside it."""
    try:
        ctypes.CDLL(LIBNFTABLES)
    except OSError as exc:
        return f"{LIBNFTABLES} cannot be loaded ({exc}); to-nft would run the nft command"
    with open("/proc/self/maps") as maps:
        found = {line.split()[-1] for line in maps if "libnftables.so" in line}
    path = min(found) if found else LIBNFTABLES
    nft = shutil.which("nft")
    if nft is None:
        return f"{path} (no nft command)"
    done = subprocess.run([nft, "--version"], capture_output=True, text=True, check=False)
    return f"{path} ({done.stdout.strip() or 'nft --version said nothing'})"


async def _run(argv: Sequence[str], stdin: bytes = b"") -> tuple[int, str]:
    rc, _, err = await _run_output(argv, stdin, output=False)
    return rc, err


async def _run_output(
    argv: Sequence[str], stdin: bytes = b"", *, output: bool = True
) -> tuple[int, str, str]:
    try:
        return await run_command(argv, stdin, output=output)
    except CommandError as exc:
        raise NftError(str(exc)) from exc


def parse_error(tx: Transaction, stderr: str) -> NftError:
    """The first error nft reported for ``tx``, with the rendered line it names."""
    match = _ERROR_LINE.search(stderr)
    if match is None:
        return NftError(stderr.strip() or "nft failed without a message")
    return error_for_line(tx, line_number=int(match.group(1)), message=match.group(2).strip())


class KernelNft:
    """Runs transactions with ``nft -f -`` in the current network namespace.

    ``command`` is how to run nft, e.g. ``("ip", "netns", "exec", NS, "nft")`` for another
    network namespace.
    """

    def __init__(self, command: Sequence[str] = ("nft",)) -> None:
        self._command = tuple(command)

    async def run(self, tx: Transaction) -> None:
        if not tx.operations:
            return
        rc, err = await _run([*self._command, "-f", "-"], tx.render().encode())
        if rc != 0:
            raise parse_error(tx, err)

    async def delete_table(self, table: Table) -> bool:
        rc, err = await _run([*self._command, "delete", "table", table.family, table.name])
        if rc == 0:
            return True
        if "No such file or directory" in err:
            return False
        raise NftError(err.strip())

    async def list_tables(self) -> list[Table]:
        rc, out, err = await _run_output([*self._command, "list", "tables"])
        if rc != 0:
            raise NftError(err.strip())
        return parse_tables(out)

    async def list_objects(self, table: Table) -> TableObjects | None:
        rc, out, err = await _run_output([*self._command, "-t", "-f", "-"], _list_objects(table))
        if rc != 0:
            raise NftError(err.strip())
        return parse_objects(out, table)

    async def list_table(self, table: Table) -> str:
        rc, out, err = await _run_output(
            [*self._command, "list", "table", table.family, table.name]
        )
        if rc != 0:
            if "No such file or directory" in err:
                return ""
            raise NftError(err.strip())
        return out


def _list_objects(table: Table) -> bytes:
    # Chains, sets and maps without their rules and elements: a full sync needs only the names,
    # and a table of 10k services holds 100k elements.
    return "".join(f"list {kind} {table.family}\n" for kind in ("chains", "sets", "maps")).encode()


class LibNft:
    """Runs transactions in this process through libnftables (``nft``'s own library).

    Why not ``nft -f -``: closing an nftables netlink socket after a commit waits until the
    kernel has released the transaction (an RCU grace period: about 10 ms of the 15 ms an
    endpoint change took), and every ``nft`` process closes its socket on exit. Here one
    context, with its socket, lives as long as the executor; no process is started and
    nothing is loaded per transaction either.

    The socket is opened when the executor is made, so transactions apply in the network
    namespace the process was in then (under ``ip netns exec NS``, NS). Calls run in a worker
    thread (ctypes releases the GIL), one at a time: a context is not thread-safe.
    ``OSError`` if the library cannot be loaded, ``AttributeError`` if it lacks a function.

    libnftables frees what it parsed, but glibc keeps the freed heap: a full sync of 30,000
    services left the process at 1 GB instead of 330 MB. ``malloc_trim`` after each long
    transaction gives it back (20 ms there); an ``nft`` process gave it back by exiting.
    """

    def __init__(self, library: str = LIBNFTABLES) -> None:
        if not os.path.isdir("/proc/self/fd"):
            raise OSError("/proc is not mounted: libnftables could not read the transactions")
        lib = ctypes.CDLL(library)
        _declare(lib)
        ctx: int | None = lib.nft_ctx_new(0)
        if not ctx:
            raise OSError(f"{library}: nft_ctx_new failed")
        # Buffered, output and errors are returned to us instead of written to our stdout and
        # stderr.
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        self._lib = lib
        self._ctx = ctx
        self._trim = _malloc_trim()
        self._lock = threading.Lock()
        self._free = weakref.finalize(self, _free_context, lib, ctx, self._lock)

    async def run(self, tx: Transaction) -> None:
        if not tx.operations:
            return
        ok, err = await asyncio.to_thread(self._run_transaction, tx)
        if not ok:
            raise parse_error(tx, err)

    async def delete_table(self, table: Table) -> bool:
        command = f"delete table {table.family} {table.name}".encode()
        ok, err = await asyncio.to_thread(self._call, self._lib.nft_run_cmd_from_buffer, command)
        if ok:
            return True
        if "No such file or directory" in err:
            return False
        raise NftError(err.strip())

    async def list_tables(self) -> list[Table]:
        ok, err, out = await asyncio.to_thread(
            self._call, self._lib.nft_run_cmd_from_buffer, b"list tables", output=True
        )
        if not ok:
            raise NftError(err.strip())
        return parse_tables(out)

    async def list_objects(self, table: Table) -> TableObjects | None:
        ok, err, out = await asyncio.to_thread(
            self._call,
            self._lib.nft_run_cmd_from_buffer,
            _list_objects(table),
            output=True,
            flags=TERSE,
        )
        if not ok:
            raise NftError(err.strip())
        return parse_objects(out, table)

    async def list_table(self, table: Table) -> str:
        command = f"list table {table.family} {table.name}".encode()
        ok, err, out = await asyncio.to_thread(
            self._call, self._lib.nft_run_cmd_from_buffer, command, output=True
        )
        if not ok:
            if "No such file or directory" in err:
                return ""
            raise NftError(err.strip())
        return out

    def close(self) -> None:
        """Free the context (also done when the executor is garbage-collected)."""
        self._free()

    def _run_transaction(self, tx: Transaction) -> tuple[bool, str]:
        # From a file, not a buffer: libnftables names neither the line nor the input of an
        # error in a buffer (it shows the buffer's first line), and from a file it writes
        # "FILE:LINE:COLS" as `nft -f` does. A memfd: private to this process, never on disk.
        fd = os.memfd_create("kpng-nft", os.MFD_CLOEXEC)
        trim: Callable[[int], int] | None = None
        try:
            # Rendered a line at a time into the file: the whole text, and its bytes, never
            # sit in memory beside what libnftables makes of them (100k services: 98 MB each).
            size = 0
            with open(fd, "w", encoding="utf-8", closefd=False, buffering=WRITE_BUFFER) as f:
                for line, _ in tx.lines():
                    f.write(line)
                    f.write("\n")
                    size += len(line) + 1
            trim = self._trim if size >= TRIM_AFTER_BYTES else None
            if trim is not None:
                # What making the plan freed goes back to the system before libnftables grows
                # to its peak, rather than after.
                trim(0)
            return self._call(self._lib.nft_run_cmd_from_filename, f"/proc/self/fd/{fd}".encode())
        finally:
            os.close(fd)
            if trim is not None:
                trim(0)

    @overload
    def _call(self, command: Callable[[int, bytes], int], arg: bytes) -> tuple[bool, str]: ...

    @overload
    def _call(
        self,
        command: Callable[[int, bytes], int],
        arg: bytes,
        *,
        output: Literal[True],
        flags: int = 0,
    ) -> tuple[bool, str, str]: ...

    def _call(
        self,
        command: Callable[[int, bytes], int],
        arg: bytes,
        *,
        output: bool = False,
        flags: int = 0,
    ) -> tuple[bool, str] | tuple[bool, str, str]:
        with self._lock:
            if not self._free.alive:
                raise NftError("the libnftables context is closed")
            if flags:
                saved = self._lib.nft_ctx_output_get_flags(self._ctx)
                self._lib.nft_ctx_output_set_flags(self._ctx, saved | flags)
            try:
                rc = command(self._ctx, arg)
            finally:
                if flags:
                    self._lib.nft_ctx_output_set_flags(self._ctx, saved)
            # Reading a buffer rewinds it: unread, the output would grow with every command.
            out: bytes | None = self._lib.nft_ctx_get_output_buffer(self._ctx)
            err: bytes | None = self._lib.nft_ctx_get_error_buffer(self._ctx)
        error = (err or b"").decode(errors="replace")
        if output:
            return rc == 0, error, (out or b"").decode(errors="replace")
        return rc == 0, error


def _declare(lib: ctypes.CDLL) -> None:
    """The prototypes of the libnftables functions LibNft calls (ctypes assumes ints)."""
    ctx, text = ctypes.c_void_p, ctypes.c_char_p
    lib.nft_ctx_new.argtypes, lib.nft_ctx_new.restype = [ctypes.c_uint32], ctx
    lib.nft_ctx_free.argtypes, lib.nft_ctx_free.restype = [ctx], None
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctx], ctypes.c_int
    for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctx], text
    lib.nft_ctx_output_get_flags.argtypes = [ctx]
    lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
    lib.nft_ctx_output_set_flags.argtypes = [ctx, ctypes.c_uint]
    lib.nft_ctx_output_set_flags.restype = None
    for name in ("nft_run_cmd_from_buffer", "nft_run_cmd_from_filename"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctx, text], ctypes.c_int


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None where the C library has none (e.g. musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], trim)


def _free_context(lib: ctypes.CDLL, ctx: int, lock: threading.Lock) -> None:
    with lock:  # not while a command runs in a worker thread
        lib.nft_ctx_free(ctx)


def default_nft(library: str = LIBNFTABLES) -> Nft:
    """``LibNft`` where ``library`` can be loaded, else ``KernelNft`` (the ``nft`` command)."""
    try:
        return LibNft(library)
    except (OSError, AttributeError) as exc:
        log.info("running the nft command for each transaction: no %s (%s)", library, exc)
        return KernelNft()


class NetlinkBatches:
    """Sends nf_tables netlink batches (``netlink.py``): each the kernel commits whole or not at
    all, in the network namespace the process is in, or ``netns`` (a path such as
    /run/netns/NAME: the socket is made there, as ``KernelNft``'s command reaches another)."""

    def __init__(self, netns: str | None = None) -> None:
        self._netns = netns

    async def send(self, messages: Sequence[bytes]) -> None:
        """One batch; ``NftError`` (nothing applied) if the kernel refuses any message of it."""
        await asyncio.to_thread(self._send, messages)

    async def dormant(self, table: Table) -> bool:
        """Whether ``table`` exists and is dormant: made by the text of a first sync whose
        netlink batch never came (refused, or kpng ended between the two)."""
        return await asyncio.to_thread(self._dormant, table)

    def _dormant(self, table: Table) -> bool:
        try:
            with self._socket() as sock:
                sock.bind((0, 0))
                sock.send(get_table(table))
                flags = _table_flags(sock.recv(1 << 16))
        except OSError as exc:
            raise NftError(f"netlink: {exc}") from exc
        return flags is not None and bool(flags & TABLE_F_DORMANT)

    async def generation(self) -> int:
        """The ruleset's generation: it moves with every nf_tables commit, anyone's."""
        (reply,) = await asyncio.to_thread(self._ask, get_generation())
        return generation(reply)

    async def shape(self, table: Table) -> TableShape | None:
        """``table``'s chains with their rule counts, and its sets and maps (None: no such
        table). Three dumps, none of them of elements."""
        return await asyncio.to_thread(self._shape, table)

    def _shape(self, table: Table) -> TableShape | None:
        try:
            with self._socket() as sock:
                sock.bind((0, 0))
                sock.send(get_table(table))
                if _table_flags(sock.recv(1 << 16)) is None:
                    return None
        except OSError as exc:
            raise NftError(f"netlink: {exc}") from exc
        dumps = (self._ask(dump_objects(kind, table)) for kind in ("chain", "rule", "set"))
        return shape_of(table, *dumps)

    async def has_elements(self, table: Table, probes: Iterable[Probe]) -> list[str]:
        """The containers of ``probes`` that do not hold their element: one request each."""
        return await asyncio.to_thread(self._missing, table, list(probes))

    def _missing(self, table: Table, probes: list[Probe]) -> list[str]:
        missing = []
        for probe in probes:
            try:
                self._ask(get_element(table, probe.container, probe.encoded))
            except NftError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                missing.append(probe.container)
        return missing

    async def elements_of(self, table: Table, container: Set | Map) -> set[Canonical]:
        """Every element of ``container`` as ``netlink.canonical`` writes it (one dump)."""
        return await asyncio.to_thread(self._elements_of, table, container.name)

    def _elements_of(self, table: Table, container: str) -> set[Canonical]:
        messages = self._ask(dump_elements(table, container))
        return {canonical(e) for message in messages for e in elements_in(message)}

    async def dumps(self, table: Table, containers: Sequence[str]) -> list[tuple[str, list[bytes]]]:
        """Every element of each of ``containers``, as the messages of one dump each (read
        with ``netlink.elements_in``)."""
        return await asyncio.to_thread(
            lambda: [(c, self._ask(dump_elements(table, c))) for c in containers]
        )

    def _ask(self, request: bytes) -> list[bytes]:
        """The answer to one request: its messages, up to the end of a dump or the kernel's
        acknowledgement. ``NftError`` (with ``errno``) for an error."""
        found: list[bytes] = []
        try:
            with self._socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
                sock.bind((0, 0))
                sock.send(request)
                while True:
                    for kind, message in messages(sock.recv(1 << 20)):
                        if kind == NLMSG_DONE:
                            return found
                        if kind == NLMSG_ERROR:
                            (error,) = struct.unpack_from("=i", message, 16)
                            if error:
                                raise NftError(f"netlink: {os.strerror(-error)}", errno=-error)
                            return found
                        found.append(message)
                        # One answer, and no acknowledgement asked for: nothing else comes.
                        (flags,), (asked,) = (
                            struct.unpack_from("=H", m, 6) for m in (message, request)
                        )
                        if not flags & NLM_F_MULTI and not asked & NLM_F_ACK:
                            return found
        except OSError as exc:
            raise NftError(f"netlink: {exc}") from exc

    def _socket(self) -> socket.socket:
        if self._netns is None:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        made: list[socket.socket] = []
        failed: list[OSError] = []

        def made_there() -> None:
            # setns moves only the calling thread: this short one, which ends there.
            libc = ctypes.CDLL(None, use_errno=True)
            assert self._netns is not None
            with open(self._netns) as there:
                if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
                    failed.append(OSError(ctypes.get_errno(), f"setns {self._netns}"))
                    return
            made.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER))

        thread = threading.Thread(target=made_there)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return made[0]

    def _send(self, messages: Sequence[bytes]) -> None:
        size = sum(len(m) for m in messages)
        acks = sum(1 for m in messages if struct.unpack_from("=H", m, 6)[0] & NLM_F_ACK)
        try:
            with self._socket() as sock:
                # The batch travels as one message, which the send buffer must hold.
                sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, size + 65536)
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
                sock.bind((0, 0))
                # One buffer: a sendmsg takes at most 1,024 (IOV_MAX), a batch of 100k services
                # has some 2,000 messages.
                sent = sock.send(b"".join(messages))
                if sent != size:
                    raise NftError(f"netlink took {sent} of the batch's {size} bytes")
                _acknowledged(sock, acks)
        except OSError as exc:
            raise NftError(f"netlink: {exc}") from exc


def _acknowledged(sock: socket.socket, acks: int) -> None:
    """Read the kernel's answers to a batch until every message asking for one has it; the
    first error refuses the whole batch (the kernel has undone it)."""
    while acks:
        reply = sock.recv(1 << 20)
        offset = 0
        while offset < len(reply):
            length, kind = struct.unpack_from("=IH", reply, offset)
            if kind == NLMSG_ERROR:
                (error,) = struct.unpack_from("=i", reply, offset + 16)
                if error:
                    raise NftError(f"the kernel refused the elements' batch: {os.strerror(-error)}")
                acks -= 1
            offset += (length + 3) & ~3


def _table_flags(reply: bytes) -> int | None:
    """A table's flags from the kernel's answer to ``get_table`` (None: no such table)."""
    (kind,) = struct.unpack_from("=H", reply, 4)
    if kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", reply, 16)
        if error == -errno.ENOENT:
            return None
        raise NftError(f"netlink: {os.strerror(-error)}")
    flags = attributes(reply).get(TABLE_FLAGS_ATTR)
    return 0 if flags is None else int(struct.unpack_from(">I", flags)[0])
