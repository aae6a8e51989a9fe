"""A fleet failing over between two brains: issue 42's fail-over targets (docs/design/resume.md).

Two brain replicas, ``kpng file --input DIR to-api --listen tcp://127.0.0.1:PORT`` in
subprocesses, read the same ``synthetic.py`` cluster (``--services`` x ``--endpoints``, split
over ``--files`` List files, the endpoints spread over ``--cluster-nodes``, by default
``--nodes``: how many services a node hosts an endpoint of, and so resolves for itself alone).
``--nodes`` node agents run in ``--processes`` spawned processes: each is kpng's own
``kpng.remote.watching.watch_local`` with a Sink that counts its calls, and an ``--api``
listing both replicas, A first; so each holds the digests of its state and resumes exactly as
``kpng local`` does. Each node has a TCP connection of its own, as real nodes have
(gRPC's local subchannel pool: without it the nodes of a process would share one connection,
and its cap of 100 streams).

1. **First states**: every node connects to A. Seconds from the start until the last node has
   its first state, A's CPU per first state, the agents' memory per node.
2. **Unchanged fail-over**: A is killed (SIGKILL). Seconds until every node is back on a live
   watch from B (its first Sync there: ``is back``, logged by kpng's watch), the bytes per node
   of the reconnection, the nodes whose sink was handed anything (target: 0), and B's CPU from
   the kill until the last node was back.
3. **A change while away**: A is started again (same port) and serves; B is killed, and one
   endpoint of a service every node sees moves (``bench_api.FileChanges``) in the file A reads.
   Every node must be back on A and handed that change exactly once: the same calls on every
   node, one Sync.

Bytes are counted by the kernel: ``ss -ti``'s ``bytes_received`` and ``bytes_acked`` of each
established TCP connection from a node to the surviving brain, read once every node is back,
so TCP payload (HTTP/2 and gRPC framing included; no IP or TCP headers), of the connection that
carried the resumed watch (a node that failed to connect first and then retried is counted on
the connection that worked only), plus the keepalive pings of its seconds.

Calls that end are counted by cause from kpng's own ``WatchRecord`` (``kpng_watch_failures``):
in 2 and 3 each node's call to the killed brain ends once (UNAVAILABLE or ``ended``); anything
beyond that is a call that ended early.

Each full agent holds a digest per item of its state, so the nodes' memory is some ``nodes x
(1 MB + services x (endpoints + 1) x 0.25 KB)`` (measured: 3.9 MB a node at 1,000 services,
26.8 MB at 10,000; 5,000 nodes of 10,000 services would need some 140 GB). The bench refuses a
size whose estimate passes ``--memory-gb`` rather than push the machine into the OOM killer.
Missed targets are reported, not failed; the exit status is non-zero only if something crashed
or a step passed ``--timeout``.

    python bench/bench_failover.py [--nodes 5000] [--services 10000] [--endpoints 10]
        [--cluster-nodes N] [--processes 4] [--files 100] [--timeout 1200] [--memory-gb 12]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import synthetic
from bench_abuse import Clients, _raise_nofile, _split
from bench_api import BenchError, ClusterFile, FileChanges, KpngProcess, kpng_command, verdict

from rig import tcpinfo

TARGET_S = 60.0
TARGET_BYTES = 1024
ITEM_BYTES = 250
"""An agent's memory per item of its state (digests, paths, dicts, its share of buffers)."""
NODE_BYTES = 1_000_000
"""An agent's memory besides its state (its channel, its connection's buffers, its task)."""
POLL_S = 1.0
SETTLE_S = 3.0
"""After the change reached every node: a second delivery would show within this."""
LISTEN_S = 120.0


class Brain(KpngProcess):
    """``kpng file --input DIR to-api --listen tcp://127.0.0.1:PORT``."""

    def __init__(self, cluster: Path, port: int, log: Path) -> None:
        self.port = port
        self.url = f"tcp://127.0.0.1:{port}"
        self._ticks = os.sysconf("SC_CLK_TCK")
        super().__init__(
            [
                *kpng_command(),
                *("--log-level", "warning", "file", "--input", str(cluster)),
                *("to-api", "--listen", self.url),
            ],
            log,
        )

    def wait_listening(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"brain {self.url} exited {self.proc.returncode}")
            with socket.socket() as s, contextlib.suppress(OSError):
                s.connect(("127.0.0.1", self.port))
                return
            if time.monotonic() > deadline:
                raise BenchError(f"brain {self.url} did not listen in time")
            time.sleep(0.1)

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._ticks

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


