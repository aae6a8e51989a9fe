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

Then the same through the whole process (``--no-process`` skips it): ``kpng file --input DIR
to-local --node-name node-000 to-nft`` in the node, DIR holding ``synthetic.py``'s cluster of
S services in one file and the target in another, which each change replaces (a rename); the
figure runs from the rename. The file source notices it through inotify (``watchfiles``,
which yields once 30 ms pass without another event), re-reads that small file only, and the change
flows through the store, to-local and to-nft as in a cluster.

Sizes run one after the other in the same test bed, the baseline first, with the same number of
changes; the ratio of the largest to the smallest median follows, per mode. Every step is
bounded; the namespaces are removed on exit, also on failure.

    flock /tmp/kpng-bench.lock python bench/bench_change_traffic.py [--sizes 100,100000]
        [--changes 20] [--interval 0.001] [--watch 10] [--hold 0.5] [--no-process]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench_nft import TARGET_IP
from bench_split import BACKEND, HEALTHZ, KPNG, NODE, compiled_as_installed
from stats import nearest_rank

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
    from kpng.backends._nftables import NftBackend
    from kpng.backends._nftables.executing import LibNft
    from kpng.backends._nftables.layout import Options
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


def client(host: str, interval: float, hold: float) -> int:
    """Per input line ``OLD NEW WATCH``: hold a connection to OLD, say ``ready``, then connect
    every ``interval`` until NEW answers (at most WATCH s), and ``hold`` s more; report. With
    OLD ``-``, only wait for NEW, connecting every 50 ms."""
    for line in sys.stdin:
        old, new, watch = line.split()
        held: socket.socket | None = None
        pause = 0.05
        if old != "-":
            held = socket.create_connection((host, TARGET_PORT), timeout=1.0)
            held.settimeout(0.5)
            first = _ask(held)
            if first != old:
                _say({"error": f"the held connection reached {first!r}, not {old}"})
                return 1
            _say({"ready": True})
            pause = interval
        deadline = time.monotonic() + float(watch)
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
            if held is not None and end - last_ask >= 0.05:
                last_ask = time.monotonic()
                asked.append((last_ask, _ask(held)))
                if asked[-1][1] != old:
                    held.close()
                    held = None
            time.sleep(pause)
        if held is not None:
            held.close()
        after = [(a, s) for a, s, _ in results if reached is not None and s > reached[1]]
        before = [(a, s) for a, s, e in results if reached is None or e < reached[0]]
        _say(
            {
                "reached": reached,
                "last_old": last_old,
                "connections": len(results),
                "durations": [e - s for _, s, e in results],
                "failed_before": [(a, s) for a, s in before if a not in (old, new)],
                "after": len(after),
                "after_not_new": [(a, s) for a, s in after if a != new],
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


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


Popen = subprocess.Popen[str]
Handed = tuple[float, float | None]
"""When a change was handed over, and when the backend had applied it if known."""


@dataclass
class Changes:
    """What the changes of one size and mode showed."""

    traffic: list[float] = field(default_factory=list)
    """Seconds from each change to the first new connection the new pod answered."""
    kernel: list[float] = field(default_factory=list)
    """Seconds from each change until ``apply`` returned (in process only)."""
    lower: list[float] = field(default_factory=list)
    """When the last new connection the old pod answered had started (the switch came later)."""
    connections: int = 0
    durations: list[float] = field(default_factory=list)
    """Seconds each new connection took, connect to answer."""
    problems: list[str] = field(default_factory=list)
    held: list[tuple[str, list[str]]] = field(default_factory=list)
    """The old pod, and what the connection held to it answered after the new pod answered."""


def _changes(
    args: argparse.Namespace,
    prober: subprocess.Popen[str],
    change: Callable[[int, str], tuple[float, float | None]],
) -> Changes:
    """``args.changes`` changes, each made by ``change(i, new pod)``: when it was handed over
    (``time.monotonic()``) and when the backend had applied it, if known."""
    out = Changes()
    holder = "a"
    for i in range(args.changes):
        new = "b" if holder == "a" else "a"
        _send(prober, f"{holder} {new} {args.watch}")
        if "error" in (ready := _read(prober, 10)):
            raise SystemExit(f"change {i}: {ready['error']}")
        handed, applied = change(i, new)
        seen = _read(prober, args.watch + args.hold + 30)
        if seen["reached"] is None:
            raise SystemExit(f"change {i}: no new connection reached pod {new} in {args.watch} s")
        out.traffic.append(seen["reached"][1] - handed)
        if applied is not None:
            out.kernel.append(applied - handed)
        out.lower.append(max(seen["last_old"] - handed, 0.0))
        out.connections += seen["connections"]
        out.durations += seen["durations"]
        for when, bad in (("before", seen["failed_before"]), ("after", seen["after_not_new"])):
            out.problems += [
                f"change {i}, {_ms(at - handed)} ms, {when} the new pod answered: {answer}"
                for answer, at in bad
            ]
        out.held.append((holder, seen["held_after"]))
        holder = new
    return out


def _report(args: argparse.Namespace, changes: Changes) -> float:
    """Print the figures of ``changes``; their median change → traffic."""
    traffic = changes.traffic
    median = nearest_rank(traffic, 0.5)
    print(
        f"  change → first new connection on the new pod: median {_ms(median)} ms, p99 "
        f"{_ms(nearest_rank(traffic, 0.99))} ms, worst {_ms(max(traffic))} ms "
        f"({len(traffic)} changes, {changes.connections:,} connections, one connect to answer: "
        f"median {nearest_rank(changes.durations, 0.5) * 1e6:.0f} us)"
    )
    if changes.kernel:
        kernel = changes.kernel
        print(
            f"  change → rules in the kernel (apply returned): median "
            f"{_ms(nearest_rank(kernel, 0.5))} ms, p99 {_ms(nearest_rank(kernel, 0.99))} ms, "
            f"worst {_ms(max(kernel))} ms"
        )
    print(
        f"  the last new connection the old pod answered had started "
        f"{_ms(nearest_rank(changes.lower, 0.5))} ms after the change (median; the switch came "
        "later)"
    )
    problems = changes.problems
    print(f"  new connections that failed or reached the old pod: {len(problems)}")
    for problem in problems[:10]:
        print(f"    {problem}")
    held = changes.held
    kept = sum(bool(answers) and all(a == old for a in answers) for old, answers in held)
    others = sorted({a for old, answers in held for a in answers if a != old})
    asked = sum(len(answers) for _, answers in held)
    print(
        f"  established connection to the old pod, asked every 50 ms through {args.hold} s "
        f"after the new pod answered: {kept}/{len(held)} kept answering from the old pod "
        f"({asked} answers){f', other answers: {others}' if others else ''}"
    )
    return median


def measure(args: argparse.Namespace) -> int:
    from kpng.testing.netns import ClusterSpec, TestBed

    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    medians: dict[str, dict[int, float]] = {"in process": {}, "whole process": {}}
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores; other work skews timings)")
    with (
        TestBed(ClusterSpec.parse({"node-1": ["a", "b", "client"]})) as bed,
        tempfile.TemporaryDirectory(prefix="kpng-traffic-") as tmp_dir,
    ):
        tmp = args.workdir or Path(tmp_dir)
        ips = {pod: bed.pod(pod).ip4 for pod in PODS}
        node_ns = bed.nodes["node-1"].netns
        spawned: list[subprocess.Popen[str]] = []

        def spawn(netns: str, argv: list[str], log: IO[bytes] | None = None) -> Popen:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, *argv],
                stdin=subprocess.PIPE if log is None else subprocess.DEVNULL,
                stdout=subprocess.PIPE if log is None else log,
                stderr=None if log is None else subprocess.STDOUT,
                text=True,
                env=env,
            )
            spawned.append(proc)
            return proc

        try:
            probe = [*me, "--client", TARGET_IP, "--interval", str(args.interval)]
            prober = spawn(bed.pod("client").netns, [*probe, "--hold", str(args.hold)])
            for size in args.sizes:
                node_argv = [*me, "--node", json.dumps(ips), "--services", str(size)]
                node_proc = spawn(node_ns, node_argv)
                started = _read(node_proc)
                print(
                    f"{size:,} services x 10 endpoints, to-nft in process: state built in "
                    f"{started['built']:.1f} s, full sync {started['full_sync']:.2f} s, peak "
                    f"RSS {started['rss_mib']:.0f} MiB"
                )

                def in_process(i: int, _: str, node_proc: Popen = node_proc) -> Handed:
                    _send(node_proc, f"change {2 + i}")
                    applied = _read(node_proc)
                    return applied["handed"], applied["applied"]

                medians["in process"][size] = _report(args, _changes(args, prober, in_process))
                _close(node_proc)
                bed.exec(node_ns, ["nft", "delete", "table", "inet", "kpng"])
                if args.process:
                    workdir = Path(tmp) / str(size)
                    in_node = functools.partial(spawn, node_ns)
                    whole = _whole_process(args, size, ips, workdir, node_ns, in_node, prober)
                    medians["whole process"][size] = whole
                    bed.exec(node_ns, ["nft", "delete", "table", "inet", "kpng"], check=False)
        finally:
            for proc in spawned:
                _close(proc)
    for mode, by_size in medians.items():
        if len(by_size) > 1:
            small, large = min(by_size), max(by_size)
            print(
                f"{mode}: ratio of medians, {large:,} / {small:,} services: "
                f"{by_size[large] / by_size[small]:.2f}"
            )
    return 0


