"""``kpng kube-proxy [kube-proxy's flags]``: kube-proxy's command line, run by kpng.

A kube-proxy DaemonSet becomes a kpng one by changing its image and putting ``kpng`` before its
command: ``kpng kube-proxy --config=/var/lib/kube-proxy/config.conf
--hostname-override=$(NODE_NAME)``. As in kube-proxy, ``--config`` makes the file the only
source of settings but for ``--hostname-override`` and the logging flags; kpng also warns about
the other flags given with it, which kube-proxy ignores silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kpng.backends._node import DETECT_LOCAL_MODES
from kpng.durations import parse_duration
from kpng.errors import EXIT_ERROR, UsageError
from kpng.kubeproxy import conntrack
from kpng.kubeproxy.config import (
    MODES,
    ConntrackConfig,
    ProxyConfig,
    at_least,
    cidrs,
    feature_gates,
    ip_address,
    load,
    masquerade_bit,
    mode_warnings,
)

log = logging.getLogger("kpng.kube-proxy")

ROUTE_LOCALNET = conntrack.PROC_SYS / "net" / "ipv4" / "conf" / "all" / "route_localnet"


_ACTED_ON_WITH_CONFIG = frozenset(
    {"config", "hostname_override", "v", "logging_format", "init_only", "cleanup"}
)
_NOT_ACTED_ON = {
    "kube_api_qps": "kpng makes one list and one watch a resource, unthrottled",
    "kube_api_burst": "kpng makes one list and one watch a resource, unthrottled",
    "kube_api_content_type": "kpng's watches always read JSON",
    "oom_score_adj": "kubelet sets the OOM score of kpng's pod",
    "profiling": "kpng serves no /debug/pprof",
    "config_sync_period": "kpng follows watches and never relists on a timer",
    "show_hidden_metrics_for_version": "kpng hides no metric",
    "bind_address_hard_fail": "kpng always exits when it cannot listen",
    "ipvs": "kpng programs nftables, not IPVS",
}


def _bool(text: str) -> bool:
    # pflag's booleans: --flag, --flag=true, --flag=false.
    lowered = text.lower()
    if lowered in ("true", "1", "t"):
        return True
    if lowered in ("false", "0", "f"):
        return False
    raise argparse.ArgumentTypeError(f"true or false, not {text!r}")


def _gates(text: str) -> dict[str, bool]:
    """pflag's map: GATE=BOOL, comma separated."""
    gates = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{item!r}: expected GATE=true or GATE=false")
        gates[name.strip()] = _bool(value.strip())
    return gates


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kpng kube-proxy",
        description="kube-proxy's flags and configuration file, served by kpng's to-iptables "
        "or to-nft backend as the proxy mode says. Flags kpng does not act on are accepted "
        "with a warning.",
    )
    add = p.add_argument
    flag_bool: dict[str, Any] = {"nargs": "?", "const": True, "type": _bool, "metavar": "BOOL"}
    add("--config", metavar="FILE", help="a KubeProxyConfiguration (v1alpha1) file")
    add("--hostname-override", metavar="NAME", help="this node's name (default: the host name)")
    add("--kubeconfig", metavar="FILE")
    add("--master", metavar="URL", help="not supported by kpng: use a kubeconfig")
    add("--bind-address", metavar="IP", help="this node's primary IP, in place of the Node's")
    add("--healthz-bind-address", metavar="IP:PORT", help="default 0.0.0.0:10256")
    add("--metrics-bind-address", metavar="IP:PORT", help="default 127.0.0.1:10249")
    add("--healthz-port", type=int, metavar="PORT", help="deprecated: --healthz-bind-address")
    add("--metrics-port", type=int, metavar="PORT", help="deprecated: --metrics-bind-address")
    add(
        "--proxy-mode",
        metavar="MODE",
        help="iptables (the default: to-iptables), nftables (to-nft) or ipvs (to-nft)",
    )
    add("--cluster-cidr", metavar="CIDR[,CIDR]")
    add("--detect-local-mode", choices=DETECT_LOCAL_MODES)
    add("--pod-bridge-interface", metavar="NAME")
    add("--pod-interface-name-prefix", metavar="PREFIX")
    add("--masquerade-all", **flag_bool)
    add("--iptables-masquerade-bit", type=int, metavar="BIT")
    add("--nodeport-addresses", metavar="CIDR[,CIDR]|primary")
    add(
        "--iptables-localhost-nodeports",
        **flag_bool,
        help="iptables mode: node ports on 127.0.0.1 too (default true)",
    )
    add("--iptables-sync-period", type=_duration, metavar="DURATION")
    add("--iptables-min-sync-period", type=_duration, metavar="DURATION")
    add("--conntrack-max-per-core", type=int, metavar="N")
    add("--conntrack-min", type=int, metavar="N")
    add("--conntrack-tcp-timeout-established", type=_duration, metavar="DURATION")
    add("--conntrack-tcp-timeout-close-wait", type=_duration, metavar="DURATION")
    add("--conntrack-tcp-be-liberal", **flag_bool)
    add("--conntrack-udp-timeout", type=_duration, metavar="DURATION")
    add("--conntrack-udp-timeout-stream", type=_duration, metavar="DURATION")
    add("--init-only", **flag_bool, help="set the sysctls kube-proxy sets, then exit (privileged)")
    add("--cleanup", **flag_bool, help="remove kpng's rules, then exit")
    add("-v", "--v", type=int, metavar="LEVEL", help="log verbosity (4 and up: debug)")
    add("--logging-format", choices=("text", "json"))
    # Accepted so that kube-proxy's command lines run; each is a warning when given.
    add(
        "--feature-gates",
        type=_gates,
        metavar="GATE=BOOL[,...]",
        help="AllowServiceExternalIPs=false serves no externalIP, "
        "KubeProxyNFTablesLocalhostNodePorts=true serves node ports on loopback in nftables "
        "mode (to-nft --localhost-nodeports); other gates are warned of",
    )
    for name in (
        "--kube-api-qps",
        "--kube-api-burst",
        "--kube-api-content-type",
        "--oom-score-adj",
        "--config-sync-period",
        "--show-hidden-metrics-for-version",
    ):
        add(name, metavar="VALUE", help=argparse.SUPPRESS)
    for name in ("--profiling", "--bind-address-hard-fail"):
        add(name, **{**flag_bool, "help": argparse.SUPPRESS})
    for name in (
        "--ipvs-scheduler",
        "--ipvs-sync-period",
        "--ipvs-min-sync-period",
        "--ipvs-exclude-cidrs",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout",
        "--ipvs-tcpfin-timeout",
        "--ipvs-udp-timeout",
    ):
        add(name, metavar="VALUE", help=argparse.SUPPRESS)
    return p


