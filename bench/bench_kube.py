"""``kpng kube`` against a real kube-apiserver with 10,000 services of 10 endpoints.

A control plane of its own (``rig.cluster``) is filled with the synthetic cluster of
``synthetic.py`` (10,000 Services, one 10-endpoint EndpointSlice each, 100 Nodes; the fields the
API server assigns, such as cluster IPs and node ports, are left to it). Then:

1. **first complete node-local state**: ``kpng kube --kubeconfig K to-local --node-name node-000
   to-json --once --output /dev/null`` from process start to exit, and its peak RSS; against the
   **baseline** of the same run: a process that lists the same three collections (same
   selectors, page size, HTTP client and credentials, concurrently, as kpng does) and only reads
   the pages; and the same plus ``msgspec.json.decode`` of each page into plain Python objects.
   Each figure is the median of ``--runs`` processes.
2. **one endpoint becoming not ready → new node-local state**: kpng in this process (the kube
   source, the store and ``to-local`` with a backend that notes each revision); ``--changes``
   times, one EndpointSlice of a different ClusterIP service gets its first endpoint's
   ``ready: false``; latency from before the PATCH is sent to the backend's ``apply`` naming that
   service. Median and p99 (nearest rank).
3. **churn that changes no node's state**: ``--churn`` slices get a label kpng ignores; API
   events the slice reflector received against store revisions and backend calls.

Creation loops are bounded in count and time (``--fill-timeout``); the control plane and every
process are stopped at the end.

    python bench/bench_kube.py [--services 10000] [--runs 3] [--changes 100] [--churn 300]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import synthetic
from stats import nearest_rank

from kpng.backends.registry import NodeState
from kpng.sinks.local import run_local
from kpng.sources.kube.source import KubeOptions, KubeSource, resources
from kpng.store import Store
from rig.cluster import ControlPlane, ensure_binaries
from rig.kubeapi import KubeApi

Obj = dict[str, Any]
NODE = "node-000"
THREADS = 8
CHANGE_TIMEOUT_S = 10.0
# The synthetic cluster has ~2,000 NodePort and LoadBalancer services: more node ports than the
# default range holds.
APISERVER_ARGS = ["--service-node-port-range=30000-45000"]


# --- filling the cluster


def _for_api(obj: Obj) -> Obj:
    """The object as a client creates it: without what the API server assigns."""
    obj = msgspec.json.decode(msgspec.json.encode(obj))
    meta = obj["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
        meta.pop(key, None)
    obj.pop("status", None)
    if obj["kind"] == "Service":
        spec = obj["spec"]
        for key in ("clusterIP", "clusterIPs", "healthCheckNodePort"):
            spec.pop(key, None)
        for port in spec.get("ports", ()):
            port.pop("nodePort", None)
    return obj


def fill(plane: ControlPlane, items: list[Obj], deadline: float) -> float:
    """Create every object (namespaces first), from a few threads; seconds taken."""
    api = KubeApi.of(plane)
    started = time.perf_counter()
    try:
        for ns in sorted({i["metadata"].get("namespace") for i in items} - {None}):
            api.ensure_namespace(ns)
        by_kind: dict[str, list[Obj]] = {}
        for item in items:
            by_kind.setdefault(item["kind"], []).append(_for_api(item))
        done = 0
        lock = threading.Lock()

        def create(obj: Obj) -> None:
            nonlocal done
            if time.monotonic() > deadline:
                raise TimeoutError("filling the cluster took longer than --fill-timeout")
            api.create(obj)
            with lock:
                done += 1
                if done % 5000 == 0:
                    print(f"  {done} objects created", flush=True)

        # Services before their slices: a slice may come first in a real cluster, but kpng
        # would then log it as orphaned in the benchmark's output.
        for kind in ("Node", "Service", "EndpointSlice"):
            with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(create, by_kind.get(kind, [])))
    finally:
        api.close()
    return time.perf_counter() - started


# --- child processes: kpng and the baseline, timed with their peak RSS


# Runs the child's module or script and, at its exit, writes its peak RSS (VmHWM, of the process
# image after exec) to a file. ru_maxrss from wait4 would not do: Linux carries the high-water
# mark across exec, and a spawned child starts out sharing this (large) process's memory.
_PROBE = """
import atexit, os, runpy, sys
out = sys.argv[1]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(out, "w").write(line.split()[1])
atexit.register(hwm)
if sys.argv[2] == "-m":
    sys.argv = sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[2:]
    # As `python SCRIPT` does, and run_path does not: the script's directory first on the path
    # (bench_kube.py imports synthetic.py beside it).
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _timed_process(argv: list[str]) -> tuple[float, float]:
    """(seconds from spawn to exit, peak RSS in MiB) of ``python ARGV...``."""
    with tempfile.NamedTemporaryFile(prefix="kpng-bench-hwm-") as hwm:
        command = [sys.executable, "-c", _PROBE, hwm.name, *argv]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, check=False)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace")[-2000:]
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{tail}")
        return elapsed, int(Path(hwm.name).read_text()) / 1024


