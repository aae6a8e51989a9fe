"""to-nft from an endpoint change to real traffic, at 100 and at 100,000 services (root).

A test bed of network namespaces (``kpng.testing.netns``): one node with pods ``a``, ``b`` and
``client``. On the node, to-nft in process (``NftBackend`` through libnftables, as ``kpng ...
to-nft`` runs it) is programmed with S services x 10 endpoints (``bench_nft._state``) and one
more, ``ns/target`` at ``bench_nft.TARGET_IP``:80, whose only endpoint is pod ``a``. Each change
moves that endpoint to the other pod (a → b, b → a, ...), and the figure is the time from the
moment the new state is handed to the backend (``NftBackend.apply``) until the first NEW
connection from ``client`` through the ClusterIP is answered by the new pod. The client opens a
connection every ``--interval`` (1 ms: the figures are that coarse) until then, at most
``--watch`` seconds per change; each new connection after that must reach the new pod too.

Meanwhile the client holds one established connection to the old pod, opened before the change,
and asks on it every 50 ms through ``--hold`` seconds after the new pod answered: whether a
connection survives its endpoint's removal from the service (kube-proxy keeps such flows: their
conntrack entry stays, only UDP entries are deleted; the pod itself still runs here).

Sizes run one after the other in the same test bed, the baseline first, with the same number of
changes; the ratio of the largest to the smallest median follows. Every step is bounded; the
namespaces are removed on exit, also on failure.

    flock /tmp/kpng-bench.lock python bench/bench_change_traffic.py [--sizes 100,100000]
        [--changes 20] [--interval 0.001] [--watch 10] [--hold 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

TARGET_PORT = 80
PODS = ("a", "b")
STEP_TIMEOUT_S = 600.0
"""The longest one step may take (a full sync of 100,000 services takes about a minute)."""


# --- the node: to-nft in process, in the node's namespace


def node(services: int, ips: dict[str, str]) -> int:
    """Program ``services`` and the target (on pod ``a``), then one change per input line:
    ``change N`` moves the target's endpoint to the pod not holding it, with revision N."""
    import msgspec
    from bench_nft import _state

    from kpng.backends._conntrack import Conntrack
    from kpng.backends.nft import NftBackend
    from kpng.backends.nft.executing import LibNft
    from kpng.backends.nft.layout import Options
    from kpng.backends.registry import NodeState

    key = ("ns", "target")
    start = time.perf_counter()
    first: Any = _state(services, 1, target=ips["a"])
    built = time.perf_counter() - start

    async def run() -> None:
        # One event loop throughout, as in kpng's process: libnftables' worker thread stays.
        backend = NftBackend(
            nft=LibNft(), options=Options(cluster_cidrs=("10.244.0.0/16",)), conntrack=Conntrack()
        )
        start = time.perf_counter()
        await backend.apply(first)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        _say({"built": built, "full_sync": time.perf_counter() - start, "rss_mib": rss})
        holder = "a"
        target = first.services[key]
        while line := sys.stdin.readline():  # blocking: nothing else runs meanwhile
            holder = "b" if holder == "a" else "a"
            ip = msgspec.structs.replace(target.endpoints[0].IPs, V4=(ips[holder],))
            endpoint = msgspec.structs.replace(target.endpoints[0], IPs=ip)
            services_ = dict(first.services)
            services_[key] = msgspec.structs.replace(target, endpoints=(endpoint,))
            state = NodeState(
                node=first.node,
                revision=int(line.split()[1]),
                services=services_,
                updated=frozenset({key}),
                deleted=frozenset(),
            )
            handed = time.monotonic()
            await backend.apply(state)
            _say({"handed": handed, "applied": time.monotonic(), "to": holder})
        await backend.close()

    asyncio.run(run())
    return 0


# --- the client pod


def _connect(host: str, timeout: float) -> tuple[str, float, float]:
    """One new connection: who answered (or what failed), when it started and ended."""
    start = time.monotonic()
    try:
        with socket.create_connection((host, TARGET_PORT), timeout=timeout) as sock:
            sock.sendall(b"hello\n")
            answer = sock.recv(4096).decode().split(" ", 1)[0].strip() or "closed"
    except TimeoutError:
        answer = "timeout"
    except OSError as exc:
        answer = f"error: {exc}"
    return answer, start, time.monotonic()