@dataclasses.dataclass
class Invocation:
    config: ProxyConfig
    warnings: list[str]
    init_only: bool = False
    cleanup: bool = False


def build(argv: Sequence[str], *, read: Callable[[str], str] | None = None) -> Invocation:
    """What ``kpng kube-proxy ARGV`` does (pure but for reading ``--config``)."""
    args = parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    warnings: list[str] = []
    if args.master is not None:
        raise UsageError("--master is not supported by kpng: give a kubeconfig")
    for name in sorted(given):
        reason = _NOT_ACTED_ON.get("ipvs" if name.startswith("ipvs_") else name)
        if reason is not None and not (name == "bind_address_hard_fail" and given[name]):
            warnings.append(f"--{name.replace('_', '-')} is not acted on: {reason}")
    if args.config is not None:
        reader = read or (lambda path: Path(path).read_text())
        try:
            text = reader(args.config)
        except OSError as exc:
            raise UsageError(f"--config {args.config}: {exc.strerror or exc}") from None
        loaded = load(text, source=args.config)
        config, warnings = loaded.config, warnings + loaded.warnings
        ignored = sorted(set(given) - _ACTED_ON_WITH_CONFIG)
        if ignored:
            names = ", ".join(f"--{n.replace('_', '-')}" for n in ignored)
            warnings.append(f"{names}: ignored because --config is given, as kube-proxy does")
        config = _with_logging_and_name(config, args)
    else:
        config = _from_flags(args, warnings)
    return Invocation(
        config.resolve(), warnings, init_only=bool(args.init_only), cleanup=bool(args.cleanup)
    )


def _with_logging_and_name(config: ProxyConfig, args: argparse.Namespace) -> ProxyConfig:
    changes: dict[str, Any] = {}
    if args.hostname_override is not None:
        changes["hostname_override"] = args.hostname_override
    if args.v is not None:
        changes["verbosity"] = args.v
    if args.logging_format is not None:
        changes["log_format"] = args.logging_format
    return dataclasses.replace(config, **changes)


