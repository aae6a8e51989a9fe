"""A soak: one kpng process for an hour under churn against a real API server; what grows.

Not in CI, not timed (it measures growth, not speed: run it under ``nice``, without the
benchmark lock). Needs root (network namespaces, nftables, conntrack).

A control plane of its own (``rig.cluster``: etcd and two kube-apiservers, A and B, on
a bridge address) holds 10 Nodes and between ``--min-services`` and ``--max-services`` live
Services (1,000 and 5,000), each with one EndpointSlice of 3 endpoints. kpng reads A; the churn
writes through B, one tick a second, from a few threads:

- the live count follows a triangle wave, min → max → min every ``--period`` minutes (Services
  and their slices created, and deleted);
- ``--changes`` slice changes a tick (an endpoint moves to a new address, or flips ready), a
  Service's port moves (80 ↔ 81), and a Service and its slice gain or lose the label
  ``service.kubernetes.io/service-proxy-name`` (kpng then drops them, or takes them back);
- every ``--relist-every`` minutes A is stopped, a tick of churn goes through B, and A starts
  again on its port: every watch resumes from a resourceVersion older than A's new watch cache,
  gets 410 Gone and lists again (as ``bench_apiserver.py`` forces it).

What runs, each a real process (``python -m kpng``), started through a small wrapper (below):

- default: ``kpng kube --kubeconfig A to-local --node-name node-000 to-nft`` in a fresh network
  namespace (routed to A by a veth pair);
- ``--brain``: ``kpng kube --kubeconfig A to-api`` with ``--watchers`` raw batched watchers
  (``bench_api.Watcher``) in this process; the brain is sampled;
- ``--local``: the same brain and ``kpng local --api BRAIN --node-name node-000 to-nft`` in the
  namespace; the node agent is sampled.

Every ``--sample-every`` seconds, from the sampled process: RSS (``/proc/PID/status``), open fds
(``/proc/PID/fd``), Python objects the garbage collector tracks, by type, and
``sys.getallocatedblocks()``; with to-nft, the elements, rules and chains of its nftables table
(``nft -j list table inet kpng``) and the conntrack entries whose original destination is a
service IP (the namespace's UDP timeout is raised to an hour, and 50 UDP services are sent a
datagram from one source port each sample), in three: through a ready endpoint of a served
service; stale, through an endpoint gone or not ready, which kpng deletes (kube-proxy's rule:
this must stay near 0); to an address no served service holds, which that rule leaves to time
out (so it grows here, with an hour's timeout); and glibc's heap (``mallinfo2``: in use, and
free but held). Then each series' growth per hour: a least-squares line over the samples after
``--warmup`` minutes (one or more whole churn periods, so the wave cancels out), as a share of
the line's value at the window's start, and the same between the first and last troughs of the
wave in that window (the same live count). Target: RSS < 5 %/hour.

The heap counts come from the wrapper, a thread in kpng's process that answers requests on a
FIFO with ``gc.get_objects()`` counted by type, after a ``gc.collect()`` so that they are live
objects, not garbage the collector has yet to reach; with ``--tracemalloc``, it also dumps
tracemalloc snapshots at the window's ends, whose difference is printed. Why a wrapper: kpng's
``/metrics`` has only the garbage collector's counters, a signal handler would be product code,
and kpng in this process would mix its objects with the churn's.

At the end the churn stops and, once kpng's table no longer changes, the table is compared with
a fresh full sync of the same final state: the soaked process stops, the namespace is made anew
(same addresses) and ``kpng kube ... to-local --node-name node-000 to-nft --once`` programs it.
Stale or missing rules, chains, sets or elements are listed. With ``--brain``, the brain's
node-local state for node-000 (``kpng local --api BRAIN ... to-json --once``) is compared with
``kpng kube ... to-local ... to-json --once``.

Every wait is bounded; processes, namespaces, links and the control plane are removed at the
end, also on failure or SIGTERM.

    sudo nice -n 10 python bench/soak.py [--minutes 60] [--brain | --local] [--tracemalloc]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import ipaddress
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kpng.testing.objects import endpoint, endpoint_slice, node, service
from kpng.testing.ports import free_port
from rig.cluster import SERVICE_CIDR, ControlPlane, ensure_binaries
from rig.kubeapi import ApiError, KubeApi

Obj = dict[str, Any]
PYTHON = sys.executable
NODE = "node-000"
NODES = [f"node-{i:03d}" for i in range(10)]
NAMESPACES = [f"soak-{i}" for i in range(10)]
PROXY_LABEL = "service.kubernetes.io/service-proxy-name"
HOST_IP = "10.252.90.1"
"""Where the API servers listen: on a bridge without ports in this namespace."""
VETH_HOST_IP, NS_IP = "10.252.91.1", "10.252.91.2"
ENDPOINT_NET = ipaddress.IPv4Network("10.200.0.0/16")
"""Endpoint addresses: on-link in the namespace, so probes' flows are confirmed and go nowhere."""
METRICS_PORT = 10249
TICK_S = 1.0
OP_TIMEOUT_S = 60.0
QUIET_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0
UDP_PROBES = 50
TARGET_RSS_PCT_H = 5.0


# --- the wrapper that runs kpng and answers sample requests