def _ask(sock: socket.socket | None) -> str:
    if sock is None:
        return "closed"
    try:
        sock.sendall(b"hello\n")
        return sock.recv(4096).decode().split(" ", 1)[0].strip() or "closed"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"


def client(host: str, interval: float, watch: float, hold: float) -> int:
    """Per input line ``OLD NEW``: hold a connection to OLD, say ``ready``, then connect every
    ``interval`` until NEW answers (at most ``watch`` s), and ``hold`` s more; report."""
    for line in sys.stdin:
        old, new = line.split()
        opened = socket.create_connection((host, TARGET_PORT), timeout=1.0)
        opened.settimeout(0.5)
        held: socket.socket | None = opened
        first = _ask(held)
        if first != old:
            _say({"error": f"the held connection reached {first!r}, not {old}"})
            return 1
        _say({"ready": True})
        deadline = time.monotonic() + watch
        results: list[tuple[str, float, float]] = []
        asked: list[tuple[float, str]] = []
        last_ask = 0.0
        reached: tuple[float, float] | None = None
        last_old = 0.0
        while time.monotonic() < deadline:
            answer, start, end = _connect(host, 1.0)
            results.append((answer, start, end))
            if reached is None:
                if answer == new:
                    reached = (start, end)
                    deadline = end + hold
                elif answer == old:
                    last_old = start
            if end - last_ask >= 0.05:
                last_ask = time.monotonic()
                asked.append((last_ask, _ask(held)))
                if asked[-1][1] != old and held is not None:
                    held.close()
                    held = None
            time.sleep(interval)
        if held is not None:
            held.close()
        after = [a for a, s, _ in results if reached is not None and s > reached[1]]
        before = [a for a, _, e in results if reached is None or e < reached[0]]
        _say(
            {
                "reached": reached,
                "last_old": last_old,
                "connections": len(results),
                "failed_before": [a for a in before if a not in (old, new)],
                "after": len(after),
                "after_not_new": [a for a in after if a != new],
                "held_after": [a for t, a in asked if reached is not None and t > reached[1]],
            }
        )
    return 0


# --- the driver


def _say(message: object) -> None:
    print(json.dumps(message), flush=True)