# --- the node agents' processes


_NODE: contextvars.ContextVar[int] = contextvars.ContextVar("node")


@dataclass
class Node:
    """One node agent's view, from its Sink and kpng's log."""

    first: float | None = None
    """When its sink had its first Sync (monotonic: one clock for every process)."""
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    """Its sink's calls since the phase began, by kind (counted, not listed: a first state is
    110,000 calls, which a status would otherwise go through every second)."""
    synced: float | None = None
    """Its sink's first Sync since the phase began."""
    back: float | None = None
    """When kpng's watch said it was back (a Sync after an outage) since the phase began."""


class CountingSink:
    """A kpng Sink that counts its calls: what a node's backend would be handed."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def reset(self) -> None:
        self.node.calls["reset"] += 1

    def set_service(self, service: object) -> None:
        self.node.calls["set_service"] += 1

    def delete_service(self, namespace: str, name: str) -> None:
        self.node.calls["delete_service"] += 1

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: object) -> None:
        self.node.calls["set_endpoint"] += 1

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        self.node.calls["delete_endpoint"] += 1

    def sync(self) -> bool:
        node = self.node
        node.calls["sync"] += 1
        now = time.monotonic()
        if node.first is None:
            node.first = now
        if node.synced is None:
            node.synced = now
        return False


class _Back(logging.Handler):
    """kpng's watch saying a node's watch is back; which node, from the task's context."""

    def __init__(self, nodes: list[Node]) -> None:
        super().__init__(logging.INFO)
        self.nodes = nodes

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO and "is back" in record.getMessage():
            i = _NODE.get(None)
            if i is not None and self.nodes[i].back is None:
                self.nodes[i].back = time.monotonic()


def _pattern(calls: collections.Counter[str]) -> str:
    return ", ".join(f"{calls[k]} {k}" for k in sorted(calls)) or "nothing"


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _agents(api: str, first: int, count: int, pipe: Connection) -> None:
    """Process: node agents ``first``.. ``first + count - 1``, told ``go``, ``mark`` (a phase
    begins), ``status`` and ``close``."""
    from kpng.backoff import Backoff
    from kpng.remote import address, watching
    from kpng.remote.address import Api

    # One TCP connection per node, as on real nodes (gRPC shares one between equal channels of
    # a process otherwise).
    address.KEEPALIVE = (  # type: ignore[assignment]  # one more option than kpng's
        *address.KEEPALIVE,
        ("grpc.use_local_subchannel_pool", 1),
    )
    _raise_nofile(65536)
    nodes = [Node() for _ in range(count)]
    log = logging.getLogger("kpng.remote.watching")
    log.addHandler(_Back(nodes))
    log.setLevel(logging.INFO)
    log.propagate = False  # thousands of nodes' warnings: counted by WATCHED instead
    pipe.send({"step": "ready", "rss_mb": _rss_mb()})
    if pipe.recv() != "go":
        return

    async def agent(i: int) -> None:
        _NODE.set(i)
        await watching.watch_local(
            CountingSink(nodes[i]),
            api=Api.parse(api),
            node_name=synthetic.node_name(first + i),
            backoff=Backoff(initial=0.1, maximum=2.0),
        )

    def counts(value: dict[str, int]) -> dict[str, int]:
        return dict(value)

    async def run() -> None:
        tasks = [asyncio.create_task(agent(i)) for i in range(count)]
        failures, first_states = counts(watching.WATCHED.failures), {"whole": 0, "resumed": 0}
        record = watching.WATCHED
        try:
            while True:
                if not await asyncio.to_thread(pipe.poll, 0.5):
                    continue
                command = pipe.recv()
                if command == "close":
                    return
                if command == "mark":
                    for node in nodes:
                        node.calls, node.synced, node.back = collections.Counter(), None, None
                    failures = counts(record.failures)
                    first_states = counts(record.first_states)
                    pipe.send({"step": "mark"})
                elif command == "status":
                    crashed = [t for t in tasks if t.done()]
                    if crashed:
                        pipe.send({"step": "status", "crashed": repr(crashed[0].exception())})
                        continue
                    firsts = [n.first for n in nodes if n.first is not None]
                    backs = [n.back for n in nodes if n.back is not None]
                    syncs = [n.synced for n in nodes if n.synced is not None]
                    pipe.send(
                        {
                            "step": "status",
                            "first": len(firsts),
                            "first_last": max(firsts, default=0.0),
                            "back": len(backs),
                            "back_last": max(backs, default=0.0),
                            "synced": len(syncs),
                            "synced_last": max(syncs, default=0.0),
                            "applied": sum(1 for n in nodes if n.calls),
                            "patterns": collections.Counter(_pattern(n.calls) for n in nodes),
                            "failures": {
                                k: v - failures.get(k, 0)
                                for k, v in record.failures.items()
                                if v > failures.get(k, 0)
                            },
                            "first_states": {
                                k: v - first_states.get(k, 0)
                                for k, v in record.first_states.items()
                            },
                            "rss_mb": _rss_mb(),
                            "cpu_s": time.process_time(),
                        }
                    )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    pipe.send({"step": "closed"})


