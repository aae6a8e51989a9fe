"""Upstream's e2e tests on a real cluster of this machine, with kpng or kube-proxy as its proxy.

    python -m rig.e2e                      # kpng, then kube-proxy: ~15 min each
    python -m rig.e2e --proxy kpng --focus 'should serve a basic endpoint'
    python -m rig.e2e --mode iptables      # kube-proxy's iptables mode, to-iptables
    python -m rig.e2e --shape sidecar      # kpng as a brain and a backend per node
    python -m rig.e2e --shape central      # kpng's brains in a Deployment
    python -m rig.e2e --dual-stack-suite   # [Feature:IPv6DualStack] on a dual-stack cluster

Each run starts a ``RealCluster`` (``rig.nodes``), imports the locally built images into
its nodes, deploys the proxy and CoreDNS, runs ``e2e.test`` (built from ``k8s.io/kubernetes``'
``test/e2e`` at the cluster's release) against it, writes the JUnit report and a summary under
``--report-dir``, and removes the cluster. Images come from ``kpng.local/...`` through
``KUBE_TEST_REPO_LIST``, the suite's own registry override: nothing is pulled.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from rig import addons, images
from rig.cluster import ControlPlaneError, ensure_programs, kubernetes_release
from rig.nodes import RealCluster

log = logging.getLogger(__name__)

PROXIES = ("kpng", "kube-proxy")

PROXY_FOCUS = (
    r"\[sig-network\] (Services |Networking Granular Checks: Services|EndpointSlice|Conntrack"
    r"|Connectivity Pod Lifecycle|Service CIDRs|Networking should check kube-proxy urls"
    r"|KubeProxy)"
)
"""What exercises a service proxy: the Services tests (session affinity, hairpin, source IP,
traffic policies, terminating endpoints among them), EndpointSlices, conntrack, the networking
checks that go through Services, and the proxy's own tests."""

PROXY_SKIP = r"\[Disruptive\]|\[Feature:|\[Flaky\]"
"""Disruptive tests restart nodes over SSH; Feature tests need a feature gate or a cloud.
Tests that need a cloud load balancer skip themselves (the provider is ``skeleton``)."""

DUAL_STACK_FOCUS = r"\[Feature:IPv6DualStack\]"
"""test/e2e/network/dual_stack.go: dual-stack Nodes, pods and Services, and the Services
granular checks through each Service's secondary (IPv6) ClusterIP and the nodes' IPv6 node
ports."""

DUAL_STACK_SKIP = r"\[Disruptive\]|\[Flaky\]|\[Feature:SCTPConnectivity\]"
"""Every dual-stack test but SCTP's, which needs its own feature too (as in ``PROXY_SKIP``)."""

SMOKE_FOCUS = (
    r"\[sig-network\] Services should (serve a basic endpoint from pods|"
    r"be able to create a functioning NodePort service)"
)


@dataclass
class Outcome:
    name: str
    state: str  # passed, failed, skipped
    seconds: float
    message: str = ""


@dataclass
class Report:
    proxy: str
    kubernetes_version: str
    focus: str
    skip: str
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, state: str) -> int:
        return sum(1 for o in self.outcomes if o.state == state)

    def summary(self) -> str:
        return (
            f"{self.proxy}: {self.count('passed')} passed, {self.count('failed')} failed, "
            f"{self.count('skipped')} skipped in {self.seconds / 60:.1f} min"
        )


