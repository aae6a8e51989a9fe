"""kpng against upstream kube-proxy in nftables or iptables mode (``--mode``): the same API server
state, node and configuration file, one after the other, each in a network namespace of its own
(root). In iptables mode kpng runs to-iptables, and both use the node's ``iptables`` (Debian's
alternative: iptables-nft unless switched). With ``--ebpf`` (nftables mode) kpng's to-ebpf is
measured third, the same way (issue 26: connect latency of to-ebpf, to-nft and kube-proxy's
nftables mode in one run).

kube-proxy is built from the ``k8s.io/kubernetes`` Go module of the test control plane's release
(``rig.cluster.ensure_programs``), as that kube-apiserver is. For each size
(``--sizes``, services of the synthetic cluster of ``synthetic.py``, 10 endpoints each), a
control plane of its own is filled, listening on a veth address the namespaces reach; then
``kube-proxy --config F`` and ``kpng kube-proxy --config F`` (kpng's drop-in command, the same
file: ``mode: nftables`` or ``iptables``, node ``node-000``) run in turn, and for each:

1. **first full sync**: from process start until the rules of the complete state are in the
   kernel (the time ``kubeproxy_sync_proxy_rules_last_timestamp_seconds`` reports: both wait
   for every source to sync first);
2. **change -> rules**: ``--changes`` EndpointSlices of ClusterIP services get a new endpoint
   address, 1.5 s apart (past kube-proxy's 1 s minSyncPeriod, which the file sets for both),
   stamped with ``endpoints.kubernetes.io/last-change-trigger-time`` as the EndpointSlice
   controller does; the latency is what each reports in
   ``kubeproxy_network_programming_duration_seconds`` (trigger time to rules applied), median and
   worst;
3. **CPU seconds**, the process's own and its reaped children's (the ``nft`` processes
   kube-proxy runs, kpng's ``conntrack``): for the first sync, and per change;
4. **peak RSS** of the process (VmHWM);
5. **connect latency** (after the first sync, before the changes): ``--connects`` TCP connects
   from the proxy's namespace (the node itself) to the ClusterIPs of ``CONNECT_TARGETS`` services,
   whose 10 endpoint addresses are made local there with a listener behind them; p50 and p99 of
   the time ``connect()`` takes. Every connection's first packet crosses the proxy's rules:
   iptables' KUBE-SERVICES is a list of a rule per service port, nftables' a map lookup;
   to-ebpf's programs give the socket an endpoint at ``connect()``, before any packet;
6. **conntrack entries** whose original destination is one of those ClusterIPs, after the
   connects: one a connection through DNAT rules, none through to-ebpf's translation.

**to-ebpf**: ``kpng kube-proxy`` has no choice of backend (the mode picks to-nft or
to-iptables), so to-ebpf runs as the command line the drop-in builds from the same file
(``kpng.kubeproxy.config.kpng_argv``) with ``to-nft`` made ``to-ebpf`` and given ``--cgroup``
and ``--pin-dir``, after ``kpng kube-proxy --config F --init-only`` (the drop-in's conntrack
settings). The cgroup is a directory of this run's own in the host's cgroup2 hierarchy
(``kpng.backends.ebpf.system.cgroup2_root``: /sys/fs/cgroup/unified on a cgroup v1 host), the
pins a directory of this run's own on bpffs (/sys/fs/bpf); both are removed after the run, also
on failure. kpng enters only the namespace's network (``nsenter --net``): ``ip netns exec``
remounts /sys, which hides both. The connect probe starts in that cgroup, where the programs
see its sockets, and the run fails unless to-ebpf's ``kpng_ebpf_translations{hook="connect4"}``
counted every connect and conntrack saw none of them: a to-ebpf column measured through the
nftables rules would be to-nft's.

Ratios against kube-proxy follow each size (targets at 10k for kpng's to-nft: first sync <= 0.5,
change -> rules <= 0.2, RSS and CPU per change <= 1), and to-ebpf's against to-nft. Every wait
is bounded; namespaces, processes and the control plane are removed at the end, also on failure.

    python bench/bench_kube_proxy.py [--mode nftables|iptables] [--iptables nft|legacy] [--ebpf]
        [--sizes 100,1000,10000] [--changes 10] [--connects 2000] [--first-sync-timeout 900]
"""

