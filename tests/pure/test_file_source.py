"""The file source: files and directories, followed with inotify, losing nothing on bad input."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kpng.errors import InputError
from kpng.model.messages import Service
from kpng.sources.file import REMOVAL_DELAY_S as REMOVAL_DELAY_DEFAULT_S
from kpng.sources.file import SPEC, FileSource
from kpng.status import Status
from kpng.store import SourceHandle, Store
from kpng.testing.waiting import eventually

# Bounds for waiting on inotify; a change normally lands in tens of milliseconds.
WAIT_S = 10.0


def _svc(name: str, ip: str = "10.96.0.1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"clusterIP": ip, "ports": [{"port": 80}]},
    }


def _slice(name: str, service: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.1.0.1"]}],
    }


def _write(path: Path, *docs: dict[str, Any]) -> None:
    path.write_text("\n---\n".join(json.dumps(d) for d in docs))


def _cluster_ip(store: Store, name: str) -> str | None:
    service = store.services.get(("ns", name))
    if service is None:
        return None
    assert isinstance(service, Service)
    assert service.IPs is not None
    assert service.IPs.ClusterIPs is not None
    return service.IPs.ClusterIPs.V4[0]


def _load(path: Path) -> tuple[FileSource, Store]:
    store = Store()
    source = FileSource(path)
    source.load(store.source("file"))
    return source, store


def test_directory_is_read_recursively_skipping_hidden_and_other_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    _write(tmp_path / "a.yaml", _svc("a"))
    _write(tmp_path / "sub" / "b.json", _svc("b"))
    _write(tmp_path / ".git" / "c.yaml", _svc("c"))
    _write(tmp_path / ".d.yaml.swp", _svc("d"))
    _write(tmp_path / "notes.txt", _svc("e"))
    _, store = _load(tmp_path)
    assert set(store.services) == {("ns", "a"), ("ns", "b")}
    assert store.synced


@pytest.mark.parametrize("missing", ["nothing-here", "nothing-here/x.yaml"])
def test_missing_input_is_a_clear_error(tmp_path: Path, missing: str) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        _load(tmp_path / missing)


def test_duplicate_across_files_first_file_wins_then_hands_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "1.yaml", _svc("a", "10.96.0.1"))
    _write(tmp_path / "2.yaml", _svc("a", "10.96.0.2"))
    with caplog.at_level(logging.ERROR):
        source, store = _load(tmp_path)
    assert _cluster_ip(store, "a") == "10.96.0.1"
    assert any("Service ns/a: defined in" in r.getMessage() for r in caplog.records)
    (tmp_path / "1.yaml").unlink()
    source.reload([tmp_path / "1.yaml"], store.source("again"))
    assert _cluster_ip(store, "a") == "10.96.0.2"


def test_a_file_that_stops_parsing_keeps_its_last_good_content(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    _write(path, _svc("a"), _svc("b", "10.96.0.2"))
    source, store = _load(path)
    path.write_text("kind: Service\nmetadata: {name: [half-written\n")
    handle = store.source("reload")
    with caplog.at_level(logging.ERROR):
        source.reload([path], handle)
    assert not handle.commit()
    assert set(store.services) == {("ns", "a"), ("ns", "b")}
    assert any("invalid YAML" in r.getMessage() for r in caplog.records)


def test_a_file_that_never_parsed_holds_the_sync_and_healthz_names_it(
    tmp_path: Path,
) -> None:
    """No previous content to keep: serving the other files alone would be a partial state."""
    _write(tmp_path / "a.yaml", _svc("a"))
    broken = tmp_path / "b.yaml"
    broken.write_text("kind: Service\nmetadata: {name: [half-written\n")
    store = Store()
    status = Status(timeout=10.0)
    status.store = store
    deltas = store.subscribe()
    handle = store.source("file")
    watching = asyncio.Event()

    async def scenario() -> None:
        task = asyncio.create_task(FileSource(tmp_path).run(handle, watching=watching))
        try:
            await asyncio.wait_for(watching.wait(), WAIT_S)
            assert not store.synced
            assert handle.blocked_by is not None
            assert str(broken) in handle.blocked_by
            reasons = status.verdict().body["reasons"]
            assert f"source file: {handle.blocked_by}" in reasons
            _write(broken, _svc("b", "10.96.0.2"))
            delta = await asyncio.wait_for(anext(deltas), WAIT_S)
            assert set(delta.services) == {("ns", "a"), ("ns", "b")}
            assert handle.blocked_by is None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_a_write_between_the_load_and_the_watch_is_not_lost(tmp_path: Path) -> None:
    """No inotify event reports a change made before the watch is armed: kpng compares the
    files with what it read once the watch is armed."""
    _write(tmp_path / "a.yaml", _svc("a"))

    class WrittenDuringStart(FileSource):
        async def load_off_loop(self, out: SourceHandle) -> None:
            await super().load_off_loop(out)
            _write(tmp_path / "a.yaml", _svc("a", "10.96.0.9"))  # the same size: mtime differs
            _write(tmp_path / "b.yaml", _svc("b"))

    store = Store()
    watching = asyncio.Event()

    async def scenario() -> None:
        task = asyncio.create_task(
            WrittenDuringStart(tmp_path).run(store.source("file"), watching=watching)
        )
        try:
            await asyncio.wait_for(watching.wait(), WAIT_S)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert _cluster_ip(store, "a") == "10.96.0.9"
    assert ("ns", "b") in store.services


@pytest.mark.slow
def test_a_big_reload_leaves_the_event_loop_free(tmp_path: Path) -> None:
    """Parsing runs in a thread: the loop keeps answering (/healthz, the API) meanwhile."""
    path = tmp_path / "big.yaml"
    _write(path, *(_svc(f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}") for i in range(5000)))
    store = Store()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    async def scenario() -> float:
        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        await FileSource(path).load_off_loop(store.source("file"))
        ticker.cancel()
        return time.monotonic() - started

    took = asyncio.run(scenario())
    assert len(store.services) == 5000
    # The ticker ran through the load, not once before and once after it.
    assert ticks > 1 + took / 0.005 / 10, (ticks, took)


def test_slice_of_an_undefined_service_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "c.yaml", _slice("lost-1", "lost"), _svc("a"), _slice("a-1", "a"))
    with caplog.at_level(logging.WARNING):
        _, store = _load(tmp_path / "c.yaml")
    messages = [r.getMessage() for r in caplog.records]
    assert any("EndpointSlice ns/lost-1: Service ns/lost is not defined" in m for m in messages)
    assert not any("ns/a-1" in m for m in messages)
    assert ("ns", "lost-1") in store.slices  # kept: the Service may come later


REMOVAL_DELAY_S = 0.3


async def _follow(path: Path, change: Callable[[], None], until: Callable[[Store], bool]) -> Store:
    store = Store()
    deltas = store.subscribe()
    watching = asyncio.Event()
    source = FileSource(path, removal_delay=REMOVAL_DELAY_S)
    task = asyncio.create_task(source.run(store.source("file"), watching=watching))
    try:
        await asyncio.wait_for(watching.wait(), WAIT_S)
        change()
        async with asyncio.timeout(WAIT_S):
            async for _ in deltas:
                if until(store):
                    break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return store


def _run(coro: Awaitable[Store]) -> Store:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_editing_a_watched_file_applies_only_what_changed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    _write(path, _svc("a"), _svc("b", "10.96.0.2"))

    def change() -> None:
        _write(path, _svc("a"), _svc("b", "10.96.0.3"))

    store = _run(_follow(path, change, lambda s: _cluster_ip(s, "b") == "10.96.0.3"))
    assert store.revision == 2  # the load, then exactly one change
    assert _cluster_ip(store, "a") == "10.96.0.1"


def test_file_replaced_by_rename_is_followed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    _write(path, _svc("a"))

    def change() -> None:
        aside = tmp_path / "c.yaml.new"
        _write(aside, _svc("a"), _svc("b"))
        aside.rename(path)

    store = _run(_follow(path, change, lambda s: ("ns", "b") in s.services))
    assert ("ns", "a") in store.services


def test_new_and_deleted_files_in_a_watched_directory(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", _svc("a"))

    def change() -> None:
        (tmp_path / "a.yaml").unlink()
        (tmp_path / "more").mkdir()
        _write(tmp_path / "more" / "b.yaml", _svc("b"))

    store = _run(
        _follow(
            tmp_path,
            change,
            lambda s: ("ns", "b") in s.services and ("ns", "a") not in s.services,
        )
    )
    assert set(store.services) == {("ns", "b")}


def test_directory_moved_in_and_out_of_a_watched_directory(tmp_path: Path) -> None:
    watched = tmp_path / "watched"
    watched.mkdir()
    _write(watched / "a.yaml", _svc("a"))
    staging = tmp_path / "staging"
    (staging / "deep").mkdir(parents=True)
    _write(staging / "deep" / "b.yaml", _svc("b"))
    _write(staging / "c.json", _svc("c"))

    def move_in() -> None:
        staging.rename(watched / "team")  # files that existed before any watch on them

    store = _run(_follow(watched, move_in, lambda s: len(s.services) == 3))
    assert set(store.services) == {("ns", "a"), ("ns", "b"), ("ns", "c")}

    def move_out() -> None:
        (watched / "team").rename(tmp_path / "gone")

    store = _run(_follow(watched, move_out, lambda s: len(s.services) == 1))
    assert set(store.services) == {("ns", "a")}


def test_other_files_beside_a_watched_file_are_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[set[Path]] = []
    real = FileSource._files_behind

    def counting(self: FileSource, paths: set[Path]) -> set[Path]:
        batches.append(paths)
        return real(self, paths)

    monkeypatch.setattr(FileSource, "_files_behind", counting)
    path = tmp_path / "c.yaml"
    _write(path, _svc("a"))
    log_file = tmp_path / "kpng.log"

    def change() -> None:
        for i in range(20):  # a log growing next to the input
            with log_file.open("a") as f:
                f.write(f"line {i}\n")
        _write(path, _svc("a"), _svc("b"))

    store = _run(_follow(path, change, lambda s: ("ns", "b") in s.services))
    assert store.revision == 2
    # every batch of events that woke the source up was about the input, never the log
    assert batches
    assert all(paths == {path} for paths in batches)


# --- inputs that are no regular file: refused or skipped, never opened (a FIFO blocks forever)


@pytest.mark.parametrize("kind", ["fifo", "/dev/null", "/dev/zero"])
def test_an_input_that_is_no_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path = tmp_path / "cluster.yaml"
        os.mkfifo(path)
        what = "a FIFO"
    else:
        path = Path(kind)
        what = "a character device"
    with pytest.raises(InputError) as raised:
        _load(path)
    assert str(raised.value) == (
        f"--input {path}: not a regular file ({what}); give a manifest file or a directory of them"
    )


def test_the_command_refuses_a_fifo_in_one_line_and_does_not_hang(
    tmp_path: Path, kpng_command: list[str]
) -> None:
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    done = subprocess.run(
        [*kpng_command, "file", "--input", str(fifo), "to-file", "--output", "-", "--once"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.endswith(
        f" ERROR kpng: --input {fifo}: not a regular file (a FIFO); give a manifest file or a "
        "directory of them"
    )
    assert done.stdout == ""


def test_a_fifo_in_a_directory_is_skipped_with_a_warning_never_opened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "a.yaml", _svc("a"))
    os.mkfifo(tmp_path / "b.yaml")
    with caplog.at_level(logging.WARNING):
        source, store = _load(tmp_path)  # would block reading b.yaml
    assert set(store.services) == {("ns", "a")}
    assert store.synced
    (warning,) = [r for r in caplog.records if "b.yaml" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert warning.getMessage() == (
        f"{tmp_path / 'b.yaml'}: not a regular file (a FIFO); skipped, never opened"
    )
    caplog.clear()
    source.reload(source.files(), store.source("again"))  # once only
    assert not [r for r in caplog.records if "b.yaml" in r.getMessage()]


def test_a_fifo_created_in_a_watched_directory_is_skipped(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", _svc("a"))

    def change() -> None:
        os.mkfifo(tmp_path / "b.yaml")
        _write(tmp_path / "c.yaml", _svc("c"))

    store = _run(_follow(tmp_path, change, lambda s: ("ns", "c") in s.services))
    assert set(store.services) == {("ns", "a"), ("ns", "c")}


# --- an input that holds no Service at start


@pytest.mark.parametrize("kind", ["empty-file", "empty-directory", "only-a-node"])
def test_an_input_without_services_is_served_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    path = tmp_path / "in"
    if kind == "empty-directory":
        path.mkdir()
    elif kind == "empty-file":
        path.write_text("")
    else:
        _write(path, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    with caplog.at_level(logging.WARNING):
        _, store = _load(path)
    assert store.synced
    assert not store.services
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"--input {path} holds no Service: kpng serves an empty state, with no rules for any "
        "Service"
    ]


def test_an_input_with_services_gets_no_such_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "c.yaml", _svc("a"))
    with caplog.at_level(logging.WARNING):
        _load(tmp_path / "c.yaml")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- a file read empty or gone: its Services go only if it stays so for the removal delay

Published = list[frozenset[tuple[str, str]]]


@contextlib.asynccontextmanager
async def _running(path: Path, removal_delay: float) -> AsyncIterator[tuple[FileSource, Published]]:
    """A FileSource following ``path``, and the Services of every state the store published."""
    store = Store()
    published: Published = []
    store.listeners.append(lambda _: published.append(frozenset(store.services)))
    source = FileSource(path, removal_delay=removal_delay)
    watching = asyncio.Event()
    task = asyncio.create_task(source.run(store.source("file"), watching=watching))
    try:
        await asyncio.wait_for(watching.wait(), WAIT_S)
        yield source, published
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


AB = frozenset({("ns", "a"), ("ns", "b")})
ABC = AB | {("ns", "c")}
# Long enough for the rewrite to land inside it on a loaded machine, short enough for a test.
SETTLE_S = 1.0


def _docs(*names: str) -> str:
    return "\n---\n".join(json.dumps(_svc(n, f"10.96.0.{i + 1}")) for i, n in enumerate(names))


def test_a_file_truncated_then_written_never_loses_its_services(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``cat new > cluster.yaml``, with the reader seeing the file empty in between."""
    path = tmp_path / "cluster.yaml"
    path.write_text(_docs("a", "b"))

    async def scenario() -> Published:
        async with _running(path, SETTLE_S) as (source, published):
            with path.open("w") as writer:  # truncated: what the shell's > does first
                writer.flush()
                await eventually(lambda: path in source.held)  # kpng read it empty
                writer.write(_docs("a", "b", "c"))
            await eventually(lambda: bool(published) and published[-1] == ABC)
            assert not source.held
            await asyncio.sleep(SETTLE_S + 0.2)  # past the delay: nothing more happens
        return published

    with caplog.at_level(logging.INFO):
        published = asyncio.run(scenario())
    assert published == [AB, ABC]  # never a state without a or b
    messages = [r.getMessage() for r in caplog.records]
    assert (
        f"{path} is empty: its 2 Service(s) are removed if it is still empty in 1s "
        "(--removal-delay)" in messages
    )
    assert f"{path} is no longer empty or gone: its Services stay" in messages


