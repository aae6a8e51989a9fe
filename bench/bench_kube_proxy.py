"""kpng against upstream kube-proxy in nftables mode: the same API server state, node and
configuration file, one after the other, each in a network namespace of its own (root).

kube-proxy is built from the ``k8s.io/kubernetes`` Go module of the test control plane's release
(``kpng.testing.cluster.ensure_programs``), as that kube-apiserver is. For each size
(``--sizes``, services of the synthetic cluster of ``synthetic.py``, 10 endpoints each), a
control plane of its own is filled, listening on a veth address the namespaces reach; then
``kube-proxy --config F`` and ``kpng kube-proxy --config F`` (kpng's drop-in command, the same
file: ``mode: nftables``, node ``node-000``) run in turn, and for each:

1. **first full sync**: from process start until the rules of the complete state are in the
   kernel (``kubeproxy_sync_proxy_rules_last_timestamp_seconds`` set: both wait for every
   source to sync first);
2. **change -> rules**: ``--changes`` EndpointSlices of ClusterIP services get a new endpoint
   address, 1.5 s apart (past kube-proxy's 1 s minSyncPeriod, which the file sets for both),
   stamped with ``endpoints.kubernetes.io/last-change-trigger-time`` as the EndpointSlice
   controller does; the latency is what each reports in
   ``kubeproxy_network_programming_duration_seconds`` (trigger time to rules applied), median and
   worst;
3. **CPU seconds**, the process's own and its reaped children's (the ``nft`` processes
   kube-proxy runs, kpng's ``conntrack``): for the first sync, and per change;
4. **peak RSS** of the process (VmHWM).

Ratios kpng / kube-proxy follow each size (targets at 10k: first sync <= 0.5, change -> rules
<= 0.2, RSS and CPU per change <= 1). Every wait is bounded; namespaces, processes and the
control plane are removed at the end, also on failure.

    python bench/bench_kube_proxy.py [--sizes 1000,10000] [--changes 10]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import synthetic
from bench_kube import APISERVER_ARGS, NODE, fill

from kpng.testing.cluster import ControlPlane, ensure_binaries, ensure_programs
from kpng.testing.kubeapi import KubeApi
from kpng.testing.waiting import until

Obj = dict[str, Any]
HOST_IP = "10.252.77.1"
"""Where the API server listens, in this namespace."""
VETH_HOST_IP, NS_IP = "10.252.78.1", "10.252.78.2"
"""The veth pair between this namespace and the proxy's."""
METRICS = f"http://{NS_IP}:10249/metrics"
FIRST_SYNC_TIMEOUT_S = 900.0
CHANGE_TIMEOUT_S = 300.0
CHANGE_GAP_S = 1.5
TICK = os.sysconf("SC_CLK_TCK")

CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node}
bindAddress: {ns_ip}
metricsBindAddress: {ns_ip}:10249
healthzBindAddress: {ns_ip}:10256
clusterCIDR: 10.128.0.0/9
nftables:
  minSyncPeriod: 1s
conntrack:
  maxPerCore: 0
"""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True)


@contextmanager
def host_address() -> Iterator[None]:
    """``HOST_IP`` on a link of this namespace (a bridge without ports: not every kernel has
    dummy links), where the API server listens."""
    _run("ip", "link", "add", "kpkp0", "type", "bridge")
    try:
        _run("ip", "addr", "add", f"{HOST_IP}/32", "dev", "kpkp0")
        _run("ip", "link", "set", "kpkp0", "up")
        yield
    finally:
        subprocess.run(["ip", "link", "del", "kpkp0"], check=False)


@contextmanager
def namespace(name: str) -> Iterator[None]:
    """A fresh network namespace at ``NS_IP``, routed to this one by a veth pair; deleted on
    exit, with whatever rules the proxy left."""
    host = "kpkp-h"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", "kpkp-n", "netns", name)
        _run("ip", "addr", "add", f"{VETH_HOST_IP}/30", "dev", host)
        _run("ip", "link", "set", host, "up")
        inside = ("ip", "netns", "exec", name)
        _run(*inside, "ip", "addr", "add", f"{NS_IP}/30", "dev", "kpkp-n")
        _run(*inside, "ip", "link", "set", "kpkp-n", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "route", "add", "default", "via", VETH_HOST_IP)
        yield
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
        subprocess.run(["ip", "link", "del", host], check=False, stderr=subprocess.DEVNULL)


def scrape() -> dict[str, float]:
    """Every sample of the proxy's /metrics, summed over label sets (both report one family
    here)."""
    try:
        with urllib.request.urlopen(METRICS, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    until(check, what, within=timeout, interval=0.02, error=TimeoutError)


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime: the process and the children it has reaped."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICK


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Figures:
    first_sync_s: float
    first_sync_cpu_s: float
    change_ms: list[float]
    cpu_per_change_s: float
    rss_mib: float


def _candidates(slices: list[Obj]) -> list[Obj]:
    """Slices of ClusterIP services whose endpoints are ready and without hints: a new address
    there changes this node's rules."""
    return [
        s
        for s in slices
        if all(
            e.get("conditions", {}).get("ready", True) and not e.get("hints")
            for e in s["endpoints"]
        )
    ]


