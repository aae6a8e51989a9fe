"""``kpng check``: drive a plugin or an exec program through scripted states and say, case by
case, what passed and what failed, as csi-sanity does for CSI drivers. No root, no cluster.

    kpng check plugin unix:///PATH [--config FILE] [--services N] [--timeout SECONDS]
    kpng check exec --command CMD [--format full|ops] [--services N] [--timeout SECONDS]

A plugin is spoken to as to-plugin speaks to it (its sessions, FULL or DIFFS, its encoding),
and then as to-plugin never would: an undecodable payload, a change set without Sync, an Apply
abandoned at its deadline. Each is a case it must survive: refuse what is malformed, and take a
new session with the whole state afterwards. An exec program gets to-exec's lines: it must read
every state within the timeout, keep running, and exit 0 when its input ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kpng.api import codec, localv1_pb2, pluginv1_pb2
from kpng.backends.exec.formats import FORMATS
from kpng.backends.plugin.changes import ChangeSets
from kpng.backends.plugin.config import PluginSpec
from kpng.backends.plugin.connection import ENCODINGS, SERVICE, WANTS, PluginBackend, PluginError
from kpng.client import NodeState, ServiceEndpoints
from kpng.errors import KpngError, UsageError
from kpng.testing import states

NODE = "node-1"
EXIT_GRACE_S = 3.0
"""How long an exec program may take to exit once its input ends (to-exec's own wait)."""
ALIVE_S = 0.2
"""How long an exec program must stay up after reading a state to count as having taken it."""


@dataclass(frozen=True)
class Result:
    case: str
    passed: bool
    detail: str
    seconds: float


# --- the scripted states (pure)


def scripted(big: int) -> Iterator[tuple[str, NodeState]]:
    """(case, state) in order: a first state, adds, changes, deletes, ``big`` services, and back.
    Each state names what changed since the previous one, as kpng's states do."""
    first = {
        "web": states.entry("web", ["10.244.1.1", "10.244.2.1"]),
        "api": states.entry("api", ["10.244.1.2"], node_port=30080),
        "idle": states.entry("idle"),
    }
    yield "first state", _state(1, first, {})
    adds = first | {
        "cache": states.entry("cache", ["10.244.3.1"]),
        "idle": states.entry("idle", ["10.244.3.2"]),
    }
    yield "adds", _state(2, adds, first)
    changes = adds | {
        "web": states.entry("web", ["10.244.1.1", "10.244.2.9"]),
        "api": states.entry("api", ["10.244.1.2"], node_port=30081),
    }
    yield "changes", _state(3, changes, adds)
    deletes = {k: v for k, v in changes.items() if k != "cache"} | {
        "web": states.entry("web", ["10.244.1.1"])
    }
    yield "deletes", _state(4, deletes, changes)
    many = states.many(big)
    yield f"{big:,} services", _state(5, many, deletes)
    yield f"back from {big:,} services", _state(6, deletes, many)


def _state(
    revision: int, now: dict[str, ServiceEndpoints], before: dict[str, ServiceEndpoints]
) -> NodeState:
    updated = [name for name, value in now.items() if before.get(name) != value]
    deleted = [name for name in before if name not in now]
    return states.state(revision, now, updated=updated, deleted=deleted, node=NODE)


# --- running cases


async def _case(
    case: str,
    run: Callable[[], Awaitable[str]],
    results: list[Result],
    report: Callable[[Result], None],
) -> bool:
    start = time.monotonic()
    try:
        detail, passed = await run(), True
    except (CheckFailed, KpngError) as exc:
        detail, passed = str(exc), False
    result = Result(case, passed, detail, time.monotonic() - start)
    results.append(result)
    report(result)
    return passed


class CheckFailed(Exception):
    """A case's expectation was not met; the message says how."""


# --- plugins


async def check_plugin(
    url: str, *, config: Path | None, big: int, per_state: float, report: Callable[[Result], None]
) -> list[Result]:
    if not url.startswith("unix:///"):
        raise UsageError(f"{url}: a plugin is named by its socket, unix:///PATH")
    spec = PluginSpec(name="checked", socket=Path(url.removeprefix("unix://")), config=config)
    results: list[Result] = []
    described = pluginv1_pb2.DescribeResponse()
    channel = grpc.aio.insecure_channel(f"unix:{spec.socket}")

    async def call(name: str, request: Any, response: Any, deadline: float = per_state) -> Any:
        method = channel.unary_unary(
            SERVICE + name,
            request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
            response_deserializer=response.FromString,
        )
        return await method(request, timeout=deadline)

    async def describe() -> str:
        nonlocal described
        described = await _rpc(
            call("Describe", pluginv1_pb2.DescribeRequest(), pluginv1_pb2.DescribeResponse)
        )
        if described.Wants not in WANTS:
            raise CheckFailed(f"it wants an unknown kind of state ({described.Wants})")
        if described.Encoding not in ENCODINGS:
            raise CheckFailed(f"it wants an unknown encoding ({described.Encoding})")
        name = f"{described.Name or '(no name)'} {described.Version or '(no version)'}"
        return f"{name}: wants {WANTS[described.Wants]} in {ENCODINGS[described.Encoding]}"

    async def configure() -> str:
        data = config.read_bytes() if config is not None else b""  # noqa: ASYNC240 (small, once)
        request = pluginv1_pb2.ConfigureRequest(NodeName=NODE, Config=data)
        await _rpc(call("Configure", request, pluginv1_pb2.ConfigureResponse))
        return f"node {NODE}, {len(data)} bytes of configuration"

    try:
        if not await _case("describe", describe, results, report):
            return results
        await _case("configure", configure, results, report)
        backend = PluginBackend(spec, timeout=per_state)
        last = None
        try:
            for case, state in scripted(big):
                last = state
                await _case(case, _applied(backend, state), results, report)
        finally:
            await backend.close()
        assert last is not None

        async def new_session() -> str:
            fresh = PluginBackend(spec, timeout=per_state)
            try:
                return await _applied(fresh, last)()
            finally:
                await fresh.close()

        await _case("a new session: the whole state again", new_session, results, report)
        for case, request in _malformed(described.Encoding):
            await _case(case, _refused(call, request), results, report)
            await _case("  then a new session", new_session, results, report)
        big_whole = ChangeSets(described.Encoding).whole(
            next(s for c, s in scripted(big) if c == f"{big:,} services")
        )

        async def abandoned() -> str:
            try:
                await call("Apply", big_whole, pluginv1_pb2.ApplyResponse, deadline=0.001)
            except grpc.aio.AioRpcError as exc:
                # gRPC servers (Go's among them) reset the stream with CANCEL when the deadline
                # they were sent passes; that reset can reach the client before its own timer.
                server_deadline = exc.code() == grpc.StatusCode.CANCELLED and (
                    "RST_STREAM with error code 8" in (exc.details() or "")
                )
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED and not server_deadline:
                    raise CheckFailed(
                        f"it refused the whole state: {exc.code().name}: {exc.details()}"
                    ) from None
            return "kpng gave up on an Apply after 1 ms, as it does at its deadline"

        await _case("an Apply abandoned at its deadline", abandoned, results, report)
        await _case("  then a new session", new_session, results, report)

        async def health() -> str:
            answer = await _rpc(
                call("Health", pluginv1_pb2.HealthRequest(), pluginv1_pb2.HealthResponse)
            )
            if not answer.Ok:
                raise CheckFailed(f"it reports it is unhealthy: {answer.Message or '(no message)'}")
            return "ok"

        await _case("health", health, results, report)
    finally:
        await channel.close(None)
    return results


async def _rpc(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise CheckFailed(f"{exc.code().name}: {exc.details()}") from None


def _applied(backend: PluginBackend, state: NodeState) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        try:
            await backend.apply(state)
        except PluginError as exc:
            raise CheckFailed(str(exc)) from None
        endpoints = sum(len(v.endpoints) for v in state.services.values())
        return (
            f"revision {state.revision}: {len(state.services)} services, {endpoints} endpoints "
            "acknowledged"
        )

    return run


def _malformed(encoding: int) -> list[tuple[str, bytes]]:
    """Change sets no kpng sends, which a plugin must refuse (and survive)."""
    garbage = b"{not json" if encoding == pluginv1_pb2.JSON else b"\xff\xff\xff"
    bad_payload = localv1_pb2.OpItem(
        Set=localv1_pb2.Value(
            Ref=localv1_pb2.Ref(Set=localv1_pb2.ServicesSet, Path="ns/broken"), Bytes=garbage
        )
    ).SerializeToString()
    tail = pluginv1_pb2.ApplyRequest(Revision=100, Full=True).SerializeToString()
    return [
        (
            "malformed: a payload that does not decode",
            codec.op_batch([codec.OP_RESET, bad_payload, codec.OP_SYNC]) + tail,
        ),
        ("malformed: a whole state without Sync", codec.op_batch([codec.OP_RESET]) + tail),
    ]


def _refused(
    call: Callable[..., Awaitable[object]], request: bytes
) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        try:
            await call("Apply", request, pluginv1_pb2.ApplyResponse)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CheckFailed(
                    f"it did not answer: {exc.code().name}: {exc.details()}"
                ) from None
            return f"refused: {exc.code().name}: {exc.details()}"
        raise CheckFailed("it acknowledged it (OK): a plugin must refuse what it cannot program")

    return run


# --- exec programs


async def check_exec(
    argv: Sequence[str],
    *,
    format_name: str,
    big: int,
    per_state: float,
    report: Callable[[Result], None],
) -> list[Result]:
    results: list[Result] = []
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        results.append(Result("start", False, f"cannot run {argv[0]}: {exc.strerror}", 0.0))
        report(results[-1])
        return results
    assert proc.stdin is not None
    assert proc.stderr is not None
    stderr: list[bytes] = []
    reader = asyncio.create_task(_collect(proc.stderr, stderr))
    form = FORMATS[format_name]()
    stdin = proc.stdin

    def exited() -> CheckFailed:
        tail = b"".join(stderr[-5:]).decode(errors="replace").strip()
        return CheckFailed(
            f"it exited with status {proc.returncode}"
            + (f"; its stderr ends: {tail}" if tail else "")
        )

    def fed(state: NodeState) -> Callable[[], Awaitable[str]]:
        async def run() -> str:
            data = await form.encode(state)
            start = time.monotonic()
            try:
                stdin.write(data)
                await asyncio.wait_for(stdin.drain(), per_state)
            except (BrokenPipeError, ConnectionResetError):
                await proc.wait()
                raise exited() from None
            except TimeoutError:
                raise CheckFailed(
                    f"it did not read revision {state.revision} ({len(data):,} bytes) within "
                    f"{per_state:g} s; to-exec would coalesce newer states until it does"
                ) from None
            took = time.monotonic() - start
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), ALIVE_S)
            if proc.returncode is not None:
                raise exited()
            return f"revision {state.revision}: {len(data):,} bytes read in {took * 1000:.0f} ms"

        return run

    try:
        for case, state in scripted(big):
            if not await _case(case, fed(state), results, report):
                break
        else:

            async def end_of_input() -> str:
                stdin.close()
                try:
                    status = await asyncio.wait_for(proc.wait(), EXIT_GRACE_S)
                except TimeoutError:
                    raise CheckFailed(
                        f"it still runs {EXIT_GRACE_S:g} s after its input ended; to-exec then "
                        "sends SIGTERM"
                    ) from None
                if status != 0:
                    raise exited()
                return "it exited 0 when its input ended"

            await _case("end of input", end_of_input, results, report)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    return results