def parse_junit(path: Path) -> list[Outcome]:
    """The outcome of every spec a ginkgo JUnit report (``--report-dir``'s junit_01.xml) says
    was selected; suite set-up and reporting nodes, and specs the focus left out, are not."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("[It] "):
            continue
        seconds = float(case.get("time") or 0)
        skipped = case.find("skipped")
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if skipped is not None:
            message = skipped.get("message", "")
            if message == "skipped":  # not selected: a spec that skips itself gives a reason
                continue
            state = "skipped"
        elif problem is not None:
            state, message = "failed", problem.get("message") or ""
        else:
            state, message = "passed", ""
        outcomes.append(Outcome(name.removeprefix("[It] "), state, seconds, message[:500]))
    return outcomes


def run_suite(
    cluster: RealCluster,
    *,
    proxy: str,
    focus: str,
    skip: str,
    report_dir: Path,
    timeout_s: int,
    procs: int = 4,
) -> Report:
    programs = ensure_programs(["e2e.test", "kubectl", "ginkgo"])
    report_dir.mkdir(parents=True, exist_ok=True)
    repos = report_dir / "repo-list.yaml"
    repos.write_text(yaml.safe_dump(images.E2E_REPO_LIST))
    argv = [
        str(programs["ginkgo"]),
        f"--procs={procs}",
        f"--focus={focus}",
        f"--skip={skip}",
        f"--timeout={timeout_s}s",
        "--no-color",
        "-v",
        str(programs["e2e.test"]),
        "--",
        f"--kubeconfig={cluster.kubeconfig}",
        f"--kubectl-path={programs['kubectl']}",
        # Not `local`: that provider claims SSH to nodes, so SSH tests would fail, not skip.
        "--provider=skeleton",
        # Given, not detected: only the first process would detect it.
        f"--num-nodes={len(cluster.nodes)}",
        f"--report-dir={report_dir}",
        # Else the suite runs cluster/log-dump/log-dump.sh over SSH at the end.
        "--disable-log-dump",
    ]
    env = {**os.environ, "KUBE_TEST_REPO_LIST": str(repos), "KUBECONFIG": str(cluster.kubeconfig)}
    started = time.monotonic()
    with (report_dir / "e2e.log").open("w") as out:
        subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - started
    junit = report_dir / "junit_01.xml"
    if not junit.exists():
        raise ControlPlaneError(f"e2e.test wrote no report; see {report_dir / 'e2e.log'}")
    report = Report(
        proxy=proxy,
        kubernetes_version=kubernetes_release(),
        focus=focus,
        skip=skip,
        seconds=seconds,
        outcomes=parse_junit(junit),
    )
    (report_dir / "summary.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def start_cluster(
    proxy: str,
    nodes: int = 2,
    *,
    mode: str = "nftables",
    shape: str = "daemonset",
    with_dns: bool = True,
    dual_stack: bool = False,
) -> RealCluster:
    """A started cluster with ``proxy`` (and CoreDNS) deployed and Ready, in kube-proxy's
    ``mode`` (kpng: to-nft for nftables, to-iptables for iptables), kpng in ``shape``
    (``addons.SHAPES``), IPv4 or ``dual_stack``."""
    archives = images.node_images(with_kube_proxy=proxy == "kube-proxy")
    cluster = RealCluster(
        nodes=nodes,
        images=archives,
        pause_image=images.pause_reference(),
        cgroup2=proxy == "kpng" and mode == "ebpf",
        dual_stack=dual_stack,
    )
    cluster.start()
    try:
        if proxy == "kpng":
            addons.deploy_kpng(cluster, images.KPNG_REFERENCE, mode=mode, shape=shape)
        else:
            # kube-proxy has no ebpf mode: kpng's to-ebpf is judged against its nftables mode.
            baseline = "nftables" if mode == "ebpf" else mode
            addons.deploy_kube_proxy(cluster, images.kube_proxy_reference(), mode=baseline)
        if with_dns:
            addons.deploy_coredns(cluster, images.COREDNS_REFERENCE)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def compare(reports: Sequence[Report]) -> str:
    """A markdown table of each proxy's counts, then every test whose outcome differs."""
    lines = [
        "| proxy | passed | failed | skipped | minutes |",
        "|---|---|---|---|---|",
        *(
            f"| {r.proxy} | {r.count('passed')} | {r.count('failed')} | {r.count('skipped')} "
            f"| {r.seconds / 60:.0f} |"
            for r in reports
        ),
    ]
    states = {r.proxy: {o.name: o.state for o in r.outcomes} for r in reports}
    names = sorted({name for by_name in states.values() for name in by_name})
    differing = [n for n in names if len({s.get(n, "-") for s in states.values()}) > 1]
    if differing:
        lines += ["", "| test | " + " | ".join(states) + " |", "|---|" + "---|" * len(states)]
        lines += [
            f"| {name} | " + " | ".join(s.get(name, "-") for s in states.values()) + " |"
            for name in differing
        ]
    return "\n".join(lines) + "\n"