# --- the phases


@dataclass
class Status:
    """The agents' processes' statuses, summed."""

    first: int = 0
    first_last: float = 0.0
    back: int = 0
    back_last: float = 0.0
    synced: int = 0
    synced_last: float = 0.0
    applied: int = 0
    patterns: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    first_states: collections.Counter[str] = field(default_factory=collections.Counter)
    rss_mb: float = 0.0
    cpu_s: float = 0.0


def status(clients: Clients) -> Status:
    clients.tell("status")
    total = Status()
    for message in clients.gather("status", 120):
        if "crashed" in message:
            raise BenchError(f"a node agent ended: {message['crashed']}")
        for name in ("first", "back", "synced", "applied", "rss_mb", "cpu_s"):
            setattr(total, name, getattr(total, name) + message[name])
        for name in ("first_last", "back_last", "synced_last"):
            setattr(total, name, max(getattr(total, name), message[name]))
        total.patterns.update(message["patterns"])
        total.failures.update(message["failures"])
        total.first_states.update(message["first_states"])
    return total


def until(
    clients: Clients, done: Callable[[Status], bool], what: str, deadline: float, every: float
) -> Status:
    """Poll the agents until ``done``; progress every ``every`` seconds."""
    shown = time.monotonic()
    while True:
        now = status(clients)
        if done(now):
            return now
        if time.monotonic() > deadline:
            raise BenchError(
                f"timed out waiting for {what}: {now.first} first states, {now.back} back, "
                f"{now.synced} synced in this phase, failures {dict(now.failures)}"
            )
        if time.monotonic() - shown > every:
            shown = time.monotonic()
            print(
                f"   ... {what}: {now.first} first states, {now.back} back, {now.synced} "
                f"synced, failures {dict(now.failures)}",
                flush=True,
            )
        time.sleep(POLL_S)


def socket_bytes(port: int) -> tuple[int, int, int, int]:
    """(connections, bytes up, bytes down, the most on one) of established TCP connections to
    ``port`` on loopback, from the kernel's tcp_info (``rig.tcpinfo``)."""
    connections = tcpinfo.established(f"127.0.0.1:{port}")
    up = sum(c.up for c in connections)
    down = sum(c.down for c in connections)
    return len(connections), up, down, max((c.up + c.down for c in connections), default=0)


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    cpu_s: float = 0.0
    agents_cpu_s: float = 0.0
    """The agents' processes' CPU over the phase, summed."""
    connections: int = 0
    up: int = 0
    down: int = 0
    most: int = 0
    applied: int = 0
    patterns: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    first_states: collections.Counter[str] = field(default_factory=collections.Counter)


def _terminated(signum: int, _: object) -> None:
    raise SystemExit(128 + signum)


def _probe(url: str, deadline: float) -> None:
    """One node's first state from ``url``: the brain serves."""
    from kpng.remote.watching import watch_local

    class Stop(CountingSink):
        def sync(self) -> bool:
            return True

    async def run() -> None:
        async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
            await watch_local(Stop(Node()), api=url, node_name=synthetic.node_name(0))

    asyncio.run(run())