from __future__ import annotations

import argparse
import datetime
import operator
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import synthetic
from bench_kube import APISERVER_ARGS, NODE, fill
from bench_split import compiled_as_installed
from stats import nearest_rank

from kpng.backends.ebpf import remove_pins, system
from kpng.kubeproxy import command
from kpng.kubeproxy.config import kpng_argv
from kpng.testing.waiting import until
from rig.cluster import ControlPlane, ensure_binaries, ensure_programs
from rig.kubeapi import KubeApi

Obj = dict[str, Any]
HOST_IP = "10.252.77.1"
"""Where the API server listens, in this namespace."""
VETH_HOST_IP, NS_IP = "10.252.78.1", "10.252.78.2"
"""The veth pair between this namespace and the proxy's."""
METRICS = f"http://{NS_IP}:10249/metrics"
FIRST_SYNC_TIMEOUT_S = 900.0
"""The default of ``--first-sync-timeout``: a proxy slower than that is reported as such."""
CHANGE_TIMEOUT_S = 300.0
CHANGE_GAP_S = 1.5
TICK = os.sysconf("SC_CLK_TCK")

CONNECT_TARGETS = 5
"""Services connected to, taken at random: where a service sits in iptables' list matters."""

CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node}
bindAddress: {ns_ip}
metricsBindAddress: {ns_ip}:10249
healthzBindAddress: {ns_ip}:10256
clusterCIDR: 10.128.0.0/9
{mode}:
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