PROBE = r"""
import collections, ctypes, gc, json, os, runpy, sys, threading
fifo, out, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])
if frames:
    import tracemalloc
    tracemalloc.start(frames)

def answer(request):
    seq, _, what = request.partition(" ")
    counts = collections.Counter()
    gc.collect()  # live objects, not garbage the collector has yet to reach
    objects = gc.get_objects()
    for o in objects:
        t = type(o)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    total = len(objects)
    del objects
    sample = {"objects": total, "blocks": sys.getallocatedblocks(), "types": counts,
              "gc_counts": gc.get_count(), "garbage": len(gc.garbage)}
    try:  # glibc's heap: what C code (libnftables, grpc) and large Python objects hold
        class Mallinfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = Mallinfo2
        info = libc.mallinfo2()
        sample["malloc_in_use"] = info.uordblks + info.hblkhd
        sample["malloc_free"] = info.fordblks
    except (AttributeError, OSError):
        pass
    if what == "snapshot" and frames:
        tracemalloc.take_snapshot().dump(os.path.join(out, f"snap-{seq}.trace"))
    tmp = os.path.join(out, f".sample-{seq}.json")
    with open(tmp, "w") as f:
        json.dump(sample, f)
    os.replace(tmp, os.path.join(out, f"sample-{seq}.json"))

def serve():
    while True:
        with open(fifo) as requests:
            for line in requests:
                if line.strip():
                    answer(line.strip())

threading.Thread(target=serve, daemon=True, name="soak-probe").start()
sys.argv = sys.argv[3:]  # [0] becomes the module's path
runpy.run_module("kpng", run_name="__main__", alter_sys=True)
"""


class SoakError(Exception):
    """Something crashed or timed out: the soak cannot report."""


class Kpng:
    """``python -m kpng ARGV`` (through ``PROBE``), in ``netns`` if given, its stderr to a log."""

    def __init__(
        self, name: str, argv: Sequence[str], workdir: Path, netns: str | None, frames: int
    ) -> None:
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir()
        self.fifo = self.dir / "requests"
        os.mkfifo(self.fifo)
        self.log_path = self.dir / "log"
        self._log = self.log_path.open("wb")
        inside = ["ip", "netns", "exec", netns] if netns else []
        command = [*inside, PYTHON, "-c", PROBE, str(self.fifo), str(self.dir), str(frames)]
        self.proc = subprocess.Popen(
            [*command, *argv], stdout=subprocess.DEVNULL, stderr=self._log
        )  # ``ip netns exec`` execs: the pid is kpng's
        self._seq = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise SoakError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def heap(self, snapshot: bool = False) -> tuple[Obj, Path | None]:
        """The wrapper's answer: gc-tracked objects by type, allocated blocks; and the
        tracemalloc snapshot's path, if asked for and tracing."""
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + 120
        while True:
            self.check()
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:  # ENXIO: the reader has not reopened it yet
                if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            os.write(fd, f"{seq} {'snapshot' if snapshot else 'counts'}\n".encode())
        finally:
            os.close(fd)
        answer = self.dir / f"sample-{seq}.json"
        while not answer.exists():
            self.check()
            if time.monotonic() > deadline:
                raise SoakError(f"{self.name}: no heap sample within 120 s")
            time.sleep(0.1)
        sample: Obj = json.loads(answer.read_text())
        answer.unlink()
        snap = self.dir / f"snap-{seq}.trace"
        return sample, snap if snap.exists() else None

    def status(self) -> dict[str, float]:
        """RSS, its anonymous part (the heap, not the mapped libraries) in MiB, and threads."""
        fields = {"VmRSS:": "rss_mib", "RssAnon:": "rss_anon_mib", "Threads:": "threads"}
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, *value = line.split()
            if name in fields:
                number = float(value[0])
                out[fields[name]] = number if name == "Threads:" else number / 1024
        return out

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=20)
        finally:
            self._log.close()


# --- network: the API servers' address and the node's namespace