@pytest.mark.parametrize("gap", [False, True], ids=["rename-over", "delete-then-rename"])
def test_a_file_replaced_by_rename_never_loses_its_services(tmp_path: Path, gap: bool) -> None:
    """``mv new cluster.yaml``; and a writer that deletes the file before moving the new one in."""
    path = tmp_path / "cluster.yaml"
    path.write_text(_docs("a", "b"))

    async def scenario() -> Published:
        async with _running(path, SETTLE_S) as (source, published):
            new = tmp_path / "cluster.yaml.new"
            new.write_text(_docs("a", "b", "c"))
            if gap:
                path.unlink()
                await eventually(lambda: path in source.held)  # kpng found it gone
            new.rename(path)
            await eventually(lambda: bool(published) and published[-1] == ABC)
            await asyncio.sleep(SETTLE_S + 0.2)
            assert not source.held
        return published

    assert asyncio.run(scenario()) == [AB, ABC]


def _truncate(path: Path) -> None:
    path.write_text("")


def _comment_only(path: Path) -> None:
    path.write_text("# nothing here yet\n")


@pytest.mark.parametrize(
    ("empty", "still"),
    [
        pytest.param(_truncate, "is still empty", id="truncated"),
        pytest.param(_comment_only, "still holds no object", id="no-object"),
        pytest.param(Path.unlink, "is still gone", id="deleted"),
    ],
)
def test_a_file_that_stays_empty_loses_its_services_after_the_delay(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    empty: Callable[[Path], None],
    still: str,
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(_docs("a", "b"))

    async def scenario() -> tuple[Published, float]:
        async with _running(path, REMOVAL_DELAY_S) as (source, published):
            empty(path)
            await eventually(lambda: path in source.held)
            held = time.monotonic()
            assert published == [AB]
            await eventually(lambda: published[-1] == frozenset())
            return published, time.monotonic() - held

    with caplog.at_level(logging.WARNING):
        published, waited = asyncio.run(scenario())
    assert published == [AB, frozenset()]
    assert waited >= REMOVAL_DELAY_S * 0.9, waited  # (the hold began just before it was seen)
    assert f"{path} {still} after 0.3s: removing its 2 Service(s)" in [
        r.getMessage() for r in caplog.records
    ]


def test_an_emptied_directory_loses_its_services_after_the_delay(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", _svc("a"))
    _write(tmp_path / "b.yaml", _svc("b", "10.96.0.2"))

    async def scenario() -> Published:
        async with _running(tmp_path, REMOVAL_DELAY_S) as (source, published):
            (tmp_path / "a.yaml").unlink()
            (tmp_path / "b.yaml").unlink()
            await eventually(lambda: len(source.held) == 2)
            await eventually(lambda: published[-1] == frozenset())
            return published

    published = asyncio.run(scenario())
    assert published[0] == AB
    assert published[-1] == frozenset()
    # held, then removed: never a commit in between (both files went together, or one by one)
    assert all(state in (AB, {("ns", "a")}, {("ns", "b")}, frozenset()) for state in published)


def test_a_removal_delay_of_zero_applies_at_once(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(_docs("a", "b"))

    async def scenario() -> tuple[Published, bool]:
        async with _running(path, 0) as (source, published):
            _truncate(path)
            await eventually(lambda: published[-1] == frozenset())
            return published, bool(source.held)

    published, held = asyncio.run(scenario())
    assert published == [AB, frozenset()]
    assert not held


def test_a_service_another_file_defines_too_is_not_held(tmp_path: Path) -> None:
    """Handed over to the other file at once: nothing would be removed."""
    _write(tmp_path / "1.yaml", _svc("a", "10.96.0.1"))
    _write(tmp_path / "2.yaml", _svc("a", "10.96.0.2"))
    source = FileSource(tmp_path)  # the default delay: seconds
    store = Store()
    source.load(store.source("file"))
    (tmp_path / "1.yaml").write_text("")
    source.reload([tmp_path / "1.yaml"], store.source("again"))
    assert not source.held
    assert _cluster_ip(store, "a") == "10.96.0.2"


@pytest.mark.parametrize(
    ("argument", "seconds"), [("5s", 5.0), ("1m30s", 90.0), ("0", 0.0), ("0.3", 0.3)]
)
def test_the_removal_delay_flag_takes_durations(argument: str, seconds: float) -> None:
    parser = argparse.ArgumentParser()
    SPEC.add_arguments(parser)
    assert parser.parse_args(["--input", "x"]).removal_delay == REMOVAL_DELAY_DEFAULT_S == 5.0
    assert parser.parse_args(["--input", "x", "--removal-delay", argument]).removal_delay == (
        seconds
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--input", "x", "--removal-delay", "-1s"])


def test_a_service_named_as_no_cluster_would_is_skipped_the_rest_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    _write(path, _svc("a"), _svc("Bad_Name!", "10.96.0.2"), _svc("b", "10.96.0.3"))
    with caplog.at_level(logging.ERROR):
        _, store = _load(path)
    assert set(store.services) == {("ns", "a"), ("ns", "b")}
    (error,) = [r.getMessage() for r in caplog.records]
    assert error.startswith(
        f"{path}: document 1: Service ns/Bad_Name!: metadata.name: 'Bad_Name!' is not a "
        "DNS-1035 label"
    )


def _with_bad_service(tail: str) -> str:
    """Services a and b as a JSON List, then c whose port is ``tail``."""
    items = [json.dumps(_svc("a")), json.dumps(_svc("b", "10.96.0.2"))]
    items.append(json.dumps(_svc("c", "10.96.0.3")).replace('"port": 80', f'"port": {tail}'))
    return '{"kind": "List", "items": [' + ", ".join(items) + "]}"


def _alias_bomb(levels: int) -> str:
    """Anchors naming the one below ten times each: 10**levels nodes once expanded."""
    lines = ["kind: Service", "metadata: {name: a, namespace: ns}", 'x0: &x0 "lol"']
    lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        pytest.param(_with_bad_service("1e400"), "Service ns/c: Number out of range", id="1e400"),
        pytest.param(
            _with_bad_service("1" + "0" * 5000),
            "Service ns/c: Integer value out of range",
            id="5000-digit-integer-json",
        ),
        pytest.param(
            "\n---\n".join(json.dumps(d) for d in (_svc("a"), _svc("b", "10.96.0.2")))
            + "\n---\nkind: Service\nmetadata: {name: c, namespace: ns}\n"
            + "spec: {clusterIP: 10.96.0.3, ports: [{port: 1"
            + "0" * 5000
            + "}]}\n",
            "Service ns/c: Expected `int | null`, got an integer of more than 100 characters",
            id="5000-digit-integer-yaml",
        ),
        pytest.param("[" * 5000 + "]" * 5000, "invalid JSON", id="5000-deep-json"),
        pytest.param(
            '{"kind": "List", "items": [' + "[" * 5000 + "]" * 5000 + "]}",
            "nested too deeply",
            id="5000-deep-json-list",
        ),
        pytest.param("x: " + "[" * 5000 + "]" * 5000, "invalid YAML", id="5000-deep-yaml"),
        # A million nodes expanded: refused by the bound, and still small enough for the old
        # code to expand in this process.
        pytest.param(_alias_bomb(6), "alias bomb", id="alias-bomb"),
    ],
)
def test_a_reload_with_bad_numbers_or_nesting_keeps_the_good_content_and_logs_one_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str, error: str
) -> None:
    """What cannot be tied to one object costs the file, which keeps its last good content;
    what can costs that object. Either way the source goes on, and says it once."""
    path = tmp_path / "c.yaml"
    _write(path, _svc("a"), _svc("b", "10.96.0.2"))
    source, store = _load(path)
    path.write_text(bad)
    with caplog.at_level(logging.ERROR):
        source.reload([path], store.source("reload"))
    (logged,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged.startswith(f"{path}: ")
    assert error in logged
    assert "\n" not in logged or "invalid YAML" in logged  # (PyYAML's own errors span lines)
    assert set(store.services) == {("ns", "a"), ("ns", "b")}
    assert _cluster_ip(store, "b") == "10.96.0.2"
