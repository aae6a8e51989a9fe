"""The ``kpng`` command. Commands read like the data flow:

    kpng [--log-level LEVEL] <source> [flags] <sink> [flags] [<backend> [flags]]

The command line is cut into those segments at the known source, sink and backend names, and each
segment is parsed by its own parser, so each part's ``--help`` lists exactly its own flags.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import difflib
import functools
import logging
import math
import os
import re
import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kpng import gcpause, malloc, sinks, sources, subcommands
from kpng.backends import registry
from kpng.backends._conntrack import RECONCILED
from kpng.backends.registry import BackendSpec
from kpng.errors import EXIT_ERROR, EXIT_USAGE, KpngError, UsageError
from kpng.feeding import Fanout, Feeder, SyncStats
from kpng.logs import configure_logging
from kpng.sinks import SinkSpec
from kpng.sinks.explain import Traffic, explain_json, traffic_of
from kpng.sources import Runner, SourceSpec
from kpng.status import Status
from kpng.stopping import until_signalled
from kpng.store import SourceHandle, Store
from kpng.subcommands import CommandSpec

log = logging.getLogger("kpng")

SOURCES: dict[str, SourceSpec] = sources.registered()
SINKS: dict[str, SinkSpec] = sinks.registered()
SUBCOMMANDS: dict[str, CommandSpec] = subcommands.registered()


def _epilog() -> str:
    backends = "\n".join(
        f"  {'to-' + name:10} {registry.lookup(name).help}" for name in registry.names()
    )
    return (
        "sources:\n"
        + "\n".join(f"  {k:10} {v.help}" for k, v in SOURCES.items())
        + "\nsinks:\n"
        + "\n".join(f"  {k:10} {v.help}" for k, v in SINKS.items())
        + f"\nbackends (after to-local, or after local):\n{backends}\n"
        + "\nsubcommands (kpng SUBCOMMAND --help):\n"
        + "\n".join(f"  {k:10} {v.help}" for k, v in SUBCOMMANDS.items())
        + "\n\nEach part takes --help, e.g. `kpng file --help`, `kpng file to-local --help`, "
        "`kpng file to-local to-nft --help`."
    )


class _MainParser(argparse.ArgumentParser):
    def format_help(self) -> str:
        # Listing the backends reads every installed package's entry points: only for --help.
        self.epilog = _epilog()
        return super().format_help()


def _main_parser() -> argparse.ArgumentParser:
    parser = _MainParser(
        prog="kpng",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="kpng [--log-level LEVEL] <source> [flags] <sink> [flags] [<backend> [flags]]\n"
        "       kpng [--log-level LEVEL] local [flags] <backend> [flags]\n"
        "       kpng kube-proxy [kube-proxy's flags]   (a drop-in for kube-proxy)\n"
        "       (before the source: --healthz-bind-address, --metrics-bind-address, "
        "--healthz-timeout,\n"
        "        --http-max-connections, --http-request-timeout)",
        description="kpng: a pluggable Kubernetes service proxy.",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe messages to log (default: info)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text lines, or one JSON object a line (default: text)",
    )
    # kube-proxy's names first; kpng's earlier ones stay as aliases.
    parser.add_argument(
        "--healthz-bind-address",
        "--healthz-address",
        dest="healthz_address",
        metavar="HOST:PORT",
        help="serve /healthz and /livez here (kube-proxy's contract: 503 when a change has "
        "waited longer than --healthz-timeout, or before the first state is programmed)",
    )
    parser.add_argument(
        "--metrics-bind-address",
        "--metrics-address",
        dest="metrics_address",
        metavar="HOST:PORT",
        help="serve Prometheus /metrics here",
    )
    parser.add_argument(
        "--healthz-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long a change may wait unapplied before kpng is unhealthy (default: 60)",
    )
    # kpng.http1.server's MAX_CONNECTIONS and REQUEST_S, not imported: that loads h11 for
    # every command, HTTP or not. A test holds them equal.
    parser.add_argument(
        "--http-max-connections",
        type=int,
        default=512,
        metavar="N",
        help="connections each HTTP address keeps open at most; past them a new one closes the "
        "one idle longest, or is refused when all are busy (default: 512)",
    )
    parser.add_argument(
        "--http-request-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long an HTTP request may take, first byte to last, before its connection is "
        "closed (default: 10)",
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the versions of kpng, its wire API, Python and libnftables, and exit",
    )
    return parser


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help=str(kwargs.get("help")))

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from kpng.version import report

        print(report())
        parser.exit()


def _parser(
    prog: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=help)
    add_arguments(parser)
    return parser


@dataclass
class _Segment:
    name: str
    args: list[str]


def _split(argv: Sequence[str]) -> tuple[list[str], list[_Segment]]:
    """(global args, [source, sink, backend...] segments), cut at the known command names."""
    head: list[str] = []
    segments: list[_Segment] = []
    for arg in argv:
        local = bool(segments) and _feeds_backends(segments[0].name)
        if (
            (not segments and arg in SOURCES)
            or (len(segments) == 1 and not local and arg in SINKS)
            or (
                (len(segments) >= 2 or local)
                and arg.startswith("to-")
                and registry.known(arg.removeprefix("to-"))
            )
        ):
            segments.append(_Segment(arg, []))
        elif segments:
            segments[-1].args.append(arg)
        else:
            head.append(arg)
    return head, segments


def _unknown_backend(args: Sequence[str]) -> None:
    """A ``to-NAME`` where a backend may stand that names none: say so, not argparse's
    "unrecognized arguments"."""
    for arg in args:
        if _BACKEND_LIKE.fullmatch(arg) and not registry.known(arg.removeprefix("to-")):
            names = registry.names()
            close = difflib.get_close_matches(arg.removeprefix("to-"), names, n=1)
            hint = f"; did you mean to-{close[0]}?" if close else ""
            known = ", ".join(f"to-{n}" for n in names)
            raise UsageError(f"unknown backend {arg!r}{hint} (backends: {known})")


_BACKEND_LIKE = re.compile(r"to-[a-z][a-z0-9-]*")


def _help_of_a_later_part(segments: list[_Segment]) -> None:
    """``--help`` on a sink or backend prints that part's help, however incomplete the parts
    before it are (argparse would stop at the source's first missing flag)."""
    for i in range(len(segments) - 1, 0, -1):
        segment = segments[i]
        if "-h" not in segment.args and "--help" not in segment.args:
            continue
        if i == 1 and not _feeds_backends(segments[0].name) and segment.name in SINKS:
            spec = SINKS[segment.name]
            parser = _parser(f"kpng <source> {spec.name}", spec.help, spec.add_arguments)
        elif segment.name.startswith("to-") and registry.known(segment.name.removeprefix("to-")):
            backend = registry.lookup(segment.name.removeprefix("to-"))
            parser = _parser(f"kpng ... {segment.name}", backend.help, backend.add_arguments)
        else:
            continue
        parser.parse_args(["--help"])  # prints and exits 0


@dataclass(frozen=True)
class Pipeline:
    """A parsed command line: the logging options, the coroutine that runs the pipeline, and
    whether a backend stops after its first state (``--once``)."""

    options: argparse.Namespace
    run: Runner
    once: bool


def build(argv: Sequence[str]) -> Pipeline:
    """Parse the command line into what runs it."""
    head, segments = _split(argv)
    _help_of_a_later_part(segments)
    for segment in segments[1:] if segments and not _feeds_backends(segments[0].name) else segments:
        _unknown_backend(segment.args)
    options, unknown = _main_parser().parse_known_args(head)
    if unknown:
        raise UsageError(f"unknown source {unknown[0]!r} (sources: {', '.join(SOURCES)})")
    if not segments:
        _main_parser().print_usage(sys.stderr)
        raise UsageError(f"a source is required ({', '.join(SOURCES)}); see kpng --help")
    status = Status(timeout=options.healthz_timeout, conntrack=RECONCILED)
    source_spec = SOURCES[segments[0].name]
    source_args = _parser(
        f"kpng {source_spec.name}", source_spec.help, source_spec.add_arguments
    ).parse_args(segments[0].args)
    if source_spec.feeds_backends is not None:
        backends_of_source, once = _backends(segments[1:], f"kpng {source_spec.name}", status)
        runner = source_spec.feeds_backends(source_args, backends_of_source, status)
        return Pipeline(options, _with_status(options, status, runner), once)
    if len(segments) < 2:
        raise UsageError(f"a sink is required after {segments[0].name} ({', '.join(SINKS)})")
    sink_spec = SINKS[segments[1].name]
    sink_args = _parser(
        f"kpng <source> {sink_spec.name}", sink_spec.help, sink_spec.add_arguments
    ).parse_args(segments[1].args)

    backends: Callable[[], Fanout] | None = None
    once = sink_spec.once(sink_args)
    if sink_spec.takes_backend:
        backends, once = _backends(segments[2:], f"kpng <source> {sink_spec.name}", status)
    elif len(segments) > 2:
        raise UsageError(f"{sink_spec.name} takes no backend")

    store = status.store = Store()
    status.explain = functools.partial(
        explain_json, store, traffic=functools.partial(_traffic, status)
    )
    status.node = sink_spec.node(sink_args)
    status.nodes_listed = source_spec.lists_nodes
    assert source_spec.create is not None
    source_run = source_spec.create(source_args, store, status.node)
    sink_run = sink_spec.create(sink_args, store, backends, status)
    parts = {"source": source_run, "sink": sink_run}
    if once:
        parts["sync"] = functools.partial(_fail_if_blocked, store)
    return Pipeline(options, _with_status(options, status, _concurrently(parts)), once)


def _traffic(status: Status, node: str) -> Traffic:
    """What this node's backends counted, for ``/debug/explain``: not for another node's
    explanation (asked of a brain, whose backends, if any, count its own traffic)."""
    return traffic_of(status.samples()) if node == status.node else {}


async def _fail_if_blocked(store: Store) -> None:
    """A one-shot run (``--once``) has no state to give while a source cannot sync on its own
    (a file that never parsed): it fails instead of waiting for a fix nobody will make."""
    blocked: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def note(source: SourceHandle) -> None:
        if source.blocked_by and not blocked.done():
            blocked.set_result(f"source {source.name}: {source.blocked_by}")

    for source in store.sources:
        note(source)
    store.block_listeners.append(note)
    raise KpngError(f"{await blocked}; --once has no state to give")


def _concurrently(runners: dict[str, Runner]) -> Runner:
    """Run these together until the first returns or fails (its failure is raised)."""

    async def run() -> None:
        tasks = [asyncio.create_task(r(), name=name) for name, r in runners.items()]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return run


def _with_status(options: argparse.Namespace, status: Status, pipeline: Runner) -> Runner:
    """The pipeline, with the health and metrics server when asked for."""
    # Checked with no address too: a bad value is a mistake to say now, not when one is added.
    if options.http_max_connections <= 0:
        raise UsageError(
            f"--http-max-connections must be positive, got {options.http_max_connections}"
        )
    if not 0 < options.http_request_timeout < math.inf:
        raise UsageError(
            f"--http-request-timeout must be a positive number of seconds, "
            f"got {options.http_request_timeout:g}"
        )
    if options.healthz_address is None and options.metrics_address is None:
        return pipeline
    if options.healthz_timeout <= 0:
        raise UsageError("--healthz-timeout must be positive")
    # The HTTP server is imported only by the commands that serve HTTP.
    from kpng.status.serving import HttpAddress, HttpLimits, serve

    healthz, metrics = (
        HttpAddress.parse(value, flag=flag) if value is not None else None
        for value, flag in (
            (options.healthz_address, "--healthz-bind-address"),
            (options.metrics_address, "--metrics-bind-address"),
        )
    )
    limits = HttpLimits(options.http_max_connections, options.http_request_timeout)
    server = functools.partial(serve, status, healthz=healthz, metrics=metrics, limits=limits)
    return _concurrently({"pipeline": pipeline, "status": server})


def _backends(
    segments: list[_Segment], prog: str, status: Status
) -> tuple[Callable[[], Fanout], bool]:
    """What makes the backends these segments name (one or more), each parsed by its own parser;
    and whether one of them stops after the first state (``--once``)."""
    if not segments:
        names = ", ".join(f"to-{n}" for n in registry.names())
        raise UsageError(f"{prog.split()[-1]} takes one or more backends ({names})")
    parsed: list[tuple[str, BackendSpec, argparse.Namespace]] = []
    once = False
    for segment in segments:
        spec = registry.lookup(segment.name.removeprefix("to-"))
        args = _parser(f"{prog} {segment.name}", spec.help, spec.add_arguments).parse_args(
            segment.args
        )
        taken = sum(1 for name, _, _ in parsed if name.split("#")[0] == segment.name)
        name = segment.name if not taken else f"{segment.name}#{taken + 1}"
        parsed.append((name, spec, args))
        once = once or (spec.once is not None and spec.once(args))

    def fanout() -> Fanout:
        feeders = []
        for name, spec, args in parsed:
            sync = SyncStats()
            backend = spec.create(args, sync)
            # A one-shot run stops at any backend's first failure: nobody waits for the retry.
            feeders.append(
                Feeder(
                    name,
                    backend,
                    sync=sync,
                    reports_syncs=spec.reports_syncs,
                    proxy_mode=spec.proxy_mode,
                    once=once,
                )
            )
        return status.track(Fanout(feeders))

    return fanout, once


def _feeds_backends(name: str) -> bool:
    """Whether the source ``name`` feeds backends itself (``local``), with no sink between."""
    spec = SOURCES.get(name)
    return spec is not None and spec.feeds_backends is not None


async def _run_until_signalled(pipeline: Runner) -> None:
    await until_signalled(
        _concurrently({"pipeline": pipeline, "malloc": malloc.trim_periodically})()
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    subcommand = SUBCOMMANDS.get(argv[0]) if argv else None
    if subcommand is not None:
        done = subcommand.run(argv[1:])
        if isinstance(done, int):
            return done
        argv = done
    try:
        pipeline = build(argv)
    except KpngError as exc:
        print(f"kpng: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(pipeline.options.log_level, pipeline.options.log_format)
    _raise_open_files_limit()
    malloc.configure()
    gcpause.configure()
    try:
        asyncio.run(_run_until_signalled(pipeline.run))
    except KpngError as exc:
        log.error("%s", exc)
        return EXIT_ERROR
    except BrokenPipeError:
        # The reader went away (e.g. `| head -1`): not kpng's failure. Point stdout at /dev/null
        # so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if pipeline.once:
        _exit_without_teardown(0)
    return 0


def _raise_open_files_limit() -> None:
    """The soft limit of open files raised to the hard one, as Go programs (kube-proxy) start:
    1,024 in many container runtimes, which a node's watches, health check node ports and their
    clients can reach. The hard limit is the operator's bound; a failure leaves the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.debug("open files limit: %d, the hard limit already", soft)
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        log.debug("open files limit: %d, not raised to %d: %s", soft, hard, exc)
        return
    log.debug("open files limit: %d, raised to %d", soft, hard)


def _exit_without_teardown(code: int) -> NoReturn:
    """End a finished one-shot run now. The interpreter's own exit frees every object one by one
    and collects them first: 0.8 s of a 10,000-service ``--once`` run's 7 s, for memory the
    kernel takes back at once. What exit must still do is done here: the exit handlers (kpng
    removes its kubeconfig's key files in them), the logs and the standard streams."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
