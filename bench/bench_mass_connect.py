"""A mass connect against the brain: do calls end before kpng sees them? (issue 42, item 3)

A brain, ``kpng file --input DIR to-api --listen unix://SOCK``, is sent ``--streams`` localv1
Watch streams at once, ``--per-connection`` to a connection, from ``--clients`` processes
(``bench_abuse``'s request-less streams). Every stream that reaches kpng's handler is ended by
it after 10 s without a request (``bench_abuse`` sets the brain's bound so), DEADLINE_EXCEEDED
"no request within 10 s"; any other ending (CANCELLED, INTERNAL, UNAVAILABLE) is a call that
ended before kpng's code saw it. With ``--watches N``, then N real authorized watches to their
first state (``bench_abuse``'s third measurement, 4 processes), counting the retries they
needed, by status.

Each is run against the brain twice (``--limits``): ``kpng``, as it is, and ``grpc``, the same
brain with gRPC's default limits of calls waiting in its core for the server to take them
(1,000, and 3,000 past which all are refused), set by a wrapper that changes
``kpng.server.serving``'s constants before kpng starts. The second is what kpng did before
docs/design/mass-connect.md.

Bounded: 3,000 streams take some 40 s a run; the exit status is non-zero only if something
crashed or timed out.

    python bench/bench_mass_connect.py [--streams 3000] [--per-connection 100] [--clients 4]
        [--watches 0] [--nodes 1000] [--limits kpng,grpc]
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import bench_abuse
import synthetic
from bench_abuse import Clients, _brain, _split, _stream_client, fake_api_server, write_cluster
from bench_api import PYTHON, BenchError

REACHED = "DEADLINE_EXCEEDED: no request within"
"""How kpng's handler ends a stream that never asks (kpng.server.serving.FIRST_REQUEST_S)."""
GRPC_DEFAULTS = (1_000, 3_000)
"""gRPC's own grpc.server.max_pending_requests and its hard limit."""
_WRAPPER = (
    "import sys\n"
    "import kpng.server.serving as serving\n"
    "serving.PENDING_CALLS, serving.PENDING_CALLS_HARD = {soft}, {hard}\n"
    "from kpng.cli import main\n"
    "sys.exit(main())\n"
)


def _command(limits: str) -> list[str] | None:
    if limits == "kpng":
        return None
    soft, hard = GRPC_DEFAULTS
    return [PYTHON, "-c", _WRAPPER.format(soft=soft, hard=hard)]


def streams(args: argparse.Namespace, workdir: Path, limits: str) -> collections.Counter[str]:
    """The streams' endings, by status and details; printed with how long they took."""
    cluster = workdir / f"streams-{limits}-cluster"
    if not cluster.exists():
        write_cluster(cluster, 10, synthetic.NODES)
    connections = -(-args.streams // args.per_connection)
    codes: collections.Counter[str] = collections.Counter()
    with _brain(workdir, cluster, f"streams-{limits}", command=_command(limits)) as brain:
        bench_abuse._first_state(brain.api, synthetic.node_name(0), None)
        shares = [
            (brain.api, count, args.per_connection, "")
            for count in _split(connections, args.clients)
            if count
        ]
        clients = Clients(_stream_client, shares)
        try:
            clients.gather("ready", bench_abuse.START_S)
            started = time.monotonic()
            clients.tell("go")
            opened = max(m["at"] for m in clients.gather("opened", bench_abuse.WORKER_S))
            ended = clients.gather("ended", bench_abuse.STREAM_END_S + bench_abuse.WORKER_S)
            for message in ended:
                codes.update(message["codes"])
            clients.tell("close")
            clients.gather("closed", bench_abuse.WORKER_S)
        finally:
            clients.stop()
    reached = sum(n for code, n in codes.items() if code.startswith(REACHED))
    early = {code: n for code, n in codes.items() if not code.startswith(REACHED)}
    print(
        f"  {limits:4} limits: {sum(codes.values())} streams opened in {opened - started:.1f} s; "
        f"{reached} reached kpng, {sum(early.values())} ended before it"
        f"{f' ({early})' if early else ''}"
    )
    return codes


def _terminated(signum: int, _: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=3000, help="request-less streams")
    parser.add_argument("--per-connection", type=int, default=100, help="at most 100")
    parser.add_argument("--clients", type=int, default=4, help="client processes (default: 4)")
    parser.add_argument("--watches", type=int, default=0, help="authorized watches (default: 0)")
    parser.add_argument("--nodes", type=int, default=1000, help="the watches' distinct nodes")
    parser.add_argument(
        "--limits",
        type=bench_abuse._names(("kpng", "grpc")),
        default=["kpng", "grpc"],
        help="kpng,grpc: kpng's waiting-call limits, or gRPC's defaults",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.per_connection <= 100:
        parser.error("--per-connection: 1 to 100 (the brain's cap)")
    if min(args.streams, args.clients, args.nodes) < 1 or args.watches < 0:
        parser.error("sizes are at least 1 (--watches: 0 skips them)")
    signal.signal(signal.SIGTERM, _terminated)
    bench_abuse._raise_nofile(4096)
    start = time.perf_counter()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="kpng-mass-", dir="/tmp") as tmp,
            fake_api_server(Path(tmp)) as kubeconfig,
        ):
            workdir = Path(tmp)  # short: a unix socket's path must fit in 108 bytes
            connections = -(-args.streams // args.per_connection)
            print(
                f"== {connections * args.per_connection} request-less streams, "
                f"{args.per_connection} a connection, from {args.clients} processes"
            )
            for limits in args.limits:
                streams(args, workdir, limits)
            if args.watches:
                watch_args = argparse.Namespace(
                    watches=args.watches,
                    nodes=args.nodes,
                    clients=args.clients,
                    watch_per_connection=1,
                    watch_services=10,
                )
                for limits in args.limits:
                    print(f"\n-- {limits} limits")
                    bench_abuse.bench_watches(
                        watch_args, workdir, kubeconfig, _command(limits), f"watches-{limits}"
                    )
    except (BenchError, TimeoutError) as exc:
        print(f"bench_mass_connect: {exc!r}", file=sys.stderr)
        return 1
    print(f"\n(bench_mass_connect took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