def _run(*argv: str, timeout: float = 60, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise SoakError(f"{' '.join(argv)}: {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@contextmanager
def host_address(link: str) -> Iterator[None]:
    _run("ip", "link", "add", link, "type", "bridge")
    try:
        _run("ip", "addr", "add", f"{HOST_IP}/32", "dev", link)
        _run("ip", "link", "set", link, "up")
        yield
    finally:
        _run("ip", "link", "del", link, check=False)


@contextmanager
def namespace(name: str, veth: str) -> Iterator[None]:
    """A fresh namespace at ``NS_IP``, with a route to ``HOST_IP`` through a veth pair, the
    endpoints' network on-link, and UDP flows kept an hour."""
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "soak0", "netns", name)
        _run("ip", "addr", "add", f"{VETH_HOST_IP}/30", "dev", veth)
        _run("ip", "link", "set", veth, "up")
        inside = ("ip", "netns", "exec", name)
        _run(*inside, "ip", "addr", "add", f"{NS_IP}/30", "dev", "soak0")
        _run(*inside, "ip", "link", "set", "soak0", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "route", "add", f"{HOST_IP}/32", "via", VETH_HOST_IP)
        _run(*inside, "ip", "route", "add", str(ENDPOINT_NET), "dev", "soak0")
        _run(*inside, "ip", "route", "add", SERVICE_CIDR, "dev", "soak0")
        # Per namespace once nf_conntrack is loaded; a kernel without it keeps the default.
        _run(*inside, "sysctl", "-qw", "net.netfilter.nf_conntrack_udp_timeout=3600", check=False)
        _run(*inside, "sysctl", "-qw", "net.netfilter.nf_conntrack_udp_timeout_stream=3600",
             check=False)  # fmt: skip
        yield
    finally:
        _run("ip", "netns", "del", name, check=False)
        _run("ip", "link", "del", veth, check=False)


# --- the churn


@dataclass
class Svc:
    namespace: str
    name: str
    udp: bool
    endpoints: list[Obj]
    port: int
    labelled: bool = False
    cluster_ip: str = ""


@dataclass
class ChurnStats:
    created: int = 0
    deleted: int = 0
    slice_changes: int = 0
    service_changes: int = 0
    label_flips: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


class Churn:
    def __init__(self, api: KubeApi, args: argparse.Namespace) -> None:
        self.api = api
        self.args = args
        self.rng = random.Random(args.seed)
        self.live: list[Svc] = []
        self.stats = ChurnStats()
        self._names = 0
        self._addresses = 0
        self._pool = ThreadPoolExecutor(6, thread_name_prefix="churn")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def target(self, elapsed_s: float) -> int:
        """The triangle wave: min at 0, max at half a period, min again at a period."""
        lo: int = self.args.min_services
        hi: int = self.args.max_services
        period: float = self.args.period
        phase = (elapsed_s / (period * 60)) % 1.0
        share = 2 * phase if phase < 0.5 else 2 - 2 * phase
        return round(lo + (hi - lo) * share)

    def _address(self) -> str:
        self._addresses += 1
        return str(ENDPOINT_NET[1 + self._addresses % (ENDPOINT_NET.num_addresses - 2)])

    def _endpoint(self) -> Obj:
        return endpoint(
            self._address(), node=self.rng.choice(NODES), ready=self.rng.random() < 0.95
        )

    def _new(self) -> tuple[Svc, Callable[[], None]]:
        self._names += 1
        kind = self._names % 100
        svc = Svc(
            self.rng.choice(NAMESPACES),
            f"s{self._names}",
            udp=kind < 10,
            endpoints=[self._endpoint() for _ in range(3)],
            port=53 if kind < 10 else 80,
        )
        protocol = "UDP" if svc.udp else "TCP"
        port_name = "dns" if svc.udp else "http"
        spec: Obj = {}
        if 17 <= kind < 20:
            spec["sessionAffinity"] = "ClientIP"
        body = service(
            svc.name,
            svc.namespace,
            ports=[{"name": port_name, "port": svc.port, "protocol": protocol}],
            type="NodePort" if 10 <= kind < 17 else "ClusterIP",
            **spec,
        )
        slice_ = endpoint_slice(
            f"{svc.name}-a",
            svc.namespace,
            svc.name,
            svc.endpoints,
            ports=[{"name": port_name, "port": 5353 if svc.udp else 8080, "protocol": protocol}],
        )

        def create() -> None:
            svc.cluster_ip = self.api.create(body)["spec"].get("clusterIP", "")
            self.api.create(slice_)

        return svc, create

    def _delete(self, svc: Svc) -> Callable[[], None]:
        def delete() -> None:
            self.api.delete("EndpointSlice", svc.namespace, f"{svc.name}-a")
            self.api.delete("Service", svc.namespace, svc.name)

        return delete

    def _take(self, i: int) -> Svc:
        live = self.live
        live[i], live[-1] = live[-1], live[i]
        return live.pop()

    def tick(self, elapsed_s: float, cap: int = 60) -> None:
        """One tick of writes, through B, from the pool; bounded."""
        ops: list[tuple[str, Callable[[], None]]] = []
        new: set[int] = set()  # created in this tick: not to be changed before they exist
        gap = self.target(elapsed_s) - len(self.live)
        for _ in range(min(abs(gap), cap)):
            if gap > 0:
                svc, create = self._new()
                self.live.append(svc)
                new.add(id(svc))
                ops.append(("create", create))
            elif self.live:
                ops.append(("delete", self._delete(self._take(self.rng.randrange(len(self.live))))))
        if self.live:
            touched: set[int] = set()
            picks = [self.rng.randrange(len(self.live)) for _ in range(self.args.changes + 2)]
            for n, i in enumerate(picks):
                if i in touched or id(self.live[i]) in new:
                    continue
                touched.add(i)
                svc = self.live[i]
                if n < self.args.changes:
                    ops.append(("slice", self._change_slice(svc)))
                elif n == self.args.changes:
                    ops.append(("service", self._change_service(svc)))
                else:
                    ops.append(("label", self._flip_label(svc)))
        self._run(ops)

    def _change_slice(self, svc: Svc) -> Callable[[], None]:
        k = self.rng.randrange(len(svc.endpoints))
        if self.rng.random() < 0.5:
            svc.endpoints[k] = self._endpoint()
        else:
            ready = svc.endpoints[k]["conditions"]["ready"]
            svc.endpoints[k] = {**svc.endpoints[k], "conditions": {"ready": not ready}}
        patch = {"endpoints": list(svc.endpoints)}
        return lambda: self._patch("EndpointSlice", svc.namespace, f"{svc.name}-a", patch)

    def _change_service(self, svc: Svc) -> Callable[[], None]:
        if svc.udp:
            return lambda: None  # one UDP port: nothing to move
        svc.port = 81 if svc.port == 80 else 80
        ports = [{"name": "http", "port": svc.port, "protocol": "TCP"}]
        return lambda: self._patch("Service", svc.namespace, svc.name, {"spec": {"ports": ports}})

    def _flip_label(self, svc: Svc) -> Callable[[], None]:
        # Mostly take back what was labelled, so few stay out at a time.
        labelled = [s for s in self.live if s.labelled]
        if labelled and self.rng.random() < 0.5:
            svc = self.rng.choice(labelled)
        svc.labelled = not svc.labelled
        patch = {"metadata": {"labels": {PROXY_LABEL: "other" if svc.labelled else None}}}

        def flip() -> None:
            self._patch("Service", svc.namespace, svc.name, patch)
            self._patch("EndpointSlice", svc.namespace, f"{svc.name}-a", patch)

        return flip

    def _patch(self, kind: str, namespace: str, name: str, patch: Obj) -> None:
        self.api.patch(kind, namespace, name, patch)

    def _run(self, ops: list[tuple[str, Callable[[], None]]]) -> None:
        def one(op: tuple[str, Callable[[], None]]) -> str | None:
            try:
                op[1]()
            except ApiError as exc:
                return f"{op[0]} HTTP {exc.status}"
            except OSError as exc:
                return f"{op[0]} {type(exc).__name__}"
            return None

        futures = [self._pool.submit(one, op) for op in ops]
        for (kind, _), future in zip(ops, futures, strict=True):
            error = future.result(timeout=OP_TIMEOUT_S)
            if error:
                self.stats.errors[error] += 1
                continue
            if kind == "create":
                self.stats.created += 1
            elif kind == "delete":
                self.stats.deleted += 1
            elif kind == "slice":
                self.stats.slice_changes += 1
            elif kind == "service":
                self.stats.service_changes += 1
            else:
                self.stats.label_flips += 1

    def udp_targets(self, count: int) -> list[str]:
        """The addresses of up to ``count`` live UDP services kpng serves."""
        udp = [s for s in self.live if s.udp and not s.labelled and s.cluster_ip]
        return [s.cluster_ip for s in self.rng.sample(udp, min(count, len(udp)))]


# --- reading the node


def nft_table(netns: str) -> Obj | None:
    """``nft -j list table inet kpng`` in ``netns``; None if there is no table yet."""
    done = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-j", "list", "table", "inet", "kpng"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        return None
    table: Obj = json.loads(done.stdout)
    return table


def nft_counts(table: Obj | None) -> dict[str, float]:
    counts = {"nft_elements": 0.0, "nft_rules": 0.0, "nft_chains": 0.0, "nft_sets_maps": 0.0}
    for entry in (table or {}).get("nftables", []):
        for kind, body in entry.items():
            if kind in ("set", "map"):
                counts["nft_sets_maps"] += 1
                counts["nft_elements"] += len(body.get("elem", []))
            elif kind == "rule":
                counts["nft_rules"] += 1
            elif kind == "chain":
                counts["nft_chains"] += 1
    return counts


def _scrub(value: Any) -> Any:
    """What is the same in two tables holding the same rules: no handles, no expiry times,
    counters zeroed, set elements sorted."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in ("handle", "expires"):
                continue
            if key == "counter" and isinstance(item, dict):
                out[key] = {"packets": 0, "bytes": 0}
                continue
            out[key] = _scrub(item)
        if "elem" in out:
            out["elem"] = sorted(out["elem"], key=lambda e: json.dumps(e, sort_keys=True))
        return out
    if isinstance(value, list):
        return [_scrub(item) for item in value]
    return value


def table_items(table: Obj | None) -> set[str]:
    """The table as comparable lines: each chain, set and map's declaration, each set element,
    and each rule with its place in its chain."""
    items: set[str] = set()
    place: collections.Counter[str] = collections.Counter()
    for entry in (table or {}).get("nftables", []):
        for kind, body in _scrub(entry).items():
            if kind == "metainfo":
                continue
            if kind in ("set", "map"):
                elements = body.pop("elem", [])
                items.add(f"{kind} {json.dumps(body, sort_keys=True)}")
                for element in elements:
                    items.add(
                        f"{kind} {body['name']} element {json.dumps(element, sort_keys=True)}"
                    )
            elif kind == "rule":
                place[body["chain"]] += 1
                items.add(f"rule {body['chain']}#{place[body['chain']]} "
                          f"{json.dumps(body, sort_keys=True)}")  # fmt: skip
            else:
                items.add(f"{kind} {json.dumps(body, sort_keys=True)}")
    return items


def service_conntrack(netns: str, live: Sequence[Svc]) -> dict[str, float]:
    """Conntrack entries whose original destination is a service IP, in three: to a UDP
    service kpng serves, through one of its ready endpoints; stale, through an endpoint that
    is gone or not ready, which kpng must delete (kube-proxy's rule); and to an address no
    served service holds (deleted, or labelled away), which kube-proxy's rule leaves to time
    out."""
    done = subprocess.run(
        ["ip", "netns", "exec", netns, "conntrack", "-L", "-f", "ipv4"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    serving = {
        s.cluster_ip: {e["addresses"][0] for e in s.endpoints if e["conditions"]["ready"]}
        for s in live
        if s.udp and not s.labelled and s.cluster_ip
    }
    services = ipaddress.IPv4Network(SERVICE_CIDR)
    counts = dict.fromkeys(("conntrack_served", "conntrack_stale", "conntrack_unserved"), 0.0)
    for line in done.stdout.splitlines():
        fields = line.split()
        seen: dict[str, list[str]] = {}
        for item in fields:
            name, eq, value = item.partition("=")
            if eq:
                seen.setdefault(name, []).append(value)
        dst, src = seen.get("dst", []), seen.get("src", [])
        try:
            if not dst or ipaddress.IPv4Address(dst[0]) not in services:
                continue
        except ValueError:
            continue
        endpoints = serving.get(dst[0])
        if endpoints is None:
            counts["conntrack_unserved"] += 1
        elif len(src) > 1 and src[1] in endpoints:
            counts["conntrack_served"] += 1
        else:
            counts["conntrack_stale"] += 1
    return counts


_SEND = f"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{NS_IP}", 40053))  # one flow per service, refreshed by each probe, not one per probe
for ip in sys.argv[1:]:
    try:
        s.sendto(b"soak", (ip, 53))
    except OSError:
        pass
"""


def udp_probe(netns: str, targets: list[str]) -> None:
    """One datagram to each service address: a flow through kpng's DNAT to an endpoint."""
    if targets:
        _run("ip", "netns", "exec", netns, PYTHON, "-c", _SEND, *targets, check=False)


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics, summed over label sets; {} if it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


# --- brain watchers, in a thread of their own


class Watchers:
    def __init__(self, api: str, count: int) -> None:
        from bench_api import Watcher

        self.watchers = [Watcher(f"node-{i:03d}") for i in range(count)]
        self.api = api
        self.loop = asyncio.new_event_loop()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="watchers", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        tasks = [self.loop.create_task(w.run(self.api)) for w in self.watchers]
        self._tasks = tasks
        try:
            self.loop.run_until_complete(asyncio.gather(*tasks))
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            self.failure = exc

    def synced(self) -> bool:
        return all(w.syncs for w in self.watchers)

    def syncs(self) -> int:
        return sum(len(w.syncs) for w in self.watchers)

    def reconnects(self) -> int:
        return sum(w.reconnects for w in self.watchers)

    def check(self) -> None:
        if self.failure is not None:
            raise SoakError(f"a watcher failed: {self.failure!r}")

    def stop(self) -> None:
        def cancel() -> None:
            for task in getattr(self, "_tasks", []):
                task.cancel()

        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(cancel)
        self._thread.join(timeout=20)


# --- figures


@dataclass
class Sample:
    minute: float
    values: dict[str, float]
    types: dict[str, int]


SERIES = [
    ("rss_mib", "RSS MiB"),
    ("rss_anon_mib", "RSS anonymous MiB"),
    ("threads", "threads"),
    ("fds", "open fds"),
    ("gc_objects", "gc-tracked objects"),
    ("allocated_blocks", "allocated blocks"),
    ("nft_elements", "nft set/map elements"),
    ("nft_rules", "nft rules"),
    ("nft_chains", "nft chains"),
    ("conntrack_served", "conntrack, served"),
    ("conntrack_stale", "conntrack, stale"),
    ("conntrack_unserved", "conntrack, to unserved IPs"),
    ("malloc_in_use_mib", "malloc in use MiB"),
    ("malloc_free_mib", "malloc free, held MiB"),
    ("watcher_reconnects", "watchers' reconnects"),
    ("live_services", "live Services (churn)"),
]


def growth(samples: list[Sample], key: str, warmup: float) -> tuple[float, float, float] | None:
    """(per hour, % per hour of the line at the window's start, value there) after warmup."""
    window = [s for s in samples if s.minute >= warmup - 1e-9 and key in s.values]
    if len(window) < 3:
        return None
    xs = [s.minute / 60 for s in window]
    ys = [s.values[key] for s in window]
    if len(set(ys)) == 1:
        return 0.0, 0.0, ys[0]
    slope, intercept = statistics.linear_regression(xs, ys)
    start = slope * xs[0] + intercept
    pct = slope / start * 100 if start else math.nan
    return slope, pct, start


def same_phase(samples: list[Sample], key: str, warmup: float, period: float) -> str:
    """Growth per hour between the first and last samples at the churn's trough (each period's
    start) after warmup: the same live count, so the wave is out of it."""
    troughs = [
        s
        for s in samples
        if s.minute >= warmup - 1e-9
        and abs(s.minute / period - round(s.minute / period)) < 1e-9
        and key in s.values
    ]
    if len(troughs) < 2:
        return ""
    a, b = troughs[0], troughs[-1]
    per_h = (b.values[key] - a.values[key]) / ((b.minute - a.minute) / 60)
    pct = f"{per_h / a.values[key] * 100:+7.2f} %/h" if a.values[key] else "      — %/h"
    return f"   troughs {a.values[key]:10.1f} → {b.values[key]:10.1f}: {per_h:+10.1f}/h {pct}"


def report(samples: list[Sample], warmup: float, period: float, mode: str) -> bool:
    """Print each series' growth; whether RSS met the target."""
    ends = [s.minute for s in samples if s.minute >= warmup - 1e-9]
    print(
        f"\n== growth per hour ({mode}): least squares over the {len(ends)} samples from minute "
        f"{warmup:g} to {max(ends, default=math.nan):g}"
    )
    met = False
    for key, label in SERIES:
        g = growth(samples, key, warmup)
        if g is None:
            continue
        slope, pct, start = g
        last = [s.values[key] for s in samples if key in s.values][-1]
        line = (
            f"  {label:26} at {warmup:g} min {start:12.1f}   end {last:12.1f}   "
            f"{slope:+12.1f}/h  {pct:+7.2f} %/h"
        ) + same_phase(samples, key, warmup, period)
        if key == "rss_mib":
            met = pct < TARGET_RSS_PCT_H
            line += f"   (target < {TARGET_RSS_PCT_H:g} %/h: {'met' if met else 'MISSED'})"
        print(line)
    window = [s for s in samples if s.minute >= warmup - 1e-9]
    if len(window) >= 3:
        first, last_sample = window[0], window[-1]
        names = set(first.types) | set(last_sample.types)
        growing = []
        for name in names:
            ys = [s.types.get(name, 0) for s in window]
            slope = statistics.linear_regression([s.minute / 60 for s in window], ys)[0]
            if len(set(ys)) > 1:
                growing.append((slope, name, ys[0], ys[-1]))
        growing.sort(reverse=True)
        print("  heap types growing fastest (gc-tracked objects, fitted per hour):")
        for slope, name, a, b in growing[:8]:
            print(f"    {name:60} {a:9d} → {b:9d}   {slope:+10.0f}/h")
    return met


def tracemalloc_diff(first: Path, last: Path) -> None:
    old = tracemalloc.Snapshot.load(str(first))
    new = tracemalloc.Snapshot.load(str(last))
    print("\n== tracemalloc: allocations grown between the window's ends (by line)")
    for stat in new.compare_to(old, "lineno")[:15]:
        print(f"  {stat}")
    print("  the largest, by traceback:")
    for stat in new.compare_to(old, "traceback")[:3]:
        print(f"  {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks")
        for line in stat.traceback.format()[-12:]:
            print(f"    {line}")


# --- the run


class Soak:
    def __init__(self, args: argparse.Namespace, stack: ExitStack, workdir: Path) -> None:
        self.args = args
        self.stack = stack
        self.workdir = workdir
        tag = os.getpid() % 100_000
        self.netns = f"kpng-soak-{tag}"
        self.veth = f"ksk{tag}h"
        self.mode = "brain" if args.brain else "local" if args.local else "kube"
        self.samples: list[Sample] = []
        self.snapshots: list[Path] = []
        self.processes: dict[str, Kpng] = {}

    def run(self) -> int:
        args = self.args
        binaries = ensure_binaries()
        (self.workdir / "plane").mkdir()
        self.stack.enter_context(host_address(f"ksk{os.getpid() % 100_000}b"))
        plane = self.stack.enter_context(
            ControlPlane(binaries, address=HOST_IP, workdir=self.workdir / "plane")
        )
        self.plane = plane
        self.a_port = plane.apiserver_port
        b_port = plane.start_apiserver()
        writer = KubeApi.of(plane, b_port)
        self.stack.callback(writer.close)
        self.reader = KubeApi.of(plane, b_port)
        self.stack.callback(self.reader.close)
        for ns in NAMESPACES:
            writer.ensure_namespace(ns)
        for name in NODES:
            writer.create(node(name))
        churn = Churn(writer, args)
        self.churn = churn
        self.stack.callback(churn.close)
        started = time.monotonic()
        while len(churn.live) < args.min_services:
            churn.tick(0.0, cap=200)
            if time.monotonic() - started > START_TIMEOUT_S:
                raise SoakError("filling the cluster took too long")
        print(
            f"filled: {len(churn.live)} Services, {len(churn.live)} EndpointSlices, "
            f"{len(NODES)} Nodes in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        sampled = self._start()
        t0 = time.monotonic()
        minutes = args.minutes
        next_sample = 0
        relists = 0
        gone_before = scrape(self.brain_metrics or self.metrics).get(
            "kpng_source_relists_gone_total", 0.0
        )
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= next_sample * args.sample_every:
                minute = next_sample * args.sample_every / 60
                self._sample(sampled, minute)
                next_sample += 1
                if elapsed >= minutes * 60:
                    break
                every = args.relist_every
                if every and minute > 0 and minute % every < 1e-9:
                    self._relist(churn, elapsed)
                    relists += 1
            churn.tick(time.monotonic() - t0)
            sampled.check()
            if self.watchers is not None:
                self.watchers.check()
            time.sleep(max(0.0, TICK_S - (time.monotonic() - t0 - elapsed)))
        gone = scrape(self.brain_metrics or self.metrics).get("kpng_source_relists_gone_total", 0.0)
        s = churn.stats
        print(
            f"\nchurn: {s.created} Services created, {s.deleted} deleted, {s.slice_changes} "
            f"slice changes, {s.service_changes} service changes, {s.label_flips} label flips; "
            f"{relists} apiserver restarts, {gone - gone_before:.0f} lists after 410 Gone; "
            f"errors: {dict(s.errors) or 'none'}"
        )
        self.rss_met = report(self.samples, args.warmup, args.period, self.mode)
        if len(self.snapshots) >= 2:
            tracemalloc_diff(self.snapshots[0], self.snapshots[-1])
        equal = self._compare()
        return 0 if equal else 1

    def _kpng(self, name: str, argv: Sequence[str], netns: str | None) -> Kpng:
        frames = self.args.tracemalloc if name == "sampled" else 0
        process = Kpng(name, argv, self.workdir, netns, frames)
        self.stack.callback(process.stop)
        self.processes[name] = process
        return process

    def _start(self) -> Kpng:
        args = self.args
        self.node_ns: str | None = None
        self.watchers: Watchers | None = None
        self.brain_metrics = ""
        self.metrics = ""
        kube = ["kube", "--kubeconfig", str(self.plane.kubeconfig)]
        common = ["--log-level", "warning"]
        if self.mode in ("brain", "local"):
            port = free_port()
            self.brain_metrics = f"http://127.0.0.1:{port}/metrics"
            self.socket = self.workdir / "brain.sock"
            self.brain = self._kpng(
                "sampled" if self.mode == "brain" else "brain",
                [*common, "--metrics-address", f"127.0.0.1:{port}", *kube, "to-api", "--listen",
                 f"unix://{self.socket}"],
                None,
            )  # fmt: skip
            self._until(self.socket.exists, "the brain listening", self.brain)
        if self.mode == "brain":
            self.watchers = Watchers(f"unix://{self.socket}", args.watchers)
            self.stack.callback(self.watchers.stop)
            self._until(self.watchers.synced, f"{args.watchers} watchers synced", self.brain)
            print(f"brain up; {args.watchers} watchers synced", flush=True)
            return self.brain
        self.stack.enter_context(namespace(self.netns, self.veth))
        self.node_ns = self.netns
        self.metrics = f"http://{NS_IP}:{METRICS_PORT}/metrics"
        metrics = ["--metrics-address", f"{NS_IP}:{METRICS_PORT}"]
        if self.mode == "local":
            source = ["local", "--api", f"unix://{self.socket}", "--node-name", NODE]
        else:
            source = [*kube, "to-local", "--node-name", NODE]
        agent = self._kpng("sampled", [*common, *metrics, *source, "to-nft"], self.netns)
        self._until(
            lambda: scrape(self.metrics).get("kpng_backend_last_applied_timestamp_seconds", 0) > 0,
            "the first state programmed",
            agent,
        )
        print(f"kpng ({self.mode}) programmed its first state", flush=True)
        return agent

    def _until(self, check: Callable[[], bool], what: str, process: Kpng) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not check():
            process.check()
            if time.monotonic() > deadline:
                raise SoakError(f"{what}: not within {START_TIMEOUT_S:g} s")
            time.sleep(0.2)

    def _sample(self, process: Kpng, minute: float) -> None:
        warmup_sample = abs(minute - self.args.warmup) < 1e-9
        last = minute >= self.args.minutes - 1e-9
        heap, snap = process.heap(snapshot=bool(self.args.tracemalloc) and (warmup_sample or last))
        if snap is not None:
            self.snapshots.append(snap)
        values = {
            **process.status(),
            "fds": float(process.fds()),
            "gc_objects": float(heap["objects"]),
            "allocated_blocks": float(heap["blocks"]),
            **{
                f"{key}_mib": heap[key] / 1048576
                for key in ("malloc_in_use", "malloc_free")
                if key in heap
            },
            "live_services": float(len(self.churn.live)),
        }
        if self.node_ns is not None:
            values.update(nft_counts(nft_table(self.node_ns)))
            values.update(service_conntrack(self.node_ns, self.churn.live))
            udp_probe(self.node_ns, self.churn.udp_targets(UDP_PROBES))
        if self.watchers is not None:
            values["watcher_reconnects"] = float(self.watchers.reconnects())
            values["watcher_syncs"] = float(self.watchers.syncs())
        self.samples.append(Sample(minute, values, heap["types"]))
        shown = "  ".join(
            f"{k}={v:.1f}" if k.endswith("_mib") else f"{k}={v:.0f}" for k, v in values.items()
        )
        print(f"[{minute:5.1f} min] {shown}", flush=True)
        if self.args.output:
            with self.args.output.open("a") as out:
                record = {"minute": minute, **values, "top_types": heap["types"]}
                out.write(json.dumps(record) + "\n")

    def _relist(self, churn: Churn, elapsed: float) -> None:
        """A stopped, a tick of churn through B, A started again on its port (in the main
        thread: A dies with the thread that started it)."""
        self.plane.stop_apiserver(self.a_port, signal.SIGTERM)
        try:
            churn.tick(elapsed)
            time.sleep(2)
            churn.tick(elapsed + 2)
        finally:
            self.plane.start_apiserver(self.a_port)
        print("  (apiserver A restarted: watches get 410 and list again)", flush=True)

    def _quiet(self) -> Obj | None:
        """The node's table once two reads 5 s apart agree and nothing waits to be applied."""
        assert self.node_ns is not None
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        before = nft_table(self.node_ns)
        while time.monotonic() < deadline:
            time.sleep(5)
            now = nft_table(self.node_ns)
            pending = scrape(self.metrics).get("kpng_backend_pending_seconds", 1.0)
            if now == before and pending == 0:
                return now
            before = now
        raise SoakError(f"the node's table still changed after {QUIET_TIMEOUT_S:g} s")

    def _compare(self) -> bool:
        print("\n== the end state against a fresh full sync", flush=True)
        kubeconfig = str(self.plane.kubeconfig)
        if self.mode == "brain":
            return self._compare_json(kubeconfig)
        soaked = table_items(self._quiet())
        assert self.node_ns is not None
        # The soaked process stops, and the namespace is made anew with the same addresses.
        self.processes["sampled"].stop()
        _run("ip", "netns", "del", self.netns, check=False)
        _run("ip", "link", "del", self.veth, check=False)
        with namespace(self.netns, self.veth):
            _run(
                "ip", "netns", "exec", self.netns, PYTHON, "-m", "kpng", "--log-level", "warning",
                "kube", "--kubeconfig", kubeconfig, "to-local", "--node-name", NODE, "to-nft",
                "--once", timeout=600,
            )  # fmt: skip
            fresh = table_items(nft_table(self.netns))
        stale, missing = sorted(soaked - fresh), sorted(fresh - soaked)
        elements = sum(1 for item in fresh if " element " in item)
        kinds = collections.Counter(
            item.split(" ", 1)[0] for item in fresh if " element " not in item
        )
        print(
            f"  fresh full sync: {len(fresh)} items ({kinds['chain']} chains, {kinds['rule']} "
            f"rules, {kinds['set'] + kinds['map']} sets and maps, {elements} elements); soaked "
            f"node: {len(soaked)}; stale {len(stale)}, missing {len(missing)}"
        )
        for label, items in (("stale", stale), ("missing", missing)):
            for item in items[:10]:
                print(f"    {label}: {item[:300]}")
        equal = not stale and not missing
        print(f"  the soaked node's rules {'EQUAL' if equal else 'DIFFER FROM'} a fresh sync's")
        return equal

    def _compare_json(self, kubeconfig: str) -> bool:
        # Let the last writes reach the brain.
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        before = scrape(self.brain_metrics).get("kpng_store_revision")
        while time.monotonic() < deadline:
            time.sleep(5)
            now = scrape(self.brain_metrics).get("kpng_store_revision")
            if now == before:
                break
            before = now
        states = {}
        for label, argv in (
            ("brain", ["local", "--api", f"unix://{self.socket}", "--node-name", NODE]),
            ("fresh", ["kube", "--kubeconfig", kubeconfig, "to-local", "--node-name", NODE]),
        ):
            out = self.workdir / f"{label}.json"
            _run(PYTHON, "-m", "kpng", "--log-level", "warning", *argv, "to-json", "--once",
                 "--output", str(out), timeout=600)  # fmt: skip
            lines = out.read_text().splitlines()
            states[label] = _state_items(json.loads(lines[-1]))
        stale = sorted(states["brain"] - states["fresh"])
        missing = sorted(states["fresh"] - states["brain"])
        print(
            f"  node-000's state: fresh {len(states['fresh'])} entries, brain's "
            f"{len(states['brain'])}; stale {len(stale)}, missing {len(missing)}"
        )
        for label, items in (("stale", stale), ("missing", missing)):
            for item in items[:10]:
                print(f"    {label}: {item[:300]}")
        equal = not stale and not missing
        print(f"  the brain's state {'EQUAL' if equal else 'DIFFERS FROM'} a fresh sync's")
        return equal


def _state_items(state: Any) -> set[str]:
    """A to-json line as comparable entries: one per service, without revision or times."""
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k not in ("revision", "time", "timestamp")}
        services = state.pop("services", None)
        items = {f"top {json.dumps(state, sort_keys=True)}"}
        if isinstance(services, dict):
            services = list(services.values())
        for svc in services or []:
            items.add(json.dumps(svc, sort_keys=True))
        return items
    return {json.dumps(state, sort_keys=True)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--brain", action="store_true", help="soak kpng kube ... to-api")
    shape.add_argument("--local", action="store_true", help="soak kpng local ... to-nft")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0, help="minutes left out of the fit")
    parser.add_argument("--period", type=float, default=10.0, help="minutes of a churn wave")
    parser.add_argument("--relist-every", type=float, default=10.0, help="minutes (0: never)")
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds")
    parser.add_argument("--min-services", type=int, default=1000)
    parser.add_argument("--max-services", type=int, default=5000)
    parser.add_argument("--changes", type=int, default=5, help="slice changes per second")
    parser.add_argument("--watchers", type=int, default=100, help="with --brain")
    parser.add_argument(
        "--tracemalloc", type=int, default=0, metavar="FRAMES", help="trace kpng's allocations"
    )
    parser.add_argument("--output", type=Path, help="append each sample as a JSON line")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    args = parser.parse_args(argv)
    if not 1 <= args.minutes <= 24 * 60 or not 0 <= args.warmup < args.minutes:
        parser.error("--minutes: 1 to 1440; --warmup: below --minutes")
    if not 1 <= args.min_services <= args.max_services <= 20_000 or not 0 <= args.changes <= 100:
        parser.error("--min-services ≤ --max-services ≤ 20000; --changes: 0 to 100")
    if not 1 <= args.watchers <= 1000 or args.sample_every < 5 or args.period <= 0:
        parser.error("--watchers: 1 to 1000; --sample-every ≥ 5; --period > 0")
    if os.geteuid() != 0:
        parser.error("needs root: network namespaces, nftables, conntrack")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_api, with --brain

    def terminated(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    mode = "--brain" if args.brain else "--local" if args.local else "kube ... to-nft"
    print(
        f"soak ({mode}): {args.minutes:g} min, {args.min_services}-{args.max_services} Services "
        f"every {args.period:g} min, {args.changes} slice changes/s, 410 relist every "
        f"{args.relist_every:g} min, a sample every {args.sample_every:g} s; {os.cpu_count()} CPUs",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kpng-soak-", dir="/tmp"))
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            return Soak(args, stack, workdir).run()
    except SoakError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        print(f"(soak took {(time.monotonic() - started) / 60:.1f} min)", flush=True)
        if args.keep:
            print(f"(working directory kept: {workdir})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
