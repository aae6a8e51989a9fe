"""``kpng file --input PATH``: the cluster described by manifest files, followed as they change.

PATH is a file or a directory (read recursively: ``*.yaml``, ``*.yml``, ``*.json``). Each file is
parsed on its own, so a change re-reads only that file, and only the objects whose content changed
reach the store. An object defined in two files is reported, and the file that sorts first wins.
A file that cannot be read or parsed any more is reported and keeps serving its last good content:
an editor's half-written save never wipes services. A file that has never parsed has no content to
keep: the source does not sync until it parses (or goes), ``/healthz`` names it, and a one-shot run
(``--once``) fails. A file that served Services and reads empty, empty of objects or gone keeps
them for ``--removal-delay``, and loses them only if it is still so then: a writer that truncates
(``kubectl get -o yaml > file``) or deletes the file before writing it anew causes no outage.
FIFOs and devices are never opened: refused as ``--input``, skipped inside a directory.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kpng.durations import format_duration, parse_duration
from kpng.errors import InputError, object_name
from kpng.gcpause import collector_paused
from kpng.model.cluster import ServiceCIDR, Slice
from kpng.model.messages import Node, Service
from kpng.sources import Runner, SourceSpec
from kpng.store import SourceHandle, Store

if TYPE_CHECKING:
    import watchfiles

    from kpng.sources import manifests
    from kpng.sources.manifests import Entry, ObjectKey, Parsed

log = logging.getLogger(__name__)

SUFFIXES = frozenset({".yaml", ".yml", ".json"})
# Group a burst of writes (an editor's save, a `cp -r`) into one reload, yet answer promptly.
_WATCH_STEP_MS = 30
_WATCH_DEBOUNCE_MS = 400
REMOVAL_DELAY_S = 5.0
"""How long a file that served Services may read as empty, empty of objects or gone before its
Services are removed: ``kubectl get -o yaml > file`` truncates the file first, and a writer
that truncates then writes, or deletes then renames into place, leaves it so for an instant."""


class _Read(NamedTuple):
    """One file as a reload found it."""

    result: Parsed | str
    """Its objects, or why it cannot be used."""
    seen: tuple[int, int, int]
    """Its inode, size and mtime when read."""
    regular: bool = True
    """False: not a regular file (a FIFO, a device...), so never opened."""


class _NotRegular(Exception):
    """A path that is no regular file: opening it could block forever (a FIFO waits for a
    writer, in a thread SIGTERM cannot interrupt) or read without end (``/dev/zero``)."""

    def __init__(self, mode: int) -> None:
        super().__init__(_file_type(mode))


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "of an unknown type"


def _read_regular(path: Path) -> tuple[bytes, os.stat_result]:
    """A regular file's content, and its stat as read. Raises _NotRegular, without opening it,
    for anything else."""
    before = path.stat()
    if not stat.S_ISREG(before.st_mode):
        raise _NotRegular(before.st_mode)
    # Non-blocking, should the path become a FIFO between the stat and the open: opening one
    # for reading then returns at once instead of waiting for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise _NotRegular(opened.st_mode)
        return file.read(), opened


class FileSource:
    def __init__(
        self,
        path: Path,
        *,
        proxy_name: str | None = None,
        removal_delay: float = REMOVAL_DELAY_S,
    ) -> None:
        # Absolute and normalized (``./sub/../x``): inotify reports absolute paths, and a
        # relative PATH would never equal them, so no change would ever be followed.
        self.path = Path(os.path.abspath(path))
        self.given = path
        """PATH as the user wrote it, for messages."""
        self.proxy_name = proxy_name
        self.removal_delay = removal_delay
        self._held: dict[Path, float] = {}
        """Files read empty or gone whose Services are still served, each with the (monotonic)
        time from which a read that finds them so again removes them."""
        self._expiring: asyncio.Task[None] | None = None
        self._parsed: dict[Path, Parsed] = {}
        self._memos: dict[Path, manifests.ItemMemo] = {}
        self._owner: dict[ObjectKey, Path] = {}
        self._never_parsed: dict[Path, str] = {}
        """Files that have failed every read since kpng started, with their latest error."""
        self._seen: dict[Path, tuple[int, int, int]] = {}
        """Each file's inode, size and mtime when last read: what changed before the watch was
        armed is found by comparing them."""
        self._lock = asyncio.Lock()
        """One reload at a time: the parse memos are shared with the reading thread."""
        self._not_regular: set[Path] = set()
        """Entries of a directory skipped as no regular file, each reported once."""

    def files(self) -> list[Path]:
        """The files PATH names now, in the order that decides duplicates. A FIFO or a device
        among them is listed too, to be reported when read (and never opened)."""
        if self.path.is_dir():
            return sorted(p for p in self.path.rglob("*") if self._wanted(p) and not p.is_dir())
        return [self.path]

    def _wanted(self, path: Path) -> bool:
        """In a directory: manifest suffixes, nothing hidden (editors' swap files, .git)."""
        if not self.path.is_dir():
            return path == self.path
        try:
            parts = path.relative_to(self.path).parts
        except ValueError:
            return False
        return path.suffix in SUFFIXES and not any(part.startswith(".") for part in parts)

    def load(self, out: SourceHandle) -> None:
        """Read every file and mark the source synced. Raises InputError if PATH is unusable."""
        self._check_input()
        self.reload(self.files(), out)
        self._warn_if_no_service()
        self._sync_unless_blocked(out)

    async def load_off_loop(self, out: SourceHandle) -> None:
        """``load``, reading and parsing in a thread (see ``_reload_off_loop``)."""
        self._check_input()
        await self._reload_off_loop(self.files(), out)
        self._warn_if_no_service()
        self._sync_unless_blocked(out)

    def _warn_if_no_service(self) -> None:
        """An empty state is legitimate (a new cluster), so it is served; but it is more often a
        mistake (a file truncated by a failed ``kubectl get -o yaml >``, the wrong directory),
        whose effect on a node is to remove every rule: said at once."""
        if self._never_parsed:
            return  # the file that does not parse yet may hold them
        if self._served_services() == 0:
            log.warning(
                "--input %s holds no Service: kpng serves an empty state, with no rules for "
                "any Service",
                self.given,
            )

    def _served_services(self, path: Path | None = None) -> int:
        """How many Services are served from the files; with ``path``, how many of those would
        go with it (those another file defines too would be served from there instead)."""
        served = [
            key
            for key, owner in self._owner.items()
            if key[0] == "Service"
            and (path is None or owner == path)
            and isinstance(self._parsed[owner].objects[key], Service)
        ]
        if path is None:
            return len(served)
        others = [p.objects for p_path, p in self._parsed.items() if p_path != path]
        return sum(1 for key in served if not any(key in objects for objects in others))

    def _check_input(self) -> None:
        try:
            mode = self.path.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise InputError(f"--input {self.given}: no such file or directory") from None
        except OSError as exc:
            raise InputError(f"--input {self.given}: {exc.strerror}") from None
        if stat.S_ISDIR(mode):
            return
        try:
            _read_regular(self.path)
        except _NotRegular as exc:
            # Refused rather than skipped: nothing else would be read, and reading it hangs.
            raise InputError(
                f"--input {self.given}: not a regular file ({exc}); give a manifest file or a "
                "directory of them"
            ) from None
        except OSError as exc:
            raise InputError(f"--input {self.given}: {exc.strerror}") from None

    def _sync_unless_blocked(self, out: SourceHandle) -> None:
        if not self._never_parsed:
            out.mark_synced()
            return
        errors = "; ".join(self._never_parsed.values())
        out.block(f"no usable state until these files parse: {errors}")

    def reload(self, paths: Iterable[Path], out: SourceHandle) -> None:
        """Re-read these files (gone ones are forgotten) and stage what changed in the store."""
        self._take(self._read_all(paths), out)

    async def _reload_off_loop(self, paths: Iterable[Path], out: SourceHandle) -> None:
        """``reload``, with the reading and parsing in a thread: a big file takes seconds to
        parse, which would stall ``/healthz``, ``/metrics`` and the API meanwhile."""
        async with self._lock:
            self._take(await asyncio.to_thread(self._read_all, list(paths)), out)

    def _read_all(self, paths: Iterable[Path]) -> dict[Path, _Read | None]:
        """Each file read and parsed (None if it is gone). Touches nothing the event loop reads
        (each file's parse memo is its own, one reload at a time)."""
        # Imported here, in the worker thread: every command finds the file source, and the
        # parsers (PyYAML, Kubernetes' objects) cost a node agent behind a brain 11 ms.
        from kpng.sources import manifests

        results: dict[Path, _Read | None] = {}
        for path in paths:
            seen = (0, 0, 0)
            try:
                data, read = _read_regular(path)
                seen = (read.st_ino, read.st_size, read.st_mtime_ns)
            except FileNotFoundError:
                results[path] = None
                continue
            except _NotRegular as exc:
                results[path] = _Read(f"{path}: not a regular file ({exc})", seen, regular=False)
                continue
            except OSError as exc:
                results[path] = _Read(f"{path}: cannot read: {exc.strerror}", seen)
                continue
            memo = self._memos.setdefault(path, manifests.ItemMemo())
            try:
                with collector_paused():
                    parsed: Parsed | str = manifests.parse(
                        data, filename=str(path), proxy_name=self.proxy_name, memo=memo
                    )
            except InputError as exc:
                parsed = str(exc)
            except Exception as exc:
                # A case the parser's bounds missed is kpng's bug, not the file's; yet it costs
                # the file, as any parse error does (kept as last read), never the source.
                log.exception("%s: parsing failed in kpng itself; please report it", path)
                parsed = f"{path}: cannot be parsed: {type(exc).__name__}: {exc}"
            results[path] = _Read(parsed, seen)
        return results

    def _take(self, results: dict[Path, _Read | None], out: SourceHandle) -> None:
        """Keep what ``_read_all`` found and stage the objects whose owner or content changed."""
        # Staging 100k services ran six full collections, 1 s, over what it had just indexed.
        with collector_paused():
            self._stage_all(results, out)

    def _stage_all(self, results: dict[Path, _Read | None], out: SourceHandle) -> None:
        touched: set[ObjectKey] = set()
        for path, read in results.items():
            if self._held_back(path, read):
                continue
            old = self._parsed.get(path)
            if old is not None:
                touched.update(old.objects)
            if read is None:
                self._parsed.pop(path, None)
                self._memos.pop(path, None)
                self._never_parsed.pop(path, None)
                self._seen.pop(path, None)
                self._not_regular.discard(path)
                continue
            result, self._seen[path], regular = read
            if not regular and path not in self._parsed:
                self._skip_not_regular(path, str(result))
                continue
            self._not_regular.discard(path)
            if isinstance(result, str):
                self._failed(path, result, out)
                continue  # unreadable now: keep its last good content
            for error in result.errors:
                log.error("%s", error)
            out.skipped += len(result.errors)
            self._never_parsed.pop(path, None)
            self._parsed[path] = result
            touched.update(result.objects)
        # In the order that decides duplicates, each with its objects: looked up once per key.
        files = [(p, self._parsed[p].objects) for p in sorted(self._parsed)]
        for key in touched:
            self._resolve_owner(key, files, out)
        self._report_orphans(touched)

    def _report_orphans(self, keys: Iterable[ObjectKey]) -> None:
        """Slices whose Service is not defined anywhere (ignored Services count as defined)."""
        for kind, namespace, name in keys:
            owner = self._owner.get((kind, namespace, name))
            if kind != "EndpointSlice" or owner is None:
                continue
            sl = self._parsed[owner].objects[(kind, namespace, name)]
            if isinstance(sl, Slice) and ("Service", namespace, sl.service) not in self._owner:
                log.warning(
                    "%s: EndpointSlice %s/%s: Service %s/%s is not defined; "
                    "its endpoints are unused until it is",
                    owner,
                    namespace,
                    name,
                    namespace,
                    sl.service,
                )

    def _may_matter(self, _: watchfiles.Change, path: str) -> bool:
        """Which events to wake up for: our files, and directories that may hold them.
        Everything else beside them (say, a log kpng writes next to its input) is ignored."""
        candidate = Path(path)
        if not self.path.is_dir():
            return candidate == self.path
        if self._wanted(candidate):
            return True
        try:
            if any(p.startswith(".") for p in candidate.relative_to(self.path).parts):
                return False
        except ValueError:
            return False
        if candidate.is_dir():
            return True
        # gone: was it a directory holding files we read?
        return any(p.is_relative_to(candidate) for p in self._parsed)

    def _files_behind(self, paths: set[Path]) -> set[Path]:
        """The manifest files that changed events may concern.

        A directory created or moved in is read whole: its files can be written before inotify
        watches it (`cp -r`). A directory deleted or moved out takes its known files with it.
        """
        files: set[Path] = set()
        for path in paths:
            if path.is_dir():
                files.update(p for p in path.rglob("*") if self._wanted(p) and not p.is_dir())
            elif self._wanted(path):
                files.add(path)
            if not path.exists():
                files.update(p for p in self._parsed if p.is_relative_to(path))
        return files

    @property
    def held(self) -> frozenset[Path]:
        """The files whose removal of Services waits for the removal delay."""
        return frozenset(self._held)

    def _held_back(self, path: Path, read: _Read | None) -> bool:
        """Whether to leave this read of ``path`` unapplied for now: it would remove every
        Service the file serves, because the file is empty, holds no object or is gone, and it
        has not been so for the removal delay yet (counted from the first read that found it
        so). Such a file is most often being rewritten; if it is not, the next read after the
        delay applies it (``run`` reads it again then)."""
        if read is None:
            state, still = "is gone", "is still gone"
        elif read.regular and not isinstance(read.result, str) and not read.result.objects:
            empty = read.seen[1] == 0
            state = "is empty" if empty else "holds no object"
            still = "is still empty" if empty else "still holds no object"
        else:
            state = still = ""
        losing = self._served_services(path) if state and self.removal_delay > 0 else 0
        if not losing:
            if path in self._held and not state:
                log.info("%s is no longer empty or gone: its Services stay", path)
            self._held.pop(path, None)
            return False
        now = time.monotonic()
        due = self._held.get(path)
        delay = format_duration(self.removal_delay)
        if due is None:
            self._held[path] = now + self.removal_delay
            log.warning(
                "%s %s: its %d Service(s) are removed if it %s in %s (--removal-delay)",
                path,
                state,
                losing,
                still,
                delay,
            )
            return True
        if now < due:
            return True
        del self._held[path]
        log.warning("%s %s after %s: removing its %d Service(s)", path, still, delay, losing)
        return False

    def _skip_not_regular(self, path: Path, error: str) -> None:
        """A FIFO or a device in a directory: skipped, not waited for (it never parses)."""
        if path not in self._not_regular:
            self._not_regular.add(path)
            log.warning("%s; skipped, never opened", error)

    def _failed(self, path: Path, error: str, out: SourceHandle) -> None:
        if path in self._parsed:
            log.error("%s; keeping the file's previous content", error)
        elif out.synced:
            log.error("%s; the file is ignored until it parses", error)
        else:
            log.error("%s; nothing is served until the file parses", error)
            self._never_parsed[path] = error

    def _resolve_owner(
        self, key: ObjectKey, files: list[tuple[Path, dict[ObjectKey, Entry]]], out: SourceHandle
    ) -> None:
        holders = [p for p, objects in files if key in objects]
        owner = holders[0] if holders else None
        if len(holders) > 1 and self._owner.get(key) != owner:
            kind, namespace, name = key
            others = ", ".join(str(p) for p in holders[1:])
            log.error(
                "%s %s: defined in %s and again in %s; using %s",
                kind,
                object_name(namespace, name),
                owner,
                others,
                owner,
            )
        if owner is None:
            self._owner.pop(key, None)
            stage(out, key, None)
        else:
            self._owner[key] = owner
            stage(out, key, self._parsed[owner].objects[key])

    def _changed_unwatched(self) -> list[Path]:
        """The files that changed, came or went since they were last read, by their stat."""
        now = set(self.files())
        changed = [p for p in self._seen if p not in now]
        for path in now:
            try:
                stat = path.stat()
            except FileNotFoundError:
                changed.append(path)
                continue
            if self._seen.get(path) != (stat.st_ino, stat.st_size, stat.st_mtime_ns):
                changed.append(path)
        return sorted(changed)

    async def _catch_up(self, out: SourceHandle, watching: asyncio.Event | None) -> None:
        """Once the watch is armed: re-read what changed between the load and then (a write
        during kpng's start), which no event will report."""
        await self._apply(self._changed_unwatched(), out)
        if watching is not None:
            watching.set()

    async def _apply(self, changed: list[Path], out: SourceHandle) -> None:
        """Re-read these files and publish the result (or, not synced yet, try to sync)."""
        if not changed:
            return
        await self._reload_off_loop(changed, out)
        if not out.synced:
            self._sync_unless_blocked(out)
        elif out.commit():
            log.info("reloaded %d file(s)", len(changed))
        if self._held and (self._expiring is None or self._expiring.done()):
            self._expiring = asyncio.ensure_future(self._expire_held(out))

    async def _expire_held(self, out: SourceHandle) -> None:
        """Read the held files again as their delays end: what is still empty or gone then is
        applied (``_held_back``); what has content again was applied as it came."""
        while self._held:
            await asyncio.sleep(max(0.0, min(self._held.values()) - time.monotonic()))
            now = time.monotonic()
            await self._apply(sorted(p for p, due in self._held.items() if due <= now), out)

    async def run(self, out: SourceHandle, *, watching: asyncio.Event | None = None) -> None:
        """Load, then follow changes until cancelled. ``watching`` is set once changes are seen."""
        # Imported once needed: every command finds the file source, few follow files.
        import watchfiles

        await self.load_off_loop(out)
        watch_root = self.path if self.path.is_dir() else self.path.parent
        catching_up: asyncio.Task[None] | None = None

        def armed() -> None:
            nonlocal catching_up
            catching_up = asyncio.ensure_future(self._catch_up(out, watching))

        # awatch arms its inotify watches synchronously in its first step, before it first
        # yields to the loop; a callback scheduled now runs only after that.
        asyncio.get_running_loop().call_soon(armed)
        try:
            async for batch in watchfiles.awatch(
                watch_root,
                recursive=self.path.is_dir(),
                step=_WATCH_STEP_MS,
                debounce=_WATCH_DEBOUNCE_MS,
                watch_filter=self._may_matter,
            ):
                await self._apply(sorted(self._files_behind({Path(p) for _, p in batch})), out)
        finally:
            if catching_up is not None:
                catching_up.cancel()
            if self._expiring is not None:
                self._expiring.cancel()


def stage(out: SourceHandle, key: ObjectKey, model: Entry) -> None:
    """Stage a parsed object (None: gone or ignored) in a store source, by its kind."""
    kind, namespace, name = key
    if kind == "Service":
        # Imported here, as the parser is (FileSource._read_all says why).
        from kpng.sources.manifests import Ignored

        ignored = model.reason if isinstance(model, Ignored) else None
        out.ignore_service((namespace, name), ignored)
        service = None if isinstance(model, Ignored) else model
        assert service is None or isinstance(service, Service)
        out.set_service((namespace, name), service)
    elif kind == "EndpointSlice":
        assert model is None or isinstance(model, Slice)
        out.set_slice((namespace, name), model)
    elif kind == "ServiceCIDR":
        assert model is None or isinstance(model, ServiceCIDR)
        out.set_service_cidr(name, model)
    else:
        assert model is None or isinstance(model, Node)
        out.set_node(name, model)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", required=True, type=Path, metavar="PATH", help="a manifest file or directory"
    )
    parser.add_argument(
        "--removal-delay",
        type=_duration,
        default=REMOVAL_DELAY_S,
        metavar="DURATION",
        help="how long a file that served Services must stay empty, empty of objects or gone "
        "before its Services are removed: a writer that truncates or deletes the file before "
        "writing it again causes no outage (e.g. 10s; 0: at once; default: "
        f"{format_duration(REMOVAL_DELAY_S)})",
    )
    parser.add_argument(
        "--service-proxy-name",
        metavar="NAME",
        help="serve only objects labelled service.kubernetes.io/service-proxy-name=NAME "
        "(default: only objects without that label)",
    )


def _duration(value: str) -> float:
    """An argparse type: a Go duration (``5s``, ``500ms``) or seconds. kpng.backends._node's
    duration_argument, which the file source does not import: that would load the backends'
    package for every command."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _create(args: argparse.Namespace, store: Store, _: str | None) -> Runner:
    source = FileSource(
        args.input, proxy_name=args.service_proxy_name, removal_delay=args.removal_delay
    )
    handle = store.source("file")
    return lambda: source.run(handle)


SPEC = SourceSpec(
    name="file",
    help="read Services, EndpointSlices, Nodes and ServiceCIDRs from manifest files, and follow "
    "them",
    add_arguments=_add_arguments,
    create=_create,
)