def bench(args: argparse.Namespace, workdir: Path) -> list[Phase]:
    deadline = time.monotonic() + args.timeout
    synthetic.ENDPOINTS_PER_SERVICE = args.endpoints
    print(
        f"generating {args.services} services x {args.endpoints} endpoints over "
        f"{args.cluster_nodes} nodes, {args.nodes} of them watching ...",
        flush=True,
    )
    cluster = ClusterFile(workdir, args.services, nodes=args.cluster_nodes, files=args.files)
    print(f"  {cluster.size_mb:.1f} MB of manifests in {args.files} files", flush=True)
    a = Brain(cluster.path, args.port_a, workdir / "a.log")
    b = Brain(cluster.path, args.port_b, workdir / "b.log")
    brains = [a, b]
    clients: Clients | None = None
    phases: list[Phase] = []
    every = max(10.0, args.timeout / 40)
    try:
        a.wait_listening(deadline)
        b.wait_listening(deadline)
        _probe(a.url, deadline)
        _probe(b.url, deadline)
        shares = [n for n in _split(args.nodes, args.processes) if n]
        starts = [sum(shares[:k]) for k in range(len(shares))]
        clients = Clients(
            _agents, [(f"{a.url},{b.url}", s, n) for s, n in zip(starts, shares, strict=True)]
        )
        base_mb = sum(m["rss_mb"] for m in clients.gather("ready", 120))

        # 1. every node's first state, from A
        one = Phase("1. first states from A")
        cpu = a.cpu_s()
        start = time.monotonic()
        clients.tell("go")
        now = until(clients, lambda s: s.first == args.nodes, "first states", deadline, every)
        one.seconds = now.first_last - start
        one.cpu_s = a.cpu_s() - cpu
        one.connections, one.up, one.down, one.most = socket_bytes(a.port)
        one.failures, one.first_states = now.failures, now.first_states
        one.patterns = now.patterns
        per_node_mb = (now.rss_mb - base_mb) / args.nodes
        phases.append(one)
        print(
            f"1. {args.nodes} first states in {one.seconds:.1f} s; A's CPU {one.cpu_s:.1f} s, "
            f"{one.cpu_s / args.nodes * 1000:.1f} ms per first state; "
            f"{one.down / args.nodes / 1e6:.2f} MB per node; "
            f"the agents' memory {per_node_mb:.1f} MB per node; "
            f"calls ended: {dict(one.failures) or 'none'}",
            flush=True,
        )
        clients.tell("mark")
        clients.gather("mark", 60)
        time.sleep(SETTLE_S)

        # 2. A killed: every node resumes on B
        two = Phase("2. A killed, unchanged")
        clients.tell("mark")
        clients.gather("mark", 60)
        agents_cpu = status(clients).cpu_s
        cpu = b.cpu_s()
        start = time.monotonic()
        a.kill()
        now = until(clients, lambda s: s.back == args.nodes, "nodes back on B", deadline, every)
        two.cpu_s = b.cpu_s() - cpu
        two.agents_cpu_s = now.cpu_s - agents_cpu
        two.seconds = now.back_last - start
        two.connections, two.up, two.down, two.most = socket_bytes(b.port)
        two.applied, two.patterns = now.applied, now.patterns
        two.failures, two.first_states = now.failures, now.first_states
        phases.append(two)
        print(
            f"2. A SIGKILLed: {now.back} nodes back on B in {two.seconds:.1f} s; "
            f"{(two.up + two.down) / args.nodes:,.0f} bytes per node ({two.up:,} up, "
            f"{two.down:,} down on {two.connections} connections, at most {two.most:,} on "
            f"one); {two.applied} nodes' sinks handed anything; B's CPU {two.cpu_s:.2f} s, the "
            f"agents' {two.agents_cpu_s:.1f} s; "
            f"first states {dict(two.first_states)}; calls ended {dict(two.failures)}",
            flush=True,
        )

        # 3. A back, B killed, one change meanwhile
        three = Phase("3. B killed, one change")
        a = Brain(cluster.path, args.port_a, workdir / "a2.log")
        brains.append(a)
        a.wait_listening(deadline)
        _probe(a.url, deadline)
        time.sleep(SETTLE_S)
        clients.tell("mark")
        clients.gather("mark", 60)
        agents_cpu = status(clients).cpu_s
        cpu = a.cpu_s()
        start = time.monotonic()
        b.kill()
        changed = FileChanges(cluster, seed=1).apply()
        now = until(
            clients,
            lambda s: s.back == args.nodes and s.synced == args.nodes,
            "the change on every node",
            deadline,
            every,
        )
        three.cpu_s = a.cpu_s() - cpu
        three.agents_cpu_s = now.cpu_s - agents_cpu
        three.seconds = max(now.back_last, now.synced_last) - start
        three.connections, three.up, three.down, three.most = socket_bytes(a.port)
        time.sleep(SETTLE_S)
        now = status(clients)
        three.applied, three.patterns = now.applied, now.patterns
        three.failures, three.first_states = now.failures, now.first_states
        phases.append(three)
        print(
            f"3. B SIGKILLed, {changed} changed: every node back on A with it in "
            f"{three.seconds:.1f} s; {(three.up + three.down) / args.nodes:,.0f} bytes per "
            f"node; A's CPU {three.cpu_s:.2f} s, the agents' {three.agents_cpu_s:.1f} s; "
            f"the sinks' calls: {dict(three.patterns)}; first states "
            f"{dict(three.first_states)}; calls ended {dict(three.failures)}",
            flush=True,
        )
    except BaseException:
        for brain in brains:
            print(f"{brain.url}'s log (tail):\n{brain.log_tail()}", file=sys.stderr)
        raise
    finally:
        if clients is not None:
            with contextlib.suppress(Exception):
                clients.tell("close")
                clients.gather("closed", 60)
            clients.stop()
        for brain in brains:
            with contextlib.suppress(Exception):
                brain.stop()
    return phases