async def _collect(stream: asyncio.StreamReader, lines: list[bytes]) -> None:
    while line := await stream.readline():
        lines.append(line)
        del lines[:-20]


# --- the command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kpng check",
        description="Drive a plugin or an exec program through scripted states and report "
        "each case; exit 0 if all passed.",
    )
    kinds = parser.add_subparsers(dest="kind", required=True)
    plugin = kinds.add_parser("plugin", help="a plugin serving kpng.pluginv1 on a unix socket")
    plugin.add_argument("url", metavar="unix:///PATH")
    plugin.add_argument("--config", type=Path, metavar="FILE", help="its configuration file")
    program = kinds.add_parser("exec", help="a program reading to-exec's lines on its stdin")
    program.add_argument("--command", required=True, metavar="CMD", help="as to-exec takes it")
    program.add_argument("--format", choices=sorted(FORMATS), default="full")
    for sub in (plugin, program):
        sub.add_argument(
            "--services",
            type=int,
            default=10_000,
            metavar="N",
            help="the big state's size (default 10000)",
        )
        sub.add_argument(
            "--timeout",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="how long each state may take (to-plugin's default deadline, 30)",
        )
    return parser


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)

    def report(result: Result) -> None:
        verdict = "PASS" if result.passed else "FAIL"
        print(
            f"{verdict}  {result.case:45} {result.detail} ({result.seconds * 1000:.0f} ms)",
            flush=True,
        )

    try:
        if args.kind == "plugin":
            results = asyncio.run(
                check_plugin(
                    args.url,
                    config=args.config,
                    big=args.services,
                    per_state=args.timeout,
                    report=report,
                )
            )
        else:
            results = asyncio.run(
                check_exec(
                    shlex.split(args.command),
                    format_name=args.format,
                    big=args.services,
                    per_state=args.timeout,
                    report=report,
                )
            )
    except KpngError as exc:
        print(f"kpng check: error: {exc}", file=sys.stderr)
        return 2
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


__all__ = ["Result", "check_exec", "check_plugin", "main", "scripted"]