def _read(proc: subprocess.Popen[str], timeout: float = STEP_TIMEOUT_S) -> Any:
    """The next JSON line ``proc`` prints, within ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise SystemExit(f"no answer within {timeout:.0f} s from {_name(proc)}")
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"{_name(proc)} exited ({proc.wait()})")
    return json.loads(line)


def _name(proc: subprocess.Popen[str]) -> str:
    return "the node" if "--node" in list(proc.args) else "the client"  # type: ignore[arg-type]


def _send(proc: subprocess.Popen[str], line: str) -> None:
    stdin: IO[str] | None = proc.stdin
    assert stdin is not None
    stdin.write(line + "\n")
    stdin.flush()


def _percentile(values: Sequence[float], p: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * p))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def measure(args: argparse.Namespace) -> int:
    from bench_nft import TARGET_IP

    from kpng.testing.netns import ClusterSpec, TestBed

    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    medians: dict[int, float] = {}
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores; other work skews timings)")
    with TestBed(ClusterSpec.parse({"node-1": ["a", "b", "client"]})) as bed:
        ips = {pod: bed.pod(pod).ip4 for pod in PODS}
        spawned: list[subprocess.Popen[str]] = []

        def spawn(netns: str, argv: list[str]) -> subprocess.Popen[str]:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            spawned.append(proc)
            return proc

        try:
            probe = [*me, "--client", TARGET_IP, "--interval", str(args.interval)]
            probe += ["--watch", str(args.watch), "--hold", str(args.hold)]
            prober = spawn(bed.pod("client").netns, probe)
            node_ns = bed.nodes["node-1"].netns
            for size in args.sizes:
                node_argv = [*me, "--node", json.dumps(ips), "--services", str(size)]
                medians[size] = _size(args, size, spawn(node_ns, node_argv), prober)
                bed.exec(node_ns, ["nft", "delete", "table", "inet", "kpng"])
        finally:
            for proc in spawned:
                if proc.stdin is not None:
                    proc.stdin.close()
            for proc in spawned:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    small, large = min(medians), max(medians)
    if small != large:
        print(
            f"ratio of medians, {large:,} / {small:,} services: "
            f"{medians[large] / medians[small]:.2f}"
        )
    return 0


def _size(
    args: argparse.Namespace,
    size: int,
    node_proc: subprocess.Popen[str],
    prober: subprocess.Popen[str],
) -> float:
    """The changes at ``size`` services; the median change → traffic."""
    started = _read(node_proc)
    print(
        f"{size:,} services x 10 endpoints: state built in {started['built']:.1f} s, full sync "
        f"{started['full_sync']:.2f} s, node process peak RSS {started['rss_mib']:.0f} MiB"
    )
    traffic: list[float] = []
    kernel: list[float] = []
    lower: list[float] = []
    connections = 0
    problems: list[str] = []
    held: list[tuple[str, list[str]]] = []
    holder = "a"
    for i in range(args.changes):
        new = "b" if holder == "a" else "a"
        _send(prober, f"{holder} {new}")
        if "error" in (ready := _read(prober, 10)):
            raise SystemExit(f"change {i}: {ready['error']}")
        _send(node_proc, f"change {2 + i}")
        applied = _read(node_proc)
        seen = _read(prober, args.watch + args.hold + 30)
        if seen["reached"] is None:
            raise SystemExit(f"change {i}: no new connection reached pod {new} in {args.watch} s")
        handed = applied["handed"]
        traffic.append(seen["reached"][1] - handed)
        kernel.append(applied["applied"] - handed)
        # The switch came after the last connection the old pod answered had started.
        lower.append(max(seen["last_old"] - handed, 0.0))
        connections += seen["connections"]
        problems += [f"before: {a}" for a in seen["failed_before"]]
        problems += [f"after, reached {a}" for a in seen["after_not_new"]]
        held.append((holder, seen["held_after"]))
        holder = new
    assert node_proc.stdin is not None
    node_proc.stdin.close()
    node_proc.wait(timeout=60)
    median = _percentile(traffic, 0.5)
    print(
        f"  change → first new connection on the new pod: median {_ms(median)} ms, p99 "
        f"{_ms(_percentile(traffic, 0.99))} ms, worst {_ms(max(traffic))} ms "
        f"({args.changes} changes, {connections:,} connections)"
    )
    print(
        f"  change → rules in the kernel (apply returned): median "
        f"{_ms(_percentile(kernel, 0.5))} ms, p99 {_ms(_percentile(kernel, 0.99))} ms, worst "
        f"{_ms(max(kernel))} ms; the last new connection the old pod answered had started "
        f"{_ms(_percentile(lower, 0.5))} ms after the change (median; the switch came later)"
    )
    print(f"  new connections failed or reached the old pod: {len(problems)} {problems[:5]}")
    kept = sum(bool(answers) and all(a == old for a in answers) for old, answers in held)
    others = sorted({a for old, answers in held for a in answers if a != old})
    asked = sum(len(answers) for _, answers in held)
    print(
        f"  established connection to the old pod, asked every 50 ms through {args.hold} s "
        f"after the new pod answered: {kept}/{len(held)} kept answering from the old pod "
        f"({asked} answers){f', other answers: {others}' if others else ''}"
    )
    return median


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=_sizes, default=[100, 100000])
    parser.add_argument("--changes", type=int, default=20, help="per size")
    parser.add_argument("--interval", type=float, default=0.001, help="between new connections")
    parser.add_argument("--watch", type=float, default=10.0, help="per change, at most")
    parser.add_argument("--hold", type=float, default=0.5, help="after the new pod answered")
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--services", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node:
        return node(args.services, json.loads(args.node))
    if args.client:
        return client(args.client, args.interval, args.watch, args.hold)
    return measure(args)


def _sizes(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


if __name__ == "__main__":
    sys.exit(main())