def measure(
    name: str, argv: list[str], plane: ControlPlane, slices: list[Obj], changes: int, log: Path
) -> Figures:
    netns = f"kpng-kp-{os.getpid()}"
    with namespace(netns), log.open("wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdout=out, stderr=out)
        try:
            wait_for(
                lambda: (
                    scrape().get("kubeproxy_sync_proxy_rules_last_timestamp_seconds", 0) > 0
                    or proc.poll() is not None
                ),
                FIRST_SYNC_TIMEOUT_S,
                f"{name}'s first sync",
            )
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: see {log}")
            first = time.monotonic() - started
            first_cpu = cpu_seconds(proc.pid)
            latencies = _changes(plane, slices, changes)
            cpu = cpu_seconds(proc.pid)
            return Figures(
                first, first_cpu, latencies, (cpu - first_cpu) / changes, peak_rss_mib(proc.pid)
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


_counter = iter(range(1, 1 << 20))


def _changes(plane: ControlPlane, slices: list[Obj], count: int) -> list[float]:
    """Milliseconds from each change's trigger time to its rules, as the proxy reports it."""
    api = KubeApi.of(plane)
    metric = "kubeproxy_network_programming_duration_seconds"
    rng = random.Random(11)
    out = []
    try:
        for s in rng.sample(_candidates(slices), count):
            time.sleep(CHANGE_GAP_S)
            before = scrape()
            n = next(_counter)
            endpoints = msgspec.json.decode(msgspec.json.encode(s["endpoints"]))
            endpoints[0]["addresses"] = [f"10.250.{n >> 8 & 255}.{n & 255}"]
            now = datetime.datetime.now(datetime.UTC)
            stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            patch = {
                "metadata": {
                    "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": stamp}
                },
                "endpoints": endpoints,
            }
            meta = s["metadata"]
            api.patch("EndpointSlice", meta["namespace"], meta["name"], patch)
            s["endpoints"] = endpoints
            observed = before.get(f"{metric}_count", 0.0)
            after: dict[str, float] = {}

            def programmed(observed: float = observed) -> bool:
                nonlocal after
                after = scrape()
                return after.get(f"{metric}_count", 0) > observed

            wait_for(programmed, CHANGE_TIMEOUT_S, "a change's rules")
            seen = after[f"{metric}_count"] - observed
            total = after[f"{metric}_sum"] - before.get(f"{metric}_sum", 0)
            out.append(total / seen * 1000)
    finally:
        api.close()
    return out


def run_size(
    services: int, changes: int, kube_proxy: Path, workdir: Path, verbosity: list[str]
) -> None:
    document = synthetic.generate(services)
    items: list[Obj] = document["items"]
    slices = [i for i in items if i["kind"] == "EndpointSlice"]
    binaries = ensure_binaries()
    with (
        host_address(),
        ControlPlane(binaries, apiserver_args=APISERVER_ARGS, address=HOST_IP) as plane,
    ):
        seconds = fill(plane, items, time.monotonic() + 900)
        # The node's address, as a kubelet reports it (the fill leaves status out): kube-proxy
        # waits 30 s for it otherwise.
        api = KubeApi.of(plane)
        try:
            status = {"status": {"addresses": [{"type": "InternalIP", "address": NS_IP}]}}
            path = f"/api/v1/nodes/{NODE}/status"
            api.request("PATCH", path, status, "application/merge-patch+json")
        finally:
            api.close()
        print(
            f"\n{services} services x 10 endpoints: {len(items)} objects filled in {seconds:.0f} s"
        )
        config = workdir / f"config-{services}.yaml"
        config.write_text(CONFIG.format(kubeconfig=plane.kubeconfig, node=NODE, ns_ip=NS_IP))
        proxies = {
            "kube-proxy": [str(kube_proxy), "--config", str(config), *verbosity],
            "kpng": [sys.executable, "-m", "kpng", "kube-proxy", "--config", str(config)],
        }
        figures = {}
        for name, argv in proxies.items():
            log = workdir / f"{name}-{services}.log"
            figures[name] = f = measure(name, argv, plane, slices, changes, log)
            print(
                f"   {name:10}  first sync {f.first_sync_s:6.2f} s "
                f"({f.first_sync_cpu_s:5.2f} CPU s)"
                f"   change -> rules median {statistics.median(f.change_ms):7.1f} ms, worst "
                f"{max(f.change_ms):7.1f} ms   CPU per change {f.cpu_per_change_s * 1000:6.1f} ms"
                f"   peak RSS {f.rss_mib:6.0f} MiB",
                flush=True,
            )
        k, p = figures["kpng"], figures["kube-proxy"]
        change = statistics.median(k.change_ms) / statistics.median(p.change_ms)
        print(
            f"   kpng / kube-proxy: first sync {k.first_sync_s / p.first_sync_s:.2f}x, "
            f"change -> rules {change:.2f}x"
            f", CPU per change {k.cpu_per_change_s / max(p.cpu_per_change_s, 1e-9):.2f}x, "
            f"peak RSS {k.rss_mib / p.rss_mib:.2f}x"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--logs", type=Path, help="keep the proxies' logs and configs here")
    parser.add_argument(
        "--verbose", action="store_true", help="kube-proxy at -v=4 (skews its figures)"
    )
    args = parser.parse_args(argv)
    sizes = args.sizes or [1000, 10000]
    kube_proxy = ensure_programs(["kube-proxy"])["kube-proxy"]
    version = subprocess.run([str(kube_proxy), "--version"], capture_output=True, text=True)
    print(f"{version.stdout.strip()} against kpng, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="kpng-bench-kp-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for size in sizes:
            run_size(size, args.changes, kube_proxy, workdir, ["-v", "4"] if args.verbose else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
