"""Network programming latency on real nodes: kpng against kube-proxy, in the same harness.

For each proxy, a real cluster (``rig.nodes``: two kubelets, containerd, the
controllers) with that proxy deployed as a DaemonSet. Then ``--runs`` times: a ClusterIP Service
is created, a client pod on node-1 starts trying it every 50 ms, and a Deployment of 10 netexec
pods behind the Service is created; the figure is the time from the Deployment's creation to the
client's first successful HTTP request through the ClusterIP. It includes scheduling and
starting the pods (the same for both proxies); what differs is how soon each proxy programs the
endpoints once the EndpointSlice controller publishes them. sig-scalability's network
programming latency SLO measures that last part.

    sudo .venv/bin/python bench/bench_real_cluster.py [--runs 10] [--proxy kpng --proxy kube-proxy]
        [--shape daemonset --shape sidecar --shape central] [--mode nftables --mode ebpf]

With several ``--shape``, kpng is measured in each (``rig.addons.SHAPES``), one after
the other; with several ``--mode``, in each mode (nftables: to-nft, ebpf: to-ebpf; kube-proxy
is measured in nftables mode). For each, the API server's own metrics say how many watches of
EndpointSlices it holds, and how many bytes of EndpointSlice watch events it sent per run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from rig import addons, e2e, images
from rig import kubeapi as k
from rig.nodes import RealCluster

REPLICAS = 10
TRY_TIMEOUT_S = 120


def one_run(cluster: RealCluster, index: int) -> float:
    name = f"bench-{index}"
    ports = [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]
    cluster.apply(k.service(name, "default", ports=ports, selector={"app": name}))
    cluster_ip = cluster.get("service", name)["spec"]["clusterIP"]
    # The client prints the wall-clock time of its first success; pods share the machine's
    # clock, so it compares with the creation time taken here.
    script = (
        f"end=$(( $(date +%s) + {TRY_TIMEOUT_S} )); "
        f"while [ $(date +%s) -lt $end ]; do "
        f"if curl -s -o /dev/null --max-time 1 http://{cluster_ip}/hostname; then "
        f"date +%s.%N; exit 0; fi; sleep 0.05; done; exit 1"
    )
    client = subprocess.Popen(
        [
            str(cluster.programs["kubectl"]),
            f"--kubeconfig={cluster.kubeconfig}",
            "exec",
            "bench-client",
            "--",
            "sh",
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)  # the loop is running (and failing: no endpoints yet)
    created = time.time()
    netexec = ["netexec", "--http-port=8080"]
    deployment = k.deployment(
        name,
        "default",
        images.agnhost_reference(),
        netexec,
        replicas=REPLICAS,
        terminationGracePeriodSeconds=1,
    )
    cluster.apply(deployment)
    out, _ = client.communicate(timeout=TRY_TIMEOUT_S + 30)
    if client.returncode != 0:
        raise RuntimeError(f"run {index}: no connection through {cluster_ip} in time")
    latency = float(out.strip()) - created
    cluster.kubectl("delete", "deployment", name, "--wait=false")
    cluster.kubectl("delete", "service", name)
    cluster.kubectl("wait", "--for=delete", "pod", "-l", f"app={name}", "--timeout=120s")
    return latency


def slice_watch_figures(cluster: RealCluster) -> tuple[float, float]:
    """(EndpointSlice watches the API server holds now, bytes of EndpointSlice watch events it
    has sent so far), from its /metrics."""
    watches = sent = 0.0
    for line in cluster.kubectl("get", "--raw", "/metrics").splitlines():
        if line.startswith("#") or "endpointslice" not in line.lower():
            continue
        if line.startswith("apiserver_longrunning_requests{") and 'verb="WATCH"' in line:
            watches += float(line.rsplit(" ", 1)[1])
        elif line.startswith("apiserver_watch_events_sizes_sum{"):
            sent += float(line.rsplit(" ", 1)[1])
    return watches, sent


def measure(
    proxy: str, runs: int, shape: str = "daemonset", mode: str = "nftables"
) -> tuple[list[float], float, float]:
    """Latencies, EndpointSlice watches held, and slice watch bytes sent per run."""
    cluster = e2e.start_cluster(proxy, with_dns=False, shape=shape, mode=mode)
    try:
        image = images.agnhost_reference()
        cluster.apply(k.pod("bench-client", "default", image, ["pause"], node="node-1"))
        cluster.kubectl("wait", "--for=condition=Ready", "pod/bench-client", "--timeout=120s")
        watches, sent_before = slice_watch_figures(cluster)
        latencies = []
        for i in range(runs):
            latency = one_run(cluster, i)
            print(f"  {proxy} ({shape}, {mode}) run {i + 1}: {latency:.2f} s", flush=True)
            latencies.append(latency)
        _, sent_after = slice_watch_figures(cluster)
        return latencies, watches, (sent_after - sent_before) / runs
    finally:
        cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--proxy", choices=e2e.PROXIES, action="append")
    parser.add_argument("--shape", choices=tuple(addons.SHAPES), action="append")
    parser.add_argument("--mode", choices=("nftables", "ebpf"), action="append")
    args = parser.parse_args(argv)
    results = {}
    for proxy in args.proxy or e2e.PROXIES:
        kpng = proxy == "kpng"
        for shape in (args.shape or ["daemonset"]) if kpng else ["daemonset"]:
            for mode in (args.mode or ["nftables"]) if kpng else ["nftables"]:
                extra = [s for s in (shape, mode) if s not in ("daemonset", "nftables")]
                name = f"{proxy} ({', '.join(extra)})" if extra else proxy
                print(f"{name}: {REPLICAS} pods behind a Service → first connection through it")
                results[name] = measure(proxy, args.runs, shape, mode)
    print(
        "\n| proxy | median | min | max | runs | EndpointSlice watches | slice watch bytes / run |"
        "\n|---|---|---|---|---|---|---|"
    )
    for name, (latencies, watches, sent) in results.items():
        print(
            f"| {name} | {statistics.median(latencies):.2f} s | {min(latencies):.2f} s "
            f"| {max(latencies):.2f} s | {len(latencies)} | {watches:.0f} | {sent:,.0f} |"
        )
    if set(e2e.PROXIES) <= set(results):
        kpng, baseline = (statistics.median(results[p][0]) for p in e2e.PROXIES)
        print(f"\nkpng / kube-proxy (medians): {kpng / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