def baseline(kubeconfig: Path, decode: bool) -> None:
    """List the three collections as kpng does, and nothing else."""
    from kpng.kubeclient.client import ApiClient
    from kpng.kubeclient.config import load_connection

    async def main() -> None:
        connection = await load_connection(kubeconfig)
        async with ApiClient(connection) as client:

            async def list_all(path: str, selectors: dict[str, str]) -> int:
                params = {"limit": "500", **selectors}
                count = 0
                while True:
                    body = await client.get(path, params)
                    page = msgspec.json.decode(body) if decode else None
                    count += len(body)
                    cont = (
                        page["metadata"].get("continue")
                        if page is not None
                        else _continue_token(body)
                    )
                    if not cont:
                        return count
                    params["continue"] = cont

            await asyncio.gather(*(list_all(r.path, r.selectors()) for r in resources(None)))

    asyncio.run(main())


class _PageMeta(msgspec.Struct):
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


def _continue_token(body: bytes) -> str:
    # Only the list's metadata: the baseline without decoding still needs the next token.
    meta = msgspec.json.decode(body, type=_PageMeta).metadata
    token: str = meta.get("continue", "")
    return token


def _median_of(argv: list[str], runs: int) -> tuple[float, float]:
    results = [_timed_process(argv) for _ in range(runs)]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


# --- in process: change latency and churn


class NotingBackend:
    def __init__(self) -> None:
        self.applies: list[tuple[float, frozenset[tuple[str, str]]]] = []
        self.changed = asyncio.Event()

    async def apply(self, state: NodeState) -> bool:
        self.applies.append((time.perf_counter(), state.updated | state.deleted))
        self.changed.set()
        return False

    async def close(self) -> None:
        pass