def _samples() -> Iterator[tuple[str, str]]:
    """(name and labels, value) of each sample of the proxy's /metrics; none if it does not
    answer."""
    try:
        with urllib.request.urlopen(METRICS, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            yield name_labels, value


def scrape() -> dict[str, float]:
    """Every sample of the proxy's /metrics, summed over label sets (both report one family
    here); timestamps, the newest."""
    out: dict[str, float] = {}
    for name_labels, value in _samples():
        name = name_labels.split("{", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        # A time reported per family is a time, not an amount: the newest.
        merge = max if name.endswith("_timestamp_seconds") else operator.add
        out[name] = merge(out.get(name, 0.0), number)
    return out


TRANSLATED_CONNECTS = 'kpng_ebpf_translations_total{hook="connect4"}'


def translated_connects() -> float:
    """How many IPv4 connects to-ebpf's programs have given an endpoint, by its /metrics."""
    return sum(float(v) for name, v in _samples() if name == TRANSLATED_CONNECTS)


POLL_S = 0.2
"""How often /metrics is read while waiting. The figures come from the proxies' own metrics
(the time of the first sync, the programming latency histogram), not from when a poll saw
them, so polling faster would only load the proxy measured: at 20 ms, kpng's Python event loop
spent some 30 ms of each 200 ms change at 1k services rendering /metrics."""


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    until(check, what, within=timeout, interval=POLL_S, error=TimeoutError)


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime: the process and the children it has reaped."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime + stime, cutime + cstime): the process's own CPU, its reaped children's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = [int(v) for v in fields[11:15]]
    return (ticks[0] + ticks[1]) / TICK, (ticks[2] + ticks[3]) / TICK


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
    children_cpu_per_change_s: float
    rss_mib: float
    connect_us: list[float]
    conntracked: int
    """Conntrack entries to the connect targets' ClusterIPs after the connects."""


@dataclass(frozen=True)
class Proxy:
    """A proxy measured: its command line, run in the proxy's namespace after ``prepare``
    (when given, and not timed). A proxy that ``balances_sockets`` (to-ebpf) is given
    ``--cgroup`` and ``--pin-dir`` directories of its own, the connect probe runs in that
    cgroup, and its connects must be seen translated."""

    name: str
    argv: list[str]
    prepare: list[str] = field(default_factory=list)
    balances_sockets: bool = False


@dataclass(frozen=True)
class SocketDirs:
    """to-ebpf's ``--cgroup`` and ``--pin-dir``."""

    cgroup: Path
    pin_dir: Path


@contextmanager
def socket_dirs() -> Iterator[SocketDirs]:
    """A cgroup2 directory and a pin directory on bpffs of this run's own, for to-ebpf: not the
    whole hierarchy, which would translate every process's connects on the machine. Removed on
    exit, pins first (they hold the programs' links to the cgroup), also on failure."""
    cgroup = system.cgroup2_root() / f"kpng-bench-kp-{os.getpid()}"
    system.ensure_bpffs(system.BPFFS)
    cgroup.mkdir()
    try:
        pin_dir = Path(tempfile.mkdtemp(prefix="kpng-bench-kp-", dir=system.BPFFS))
        try:
            yield SocketDirs(cgroup, pin_dir)
        finally:
            remove_pins(pin_dir)
    finally:
        try:
            cgroup.rmdir()
        except OSError as exc:
            print(f"cannot remove the cgroup {cgroup}: {exc}", file=sys.stderr)


def ebpf_argv(config: Path) -> list[str]:
    """kpng's command line with to-ebpf for the kube-proxy configuration file ``config``: the
    one ``kpng kube-proxy --config`` runs with to-nft (``--cgroup`` and ``--pin-dir`` to be
    added)."""
    pipeline = kpng_argv(command.build(["--config", str(config)]).config)
    if pipeline.count("to-nft") != 1:
        raise RuntimeError(f"no to-nft to replace in kpng kube-proxy's {pipeline}")
    pipeline[pipeline.index("to-nft")] = "to-ebpf"
    return [sys.executable, "-m", "kpng", *pipeline]


@dataclass(frozen=True)
class Target:
    """A ClusterIP service port to connect to, and its endpoints' addresses and port."""

    cluster_ip: str
    port: int
    endpoints: tuple[str, ...]
    endpoint_port: int


PROBE_WARM_UP = 200
"""Connects the probe makes before those it times."""
PROBE = """
import json, socket, sys, threading, time
targets, count, warm_up = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for port in {t[2] for t in targets}:
    listener = socket.create_server(("0.0.0.0", port), backlog=4096, reuse_port=True)
    def serve(listener=listener):
        while True:
            listener.accept()[0].close()
    threading.Thread(target=serve, daemon=True).start()
took = []
for i in range(count + warm_up):
    ip, port, _ = targets[i % len(targets)]
    client = socket.socket()
    client.settimeout(5)
    started = time.perf_counter_ns()
    try:
        client.connect((ip, port))
    except OSError as exc:
        sys.exit(f"connect {i} to {ip}:{port}: {exc}")
    if i >= warm_up:  # the first ones warm caches up
        took.append((time.perf_counter_ns() - started) / 1000)
    client.close()
print(json.dumps(took))
"""
"""Run in the proxy's namespace: listeners on the endpoints' port, then timed connects."""


def connect_latencies(
    netns: str, targets: list[Target], count: int, *, cgroup: Path | None
) -> list[float]:
    """Microseconds each connect to the targets' ClusterIPs took, from the proxy's namespace
    (the node), with the targets' endpoint addresses local there (on a bridge of their own);
    the probe in ``cgroup`` if given."""
    inside = ("ip", "netns", "exec", netns)
    _run(*inside, "ip", "link", "add", "kpkp-ep", "type", "bridge")
    _run(*inside, "ip", "link", "set", "kpkp-ep", "up")
    for address in sorted({a for t in targets for a in t.endpoints}):
        _run(*inside, "ip", "addr", "add", f"{address}/32", "dev", "kpkp-ep")
    spec = [[t.cluster_ip, t.port, t.endpoint_port] for t in targets]
    encoded = msgspec.json.encode(spec).decode()
    probe = [*inside, sys.executable, "-c", PROBE, encoded, str(count), str(PROBE_WARM_UP)]
    if cgroup is not None:
        # As kpng.testing.netns.TestBed.command_in: the shell joins the cgroup, then becomes
        # the probe, whose sockets the cgroup's programs then see.
        procs = str(cgroup / "cgroup.procs")
        probe = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *probe]
    done = subprocess.run(
        probe,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    _run(*inside, "ip", "link", "del", "kpkp-ep")
    if done.returncode != 0:
        raise RuntimeError(f"the connect probe failed: {done.stderr.strip()}")
    return list(msgspec.json.decode(done.stdout))


def conntrack_entries(*, netns: str, targets: list[Target]) -> int:
    """Conntrack entries in ``netns`` whose original destination is a target's ClusterIP."""
    found = 0
    for ip in sorted({t.cluster_ip for t in targets}):
        listed = subprocess.run(
            ["ip", "netns", "exec", netns, "conntrack", "-L", "-p", "tcp", "--orig-dst", ip],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        found += sum(1 for line in listed.stdout.splitlines() if line.startswith("tcp"))
    return found


def connect_targets(api: KubeApi, slices: list[Obj], changing: list[Obj]) -> list[Target]:
    """``CONNECT_TARGETS`` single-port TCP ClusterIP services whose 10 endpoints are all
    ready, at random (the same ones for every proxy); their ClusterIPs as the API server
    allocated them."""
    # Not a slice the changes move: a proxy's changes would take its endpoints away from the
    # local addresses before the next proxy's connects.
    candidates = [s for s in _candidates(slices) if not any(s is c for c in changing)]
    random.Random(7).shuffle(candidates)
    found: list[Target] = []
    for s in candidates:
        if len(found) == CONNECT_TARGETS:
            break
        meta = s["metadata"]
        service = api.get(
            "Service", meta["namespace"], meta["labels"]["kubernetes.io/service-name"]
        )
        spec = service["spec"]
        if spec["type"] != "ClusterIP" or len(spec["ports"]) != 1 or len(s["ports"]) != 1:
            continue
        if spec["ports"][0].get("protocol", "TCP") != "TCP":
            continue
        endpoints = tuple(a for e in s["endpoints"] for a in e["addresses"])
        found.append(
            Target(spec["clusterIP"], spec["ports"][0]["port"], endpoints, s["ports"][0]["port"])
        )
    return found


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
    proxy: Proxy,
    plane: ControlPlane,
    changing: list[Obj],
    log: Path,
    targets: list[Target],
    connects: int,
    first_sync_timeout: float,
    env: Mapping[str, str],
) -> Figures | None:
    """The proxy's figures; None if its first sync took longer than ``first_sync_timeout``."""
    name = proxy.name
    netns = f"kpng-kp-{os.getpid()}"
    dirs: AbstractContextManager[SocketDirs | None] = (
        socket_dirs() if proxy.balances_sockets else nullcontext()
    )
    with namespace(netns), dirs as sockets, log.open("wb") as out:
        if proxy.prepare:
            subprocess.run(
                ["ip", "netns", "exec", netns, *proxy.prepare],
                stdout=out,
                stderr=out,
                env=env,
                timeout=60,
                check=True,
            )
        argv = ["ip", "netns", "exec", netns, *proxy.argv]
        if sockets is not None:
            # ip netns exec remounts /sys, hiding the cgroup2 and bpffs mounts under it.
            argv = ["nsenter", f"--net=/run/netns/{netns}", *proxy.argv]
            argv += ["--cgroup", str(sockets.cgroup), "--pin-dir", str(sockets.pin_dir)]
        started = time.time()
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env)
        synced_at = 0.0

        def synced() -> bool:
            nonlocal synced_at
            synced_at = scrape().get("kubeproxy_sync_proxy_rules_last_timestamp_seconds", 0.0)
            return synced_at > 0 or proc.poll() is not None

        try:
            try:
                wait_for(synced, first_sync_timeout, f"{name}'s first sync")
            except TimeoutError:
                print(
                    f"   {name:10}  no first sync within {first_sync_timeout:.0f} s "
                    f"({cpu_seconds(proc.pid):.0f} CPU s spent); see {log}",
                    flush=True,
                )
                return None
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: see {log}")
            first = synced_at - started
            first_cpu = cpu_seconds(proc.pid)
            connect: list[float] = []
            conntracked = 0
            if connects:
                translated = translated_connects()
                cgroup = sockets.cgroup if sockets is not None else None
                connect = connect_latencies(netns, targets, connects, cgroup=cgroup)
                translated = translated_connects() - translated
                conntracked = conntrack_entries(netns=netns, targets=targets)
                if sockets is not None:
                    _check_translated(
                        name=name, connects=connects, translated=translated, conntracked=conntracked
                    )
            own_before, children_before = cpu_split(proc.pid)
            latencies = _changes(plane, changing)
            own, children = cpu_split(proc.pid)
            return Figures(
                first,
                first_cpu,
                latencies,
                (own + children - own_before - children_before) / len(changing),
                (children - children_before) / len(changing),
                peak_rss_mib(proc.pid),
                connect,
                conntracked,
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def _check_translated(*, name: str, connects: int, translated: float, conntracked: int) -> None:
    """Fail unless the programs gave every connect of the probe (its warm-up's included) an
    endpoint and none went through the nftables rules (which would leave conntrack entries)."""
    made = connects + PROBE_WARM_UP
    if translated < made or conntracked:
        raise RuntimeError(
            f"{name}: {translated:.0f} of {made} connects translated at connect, {conntracked} "
            "conntrack entries to the ClusterIPs: its connect latency would be the nftables "
            "rules'"
        )


_counter = iter(range(1, 1 << 20))


def _changes(plane: ControlPlane, changing: list[Obj]) -> list[float]:
    """Milliseconds from each change's trigger time to its rules, as the proxy reports it."""
    api = KubeApi.of(plane)
    metric = "kubeproxy_network_programming_duration_seconds"
    out = []
    try:
        for s in changing:
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
    services: int,
    changes: int,
    connects: int,
    mode: str,
    first_sync_timeout: float,
    env: Mapping[str, str],
    kube_proxy: Path,
    workdir: Path,
    verbosity: list[str],
    ebpf: bool,
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
            # The same slices change under every proxy; connects avoid them.
            changing = random.Random(11).sample(_candidates(slices), changes)
            targets = connect_targets(api, slices, changing)
        finally:
            api.close()
        print(
            f"\n{services} services x 10 endpoints: {len(items)} objects filled in {seconds:.0f} s"
        )
        config = workdir / f"config-{services}.yaml"
        config.write_text(
            CONFIG.format(kubeconfig=plane.kubeconfig, node=NODE, ns_ip=NS_IP, mode=mode)
        )
        drop_in = [sys.executable, "-m", "kpng", "kube-proxy", "--config", str(config)]
        # kpng's drop-in is named for the backend the mode gives it.
        kpng = BACKENDS[mode]
        proxies = [
            Proxy("kube-proxy", [str(kube_proxy), "--config", str(config), *verbosity]),
            Proxy(kpng, drop_in),
        ]
        if ebpf:
            proxies.append(
                Proxy(
                    "to-ebpf",
                    ebpf_argv(config),
                    prepare=[*drop_in, "--init-only"],
                    balances_sockets=True,
                )
            )
        figures = {}
        for proxy in proxies:
            name = proxy.name
            log = workdir / f"{name}-{services}.log"
            measured = measure(
                proxy, plane, changing, log, targets, connects, first_sync_timeout, env
            )
            if measured is None:
                continue
            figures[name] = f = measured
            print(
                f"   {name:11} first sync {f.first_sync_s:6.2f} s "
                f"({f.first_sync_cpu_s:5.2f} CPU s)"
                f"   change -> rules median {statistics.median(f.change_ms):7.1f} ms, worst "
                f"{max(f.change_ms):7.1f} ms   CPU per change {f.cpu_per_change_s * 1000:6.1f} ms "
                f"({f.children_cpu_per_change_s * 1000:.1f} in children)"
                f"   peak RSS {f.rss_mib:6.0f} MiB   connect p50 "
                f"{nearest_rank(f.connect_us, 0.5):6.1f} us, p99 "
                f"{nearest_rank(f.connect_us, 0.99):6.1f} us"
                f"   conntrack entries to the ClusterIPs {f.conntracked}",
                flush=True,
            )
        for a, b in ((kpng, "kube-proxy"), ("to-ebpf", "kube-proxy"), ("to-ebpf", kpng)):
            if a in figures and b in figures:
                print_ratios(title=f"{a} / {b}", a=figures[a], b=figures[b])


BACKENDS = {"nftables": "to-nft", "iptables": "to-iptables"}
"""kpng's backend for kube-proxy's mode, as ``kpng kube-proxy`` picks it."""


def print_ratios(*, title: str, a: Figures, b: Figures) -> None:
    change = statistics.median(a.change_ms) / statistics.median(b.change_ms)
    p50 = nearest_rank(a.connect_us, 0.5) / nearest_rank(b.connect_us, 0.5)
    p99 = nearest_rank(a.connect_us, 0.99) / nearest_rank(b.connect_us, 0.99)
    print(
        f"   {title}: first sync {a.first_sync_s / b.first_sync_s:.2f}x, "
        f"change -> rules {change:.2f}x"
        f", CPU per change {a.cpu_per_change_s / max(b.cpu_per_change_s, 1e-9):.2f}x, "
        f"peak RSS {a.rss_mib / b.rss_mib:.2f}x, connect p50 {p50:.2f}x, p99 {p99:.2f}x"
    )


def _variant_bin(variant: str, workdir: Path) -> Path:
    """A directory where ``iptables``, ``ip6tables`` and their -save and -restore are
    ``variant``'s (xtables-*-multi tells the command by its name), put first in both proxies'
    PATH: the node's alternative stays as it is."""
    directory = workdir / f"iptables-{variant}"
    directory.mkdir(exist_ok=True)
    for name in ("iptables", "ip6tables"):
        for suffix in ("", "-save", "-restore"):
            link = directory / f"{name}{suffix}"
            link.unlink(missing_ok=True)
            link.symlink_to(f"/usr/sbin/xtables-{variant}-multi")
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--mode", choices=("nftables", "iptables"), default="nftables")
    parser.add_argument(
        "--iptables",
        choices=("nft", "legacy"),
        help="in iptables mode, the variant both proxies find as `iptables` (default: the "
        "node's alternative)",
    )
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument(
        "--first-sync-timeout",
        type=float,
        default=FIRST_SYNC_TIMEOUT_S,
        help="seconds a proxy may take for its first sync before it is reported as too slow",
    )
    parser.add_argument(
        "--connects", type=int, default=2000, help="timed connects per proxy (0: none)"
    )
    parser.add_argument(
        "--ebpf",
        action="store_true",
        help="also measure kpng with to-ebpf, third (nftables mode: its packets part is to-nft's)",
    )
    parser.add_argument("--logs", type=Path, help="keep the proxies' logs and configs here")
    parser.add_argument(
        "--verbose", action="store_true", help="kube-proxy at -v=4 (skews its figures)"
    )
    args = parser.parse_args(argv)
    compiled_as_installed()
    if args.ebpf and args.mode != "nftables":
        parser.error("--ebpf is judged against nftables mode (--mode nftables)")
    sizes = args.sizes or [1000, 10000]
    kube_proxy = ensure_programs(["kube-proxy"])["kube-proxy"]
    version = subprocess.run([str(kube_proxy), "--version"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="kpng-bench-kp-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if args.iptables:
            env["PATH"] = f"{_variant_bin(args.iptables, workdir)}:{env['PATH']}"
        iptables = subprocess.run(
            ["iptables", "--version"], capture_output=True, text=True, env=env
        )
        print(
            f"{version.stdout.strip()} against kpng, {args.mode} mode "
            f"({iptables.stdout.strip()}), load average {os.getloadavg()[0]:.2f}"
        )
        for size in sizes:
            verbosity = ["-v", "4"] if args.verbose else []
            run_size(
                size,
                args.changes,
                args.connects,
                args.mode,
                args.first_sync_timeout,
                env,
                kube_proxy,
                workdir,
                verbosity,
                args.ebpf,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