def regressions(kpng: Report, baseline: Report) -> list[str]:
    """Tests the baseline passes and kpng does not: what "done" forbids."""
    ours = {o.name: o.state for o in kpng.outcomes}
    return [
        o.name for o in baseline.outcomes if o.state == "passed" and ours.get(o.name) != "passed"
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rig.e2e",
        description="upstream's e2e tests on real nodes, with kpng and with kube-proxy",
    )
    parser.add_argument(
        "--proxy",
        choices=PROXIES,
        action="append",
        help="the proxy to test; repeat for several (default: kpng, then kube-proxy)",
    )
    parser.add_argument(
        "--mode",
        choices=("nftables", "iptables", "ebpf"),
        default="nftables",
        help="kube-proxy's proxy mode, in both proxies' configuration; ebpf: kpng's to-ebpf "
        "(the daemonset shape), against kube-proxy's nftables mode",
    )
    parser.add_argument(
        "--shape",
        choices=tuple(addons.SHAPES),
        default="daemonset",
        help="how kpng is deployed: one process per node (deploy/kpng.yaml), a brain and a "
        "backend container per node (deploy/kpng-sidecar.yaml), or brains in a Deployment "
        "serving a backend on every node (deploy/kpng-central.yaml)",
    )
    parser.add_argument(
        "--dual-stack",
        action="store_true",
        help="a dual-stack cluster: IPv6 beside IPv4 on nodes, pods and services (IPv4 primary)",
    )
    parser.add_argument("--focus", help=f"ginkgo focus regexp (default {PROXY_FOCUS!r})")
    parser.add_argument("--skip", help=f"ginkgo skip regexp (default {PROXY_SKIP!r})")
    suites = parser.add_mutually_exclusive_group()
    suites.add_argument("--smoke", action="store_true", help=f"focus on {SMOKE_FOCUS!r}")
    suites.add_argument(
        "--dual-stack-suite",
        action="store_true",
        help=f"upstream's dual-stack tests on a dual-stack cluster: focus {DUAL_STACK_FOCUS!r}, "
        f"skip {DUAL_STACK_SKIP!r} (implies --dual-stack)",
    )
    parser.add_argument("--report-dir", type=Path, default=Path("e2e-results"))
    parser.add_argument("--timeout", type=int, default=3 * 3600, help="seconds for the suite")
    parser.add_argument(
        "--procs", type=int, default=4, help="ginkgo processes (tests mostly wait on pods)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    focus, skip = PROXY_FOCUS, PROXY_SKIP
    if args.smoke:
        focus = SMOKE_FOCUS
    elif args.dual_stack_suite:
        focus, skip = DUAL_STACK_FOCUS, DUAL_STACK_SKIP
    focus, skip = args.focus or focus, args.skip or skip
    dual_stack = args.dual_stack or args.dual_stack_suite
    # A SIGTERM (a timeout, a CI runner) unwinds like Ctrl-C, so the cluster is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    reports = []
    try:
        for proxy in args.proxy or PROXIES:
            name = f"kpng-{args.shape}" if proxy == "kpng" and args.shape != "daemonset" else proxy
            if proxy == "kpng" and args.mode == "ebpf":
                name = "kpng-ebpf"
            stack = "dual-stack" if dual_stack else "IPv4"
            log.info("e2e with %s in %s mode: starting a %s cluster", name, args.mode, stack)
            cluster = start_cluster(proxy, mode=args.mode, shape=args.shape, dual_stack=dual_stack)
            try:
                report = run_suite(
                    cluster,
                    proxy=name,
                    focus=focus,
                    skip=skip,
                    report_dir=args.report_dir / name,
                    timeout_s=args.timeout,
                    procs=args.procs,
                )
            finally:
                cluster.stop()
            log.info("%s", report.summary())
            reports.append(report)
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    table = compare(reports)
    (args.report_dir / "summary.md").write_text(table)
    print(table)
    by_proxy = {r.proxy: r for r in reports}
    kpng = next((r for r in reports if r.proxy.startswith("kpng")), None)
    if kpng is not None and "kube-proxy" in by_proxy:
        missing = regressions(kpng, by_proxy["kube-proxy"])
        for name in missing:
            print(f"kube-proxy passes, kpng does not: {name}")
        return 1 if missing else 0
    return 0 if all(r.count("failed") == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