async def in_process(
    plane: ControlPlane, slices: list[Obj], changes: int, churn: int
) -> dict[str, Any]:
    store = Store()
    source = KubeSource(store, KubeOptions(kubeconfig=plane.kubeconfig))
    backend = NotingBackend()
    tasks = [
        asyncio.create_task(source.run()),
        asyncio.create_task(run_local(store, node_name=NODE, backend=backend)),
    ]
    api = KubeApi.of(plane)
    try:
        while not backend.applies:
            await backend.changed.wait()
        rng = random.Random(7)
        # Slices of ClusterIP services without topology hints whose endpoints are all ready:
        # one endpoint turning not ready is certain to change every node's state.
        candidates = [
            s
            for s in slices
            if all(
                e.get("conditions", {}).get("ready", True) and not e.get("hints")
                for e in s["endpoints"]
            )
        ]
        latencies: list[float] = []
        for s in rng.sample(candidates, min(changes, len(candidates))):
            meta = s["metadata"]
            key = (meta["namespace"], meta["labels"]["kubernetes.io/service-name"])
            endpoints = msgspec.json.decode(msgspec.json.encode(s["endpoints"]))
            endpoints[0]["conditions"]["ready"] = False
            seen = len(backend.applies)
            sent = time.perf_counter()
            await asyncio.to_thread(
                api.patch,
                "EndpointSlice",
                meta["namespace"],
                meta["name"],
                {"endpoints": endpoints},
            )
            deadline = time.monotonic() + CHANGE_TIMEOUT_S
            while True:
                hit = next((t for t, keys in backend.applies[seen:] if key in keys), None)
                if hit is not None:
                    latencies.append(hit - sent)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no new state for {key} after {CHANGE_TIMEOUT_S} s")
                backend.changed.clear()
                await asyncio.wait_for(backend.changed.wait(), CHANGE_TIMEOUT_S)

        slice_reflector = next(r for r in source.reflectors if r.name == "EndpointSlice")
        events, revision, applies = (
            slice_reflector.stats.events,
            store.revision,
            len(backend.applies),
        )
        for i, s in enumerate(rng.sample(slices, min(churn, len(slices)))):
            meta = s["metadata"]
            patch = {"metadata": {"labels": {"bench.kpng.io/churn": str(i)}}}
            await asyncio.to_thread(
                api.patch, "EndpointSlice", meta["namespace"], meta["name"], patch
            )
        # Let the last events arrive (each takes about a millisecond on loopback).
        for _ in range(100):
            if slice_reflector.stats.events - events >= churn:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        return {
            "latencies": latencies,
            "churn_events": slice_reflector.stats.events - events,
            "churn_revisions": store.revision - revision,
            "churn_applies": len(backend.applies) - applies,
        }
    finally:
        api.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command")
    base = sub.add_parser("baseline", help="(internal) the listing baseline, in a child process")
    base.add_argument("--kubeconfig", type=Path, required=True)
    base.add_argument("--decode", action="store_true")
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--churn", type=int, default=300)
    parser.add_argument("--fill-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.command == "baseline":
        baseline(args.kubeconfig, args.decode)
        return 0

    t = time.perf_counter()
    binaries = ensure_binaries()
    print(
        f"control plane: kube-apiserver {binaries.kubernetes_version}, etcd "
        f"{binaries.etcd_version} (ready in {time.perf_counter() - t:.1f} s)"
    )
    document = synthetic.generate(args.services)
    items: list[Obj] = document["items"]
    slices = [i for i in items if i["kind"] == "EndpointSlice"]
    with ControlPlane(binaries, apiserver_args=APISERVER_ARGS) as plane:
        print(f"filling: {len(items)} objects from {THREADS} threads ...", flush=True)
        seconds = fill(plane, items, time.monotonic() + args.fill_timeout)
        print(f"filled in {seconds:.1f} s ({len(items) / seconds:.0f} objects/s)\n", flush=True)

        me = str(Path(__file__).resolve())
        kubeconfig = str(plane.kubeconfig)
        kpng = ["-m", "kpng", "kube", "--kubeconfig", kubeconfig]
        kpng += ["to-local", "--node-name", NODE, "to-json", "--once", "--output", os.devnull]
        rows = [
            ("baseline: list (pages read)", [me, "baseline", "--kubeconfig", kubeconfig]),
            (
                "baseline: list + msgspec.json.decode",
                [me, "baseline", "--kubeconfig", kubeconfig, "--decode"],
            ),
            ("kpng kube → first node-local state", kpng),
        ]
        figures = {}
        print(f"1. start to first complete state, {args.services} services (median of {args.runs})")
        for title, command in rows:
            figures[title] = _median_of(command, args.runs)
            wall, rss = figures[title]
            print(f"   {title:40} {wall:6.2f} s   peak RSS {rss:6.0f} MiB", flush=True)
        kpng_wall, kpng_rss = figures[rows[2][0]]
        for title, _ in rows[:2]:
            wall, rss = figures[title]
            print(
                f"   kpng / {title:33} {kpng_wall / wall:5.2f}x time   {kpng_rss / rss:5.2f}x RSS"
            )

        result = asyncio.run(in_process(plane, slices, args.changes, args.churn))

    latencies = [x * 1000 for x in result["latencies"]]
    print(f"\n2. one endpoint not ready → new node-local state ({len(latencies)} changes)")
    median, p99 = statistics.median(latencies), nearest_rank(latencies, 0.99)
    print(f"   median {median:.1f} ms   p99 {p99:.1f} ms   max {max(latencies):.1f} ms")
    events = result["churn_events"]
    print(f"\n3. churn kpng ignores ({args.churn} slice relabels)")
    print(
        f"   API events {events}   store revisions {result['churn_revisions']}   "
        f"backend calls {result['churn_applies']}   "
        f"revisions per event {result['churn_revisions'] / max(events, 1):.2%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