def _from_flags(args: argparse.Namespace, warnings: list[str]) -> ProxyConfig:
    mode = args.proxy_mode or ""
    if mode not in MODES:
        raise UsageError(f"--proxy-mode: one of iptables, nftables or ipvs on Linux, not {mode!r}")
    gates = args.feature_gates or {}
    acted_on = feature_gates(gates, "--feature-gates")
    warnings += mode_warnings(mode, gates, "--proxy-mode", "--proxy-mode")
    if mode == "ipvs":
        warnings.append(
            "--proxy-mode ipvs: kpng programs nftables instead; remove kube-proxy's own rules "
            "once with `kpng cleanup kube-proxy`"
        )
    base, ct = ProxyConfig(), ConntrackConfig()

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    def port_only(port: int | None, host: str) -> str:
        return "" if port is None else f"{host}:{port}"

    conntrack_config = ConntrackConfig(
        max_per_core=pick(args.conntrack_max_per_core, ct.max_per_core),
        min=pick(args.conntrack_min, ct.min),
        tcp_established_timeout_s=pick(
            args.conntrack_tcp_timeout_established, ct.tcp_established_timeout_s
        ),
        tcp_close_wait_timeout_s=pick(
            args.conntrack_tcp_timeout_close_wait, ct.tcp_close_wait_timeout_s
        ),
        tcp_be_liberal=bool(args.conntrack_tcp_be_liberal),
        udp_timeout_s=pick(args.conntrack_udp_timeout, 0.0),
        udp_stream_timeout_s=pick(args.conntrack_udp_timeout_stream, 0.0),
    )
    cluster_cidrs = cidrs((args.cluster_cidr or "").split(","), "--cluster-cidr")
    nodeport = cidrs(
        (args.nodeport_addresses or "").split(","), "--nodeport-addresses", keywords=True
    )
    at_least(0, args.conntrack_max_per_core, "--conntrack-max-per-core")
    at_least(0, args.conntrack_min, "--conntrack-min")
    warnings += acted_on.warnings
    return ProxyConfig(
        kubeconfig=args.kubeconfig or "",
        hostname_override=args.hostname_override or "",
        bind_address=ip_address(args.bind_address or base.bind_address, "--bind-address"),
        healthz_bind_address=args.healthz_bind_address or port_only(args.healthz_port, "0.0.0.0"),
        metrics_bind_address=args.metrics_bind_address or port_only(args.metrics_port, "127.0.0.1"),
        log_format=args.logging_format or base.log_format,
        verbosity=pick(args.v, base.verbosity),
        mode=mode,
        masquerade_all=bool(args.masquerade_all),
        masquerade_bit=masquerade_bit(
            pick(args.iptables_masquerade_bit, base.masquerade_bit), "--iptables-masquerade-bit"
        ),
        sync_period_s=args.iptables_sync_period or base.sync_period_s,
        min_sync_period_s=pick(args.iptables_min_sync_period, base.min_sync_period_s),
        detect_local_mode=args.detect_local_mode or base.detect_local_mode,
        bridge_interface=args.pod_bridge_interface or "",
        interface_name_prefix=args.pod_interface_name_prefix or "",
        cluster_cidrs=cluster_cidrs,
        nodeport_addresses=nodeport,
        localhost_nodeports=args.iptables_localhost_nodeports,
        conntrack=conntrack_config,
        external_ips=acted_on.external_ips,
        nftables_localhost_nodeports=acted_on.nftables_localhost_nodeports,
    )


def prepare_node(invocation: Invocation) -> int | None:
    """Apply kube-proxy's conntrack settings, as kube-proxy does before it proxies. The exit
    status when that is all there is to do (``--init-only``), else None: run the pipeline."""
    config = invocation.config
    wanted = conntrack.settings(config.conntrack, os.cpu_count() or 1)
    if config.localhost_served:
        # kube-proxy's privileged init: the unprivileged proxy (to-iptables) cannot set it.
        wanted.append(conntrack.Setting(ROUTE_LOCALNET, 1))
    problems = conntrack.apply(wanted)
    if invocation.init_only:
        for problem in problems:
            log.error("%s", problem)
        return EXIT_ERROR if problems else 0
    for problem in problems:
        log.warning(
            "%s; kube-proxy's conntrack settings need a privileged `kpng kube-proxy --init-only` "
            "first (e.g. an init container)",
            problem,
        )
    return None