def report(phases: list[Phase], nodes: int) -> None:
    print()
    print(
        "| phase | seconds | bytes per node (up + down) | nodes handed anything | "
        "brain CPU s | first states | calls ended |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in phases:
        print(
            f"| {p.name} | {p.seconds:.1f} | {(p.up + p.down) / nodes:,.0f} | "
            f"{p.applied if p.name[0] != '1' else nodes} | {p.cpu_s:.2f} | "
            f"{dict(p.first_states) or '-'} | {dict(p.failures) or 'none'} |"
        )
    if len(phases) < 3:
        return
    _, two, three = phases
    per_node = (two.up + two.down) / nodes
    print()
    print(
        f"unchanged fail-over within {TARGET_S:g} s: {two.seconds:.1f} s "
        f"({two.seconds / TARGET_S:.2f} of the target): {verdict(two.seconds <= TARGET_S)}"
    )
    print(
        f"≤ {TARGET_BYTES} bytes per unchanged node: {per_node:,.0f} "
        f"({per_node / TARGET_BYTES:.2f} of the target): {verdict(per_node <= TARGET_BYTES)}"
    )
    print(f"0 sinks handed anything: {two.applied}: {verdict(two.applied == 0)}")
    once = len(three.patterns) == 1 and next(iter(three.patterns)).count("1 sync") == 1
    print(
        f"the change on every node, once, within {TARGET_S:g} s: {three.seconds:.1f} s, "
        f"{dict(three.patterns)}: {verdict(once and three.seconds <= TARGET_S)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=5000, help="node agents (default: 5000)")
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--endpoints", type=int, default=10, help="per service (default: 10)")
    parser.add_argument(
        "--cluster-nodes",
        type=int,
        help="the cluster's nodes, over which its endpoints are spread (default: --nodes)",
    )
    parser.add_argument("--processes", type=int, default=4, help="the agents' processes")
    parser.add_argument("--files", type=int, default=100, help="List files of the manifests")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds, in all")
    parser.add_argument(
        "--memory-gb", type=float, default=12.0, help="the agents' estimated memory, at most"
    )
    args = parser.parse_args(argv)
    args.cluster_nodes = args.cluster_nodes or args.nodes
    if args.cluster_nodes < args.nodes:
        parser.error("--cluster-nodes: at least --nodes (each agent is one of the cluster's nodes)")
    if min(args.nodes, args.services, args.endpoints, args.processes, args.files) < 1:
        parser.error("sizes are at least 1")
    items = args.services * (args.endpoints + 1)
    estimate_gb = args.nodes * (NODE_BYTES + items * ITEM_BYTES) / 1e9
    if estimate_gb > args.memory_gb:
        parser.error(
            f"{args.nodes} full agents of {args.services} services x {args.endpoints} "
            f"endpoints need some {estimate_gb:.0f} GB (1 MB each and {ITEM_BYTES} bytes "
            f"an item), past --memory-gb {args.memory_gb:g}"
        )
    from kpng.testing.ports import free_port

    args.port_a, args.port_b = free_port(), free_port()
    signal.signal(signal.SIGTERM, _terminated)
    _raise_nofile(65536)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kpng-failover-") as tmp:
            phases = bench(args, Path(tmp))
    except (BenchError, TimeoutError) as exc:
        print(f"bench_failover: {exc or 'timed out'}", file=sys.stderr)
        return 1
    report(phases, args.nodes)
    print(f"\n(bench_failover took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