def _close(proc: Popen) -> None:
    """End a process of ours: its input closed (the node and the client end then), else
    SIGTERM (kpng), within a minute, else SIGKILL."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    elif proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _target(ip: str) -> str:
    """The target service and its slice, its one endpoint at ``ip`` on the node, as a file."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "target", "namespace": "bench"},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": TARGET_IP,
            "clusterIPs": [TARGET_IP],
            "ports": [{"name": "http", "port": TARGET_PORT, "targetPort": 8080, "protocol": "TCP"}],
        },
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "target-1",
            "namespace": "bench",
            "labels": {"kubernetes.io/service-name": "target"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": NODE,
            }
        ],
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [service, endpoints]})


def _whole_process(
    args: argparse.Namespace,
    size: int,
    ips: dict[str, str],
    workdir: Path,
    node_ns: str,
    spawn: Callable[[list[str], IO[bytes]], Popen],
    prober: Popen,
) -> float:
    """``kpng file --input DIR to-local ... to-nft`` following a directory: ``synthetic.py``'s
    cluster of ``size`` services in one file, the target in another, rewritten (a rename) for
    each change; the median change → traffic."""
    import synthetic

    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not (workdir / "cluster.json").exists():
        synthetic.write(workdir / "cluster.json", size)
    made = time.perf_counter() - start
    target = workdir / "target.json"
    target.write_text(_target(ips["a"]))
    argv = [*KPNG, f"--healthz-bind-address={HEALTHZ}", "file", "--input", str(workdir)]
    argv += ["to-local", "--node-name", NODE, *BACKEND]
    with (workdir.parent / f"kpng-{size}.log").open("wb") as log:
        proc = spawn(argv, log)
        try:
            # Wait by /healthz, not by connecting: a connection tried before the rules exist
            # leaves an entry without DNAT in conntrack (SYN_SENT, 120 s), and a later one
            # from the same source port follows it and is refused.
            started = time.monotonic()
            healthz = f"import urllib.request; urllib.request.urlopen('http://{HEALTHZ}/healthz')"
            while subprocess.run(
                ["ip", "netns", "exec", node_ns, sys.executable, "-c", healthz],
                capture_output=True,
                check=False,
            ).returncode:
                if proc.poll() is not None or time.monotonic() > started + STEP_TIMEOUT_S:
                    raise SystemExit(f"kpng never became healthy: {_tail(log.name)}")
                time.sleep(0.2)
            healthy = time.monotonic() - started
            _send(prober, f"- a {args.watch}")
            if _read(prober, args.watch + 30)["reached"] is None:
                raise SystemExit(f"pod a never answered through kpng: {_tail(log.name)}")
            peak = _peak_mib(proc.pid)
            print(
                f"{size:,} services x 10 endpoints, whole process (cluster file made in "
                f"{made:.1f} s): start → healthy (first state programmed) {healthy:.1f} s, "
                f"peak RSS {peak:.0f} MiB"
            )

            def rewrite(_: int, new: str) -> Handed:
                staged = workdir / "target.json.new"  # not a manifest's suffix: not read
                staged.write_text(_target(ips[new]))
                handed = time.monotonic()
                os.replace(staged, target)
                return handed, None

            return _report(args, _changes(args, prober, rewrite))
        finally:
            _close(proc)


def _peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _tail(path: str) -> str:
    return Path(path).read_text(errors="replace")[-2000:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=_sizes, default=[100, 100000])
    parser.add_argument("--changes", type=int, default=20, help="per size")
    parser.add_argument("--interval", type=float, default=0.001, help="between new connections")
    parser.add_argument("--watch", type=float, default=10.0, help="per change, at most")
    parser.add_argument("--hold", type=float, default=0.5, help="after the new pod answered")
    parser.add_argument(
        "--no-process", dest="process", action="store_false", help="in process only"
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep the clusters and kpng's logs there (default: none)"
    )
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--services", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    compiled_as_installed()
    if args.node:
        return node(args.services, json.loads(args.node))
    if args.client:
        return client(args.client, args.interval, args.hold)
    return measure(args)


def _sizes(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


if __name__ == "__main__":
    sys.exit(main())
