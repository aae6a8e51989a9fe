"""kube-proxy's configuration, as kpng reads it (pure): the ``KubeProxyConfiguration`` file of
``--config`` (``kubeproxy.config.k8s.io/v1alpha1``, what kubeadm writes) and kube-proxy's flags,
with kube-proxy's defaults, turned into kpng's own command line.

Every field of the file is known (``v1alpha1``'s Structs). A field kube-proxy would refuse
(unknown, misspelt) is an error naming it, as kube-proxy's strict decoding is. A field kpng does
not act on is a warning naming it, unless it holds its default (kubeadm writes every field, most
of them empty): nothing is ignored silently.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import msgspec
import yaml

from kpng.backends._node import DETECT_LOCAL_MODES
from kpng.durations import format_duration, parse_duration
from kpng.errors import UsageError
from kpng.kubeproxy import v1alpha1

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
MODES = ("", "iptables", "nftables", "ipvs")
"""kube-proxy's proxy modes on Linux; "" is its default there, iptables."""
NODEPORT_KEYWORDS = ("primary", "all", "localhost")
"""What nodePortAddresses holds beside CIDRs (kube-proxy 1.37)."""

_NOT_ACTED_ON: dict[str, str] = {
    "clientConnection.acceptContentTypes": "kpng's watches always read JSON",
    "clientConnection.contentType": "kpng's watches always read JSON",
    "clientConnection.qps": "kpng makes one list and one watch a resource, unthrottled",
    "clientConnection.burst": "kpng makes one list and one watch a resource, unthrottled",
    "logging.flushFrequency": "kpng's logs are not buffered",
    "logging.vmodule": "kpng has levels, not per-file verbosity",
    "logging.options": "kpng's logs are not buffered",
    "enableProfiling": "kpng serves no /debug/pprof",
    "showHiddenMetricsForVersion": "kpng hides no metric",
    "ipvs": "kpng programs nftables, not IPVS",
    "winkernel": "kpng runs on Linux only",
    "windowsRunAsService": "kpng runs on Linux only",
    "oomScoreAdj": "kubelet sets the OOM score of kpng's pod (by its priority class)",
    "configSyncPeriod": "kpng follows watches and never relists on a timer",
    "portRange": "deprecated in kube-proxy, and unused",
}
_DEFAULTS: dict[str, tuple[object, ...]] = {
    # Values that mean "the default" for fields kpng does not act on.
    "clientConnection.contentType": ("application/vnd.kubernetes.protobuf",),
    "clientConnection.qps": (5, 5.0),
    "clientConnection.burst": (10,),
    "logging.flushFrequency": ("5s", 5_000_000_000),
    "configSyncPeriod": ("15m", "15m0s"),
    "oomScoreAdj": (-999,),
}


@dataclass(frozen=True)
class ConntrackConfig:
    """The conntrack sysctls kube-proxy sets (0 / None: leave the kernel's value)."""

    max_per_core: int = 32 * 1024
    min: int = 128 * 1024
    tcp_established_timeout_s: float = 24 * 3600.0
    tcp_close_wait_timeout_s: float = 3600.0
    tcp_be_liberal: bool = False
    udp_timeout_s: float = 0.0
    udp_stream_timeout_s: float = 0.0


@dataclass(frozen=True)
class ProxyConfig:
    """kube-proxy's settings kpng acts on, with kube-proxy's defaults."""

    kubeconfig: str = ""
    hostname_override: str = ""
    bind_address: str = "0.0.0.0"
    healthz_bind_address: str = ""
    """"" until defaulted from ``bind_address`` (``resolve``)."""
    metrics_bind_address: str = ""
    log_format: str = "text"
    verbosity: int = 0
    mode: str = ""
    masquerade_all: bool = False
    masquerade_bit: int = 14
    sync_period_s: float = 30.0
    min_sync_period_s: float = 1.0
    detect_local_mode: str = "ClusterCIDR"
    bridge_interface: str = ""
    interface_name_prefix: str = ""
    cluster_cidrs: tuple[str, ...] = ()
    nodeport_addresses: tuple[str, ...] = ()
    localhost_nodeports: bool | None = None
    """iptables mode's ``localhostNodePorts``; None until defaulted (``resolve``), to true."""
    conntrack: ConntrackConfig = field(default_factory=ConntrackConfig)
    external_ips: bool = True
    """The feature gate AllowServiceExternalIPs (on by default): off, no externalIP is served."""
    nftables_localhost_nodeports: bool = False
    """The alpha feature gate KubeProxyNFTablesLocalhostNodePorts (off by default): nftables
    mode's localhost node ports (to-nft's ``--localhost-nodeports``)."""
    defaults: tuple[str, ...] = ()
    """The mode's defaults ``resolve`` applied, as ``field: value (what it means)``: said at
    start, since they differ between modes."""

    def resolve(self) -> ProxyConfig:
        """Fill in and check what kube-proxy derives: the health and metrics addresses (of
        ``bind_address``'s family, with their ports), the node-port addresses (none: every
        local address in iptables mode, ``primary`` in nftables mode), localhost node ports
        (iptables mode: on)."""
        healthz, metrics = "0.0.0.0", "127.0.0.1"
        if _is_v6(self.bind_address):
            healthz, metrics = "::", "::1"
        iptables = self.backend == "to-iptables"
        nodeports, localhost, defaults = self.nodeport_addresses, self.localhost_nodeports, []
        if not nodeports:
            if iptables:
                defaults.append("nodePortAddresses: [] (every local address)")
            else:
                nodeports = ("primary",)
                defaults.append("nodePortAddresses: [primary] (the node's primary IPs)")
        if localhost is None:
            localhost = True
            if iptables:
                defaults.append("iptables.localhostNodePorts: true (IPv4 node ports on 127.0.0.1)")
        return dataclasses.replace(
            self,
            healthz_bind_address=_with_port(
                self.healthz_bind_address or healthz, HEALTHZ_PORT, "healthzBindAddress"
            ),
            metrics_bind_address=_with_port(
                self.metrics_bind_address or metrics, METRICS_PORT, "metricsBindAddress"
            ),
            nodeport_addresses=nodeports,
            localhost_nodeports=localhost,
            defaults=(*self.defaults, *defaults),
        )

    @property
    def localhost_served(self) -> bool:
        """Whether node ports answer on 127.0.0.1 (resolved): kube-proxy's iptables mode with
        localhostNodePorts, when nodePortAddresses holds IPv4 loopback (none: every address)."""
        if self.backend != "to-iptables" or not self.localhost_nodeports:
            return False
        if not self.nodeport_addresses:
            return True
        loopback = ipaddress.ip_address("127.0.0.1")
        return any(
            a in ("all", "localhost")
            or (a != "primary" and loopback in ipaddress.ip_network(a, strict=False))
            for a in self.nodeport_addresses
        )

    @property
    def backend(self) -> str:
        """kpng's backend for kube-proxy's mode: to-iptables for iptables (kube-proxy's default
        on Linux), to-nft for nftables and for ipvs, which kpng does not program."""
        return "to-iptables" if self.mode in ("", "iptables") else "to-nft"

    def node_name(self) -> str:
        """kube-proxy's: ``hostnameOverride``, else the host name, lowercased."""
        return (self.hostname_override or socket.gethostname()).strip().lower()


def _is_v6(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:
        return False


def _with_port(address: str, port: int, name: str) -> str:
    """kube-proxy's AppendPortIfNeeded: a bare IP gets the default port."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        _, sep, text = address.rpartition(":")
        if not sep or not text.isdigit():
            raise UsageError(f"{name}: {address!r} is not IP:PORT") from None
        return address
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@dataclass
class Loaded:
    config: ProxyConfig
    warnings: list[str]


def load(text: str, *, source: str) -> Loaded:
    """The configuration in ``text`` (the file ``source``); UsageError if kube-proxy would
    refuse it."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{source}: not YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{source}: not a {KIND} (a mapping is expected)")
    if raw.get("kind") != KIND or raw.get("apiVersion") != API_VERSION:
        raise UsageError(
            f"{source}: kind {raw.get('kind')!r}, apiVersion {raw.get('apiVersion')!r}: "
            f"kpng reads {KIND} of {API_VERSION}"
        )
    config = v1alpha1.decode(raw, source=source)
    warnings = _not_acted_on(dict(_leaves(config, "")))
    return Loaded(_from_fields(config, raw, warnings, source), warnings)


def _leaves(struct: msgspec.Struct, prefix: str) -> Iterator[tuple[str, object]]:
    """Each field of ``struct`` by its dotted path in the file, and its value; a section's
    fields in its place."""
    # The class attributes, not msgspec.structs.fields, which resolves annotations each call.
    for name, encoded in zip(
        struct.__struct_fields__, struct.__struct_encode_fields__, strict=True
    ):
        value = getattr(struct, name)
        path = f"{prefix}{encoded}"
        if isinstance(value, msgspec.Struct):
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def _zero(value: object) -> bool:
    if isinstance(value, dict):
        return all(_zero(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return value in (None, "", 0, False, "0", "0s")


def _not_acted_on(flat: Mapping[str, Any]) -> list[str]:
    warnings = []
    for path, value in flat.items():
        reason = _NOT_ACTED_ON.get(path) or _NOT_ACTED_ON.get(path.split(".")[0])
        if reason is None or _zero(value) or value in _DEFAULTS.get(path, ()):
            continue
        warnings.append(f'field "{path}" ({value!r}) is not acted on: {reason}')
    return warnings


LOCALHOST_GATE = "KubeProxyNFTablesLocalhostNodePorts"
"""kube-proxy 1.37's alpha gate (KEP-6032): nftables mode serves TCP node ports on loopback
when nodePortAddresses name it, and refuses the rest there."""
ACTED_ON_GATES = frozenset({"AllowServiceExternalIPs", "KubeProxyIPVS", LOCALHOST_GATE})
"""kube-proxy's feature gates kpng honours. The others change nothing kpng does: kpng implements
the default semantics of kube-proxy 1.37 (alpha gates off, GA and beta ones on)."""


class Gates(NamedTuple):
    """What kube-proxy's feature gates change in what kpng does."""

    external_ips: bool
    nftables_localhost_nodeports: bool
    warnings: list[str]


def feature_gates(gates: Mapping[str, object], source: str) -> Gates:
    """What kube-proxy's feature gates ask of kpng, and warnings of those it does not act on."""
    warnings = []
    for name, value in gates.items():
        if not isinstance(value, bool):
            raise UsageError(f"{source}: feature gate {name}: true or false, not {value!r}")
        if name not in ACTED_ON_GATES:
            warnings.append(
                f"feature gate {name}={str(value).lower()} is not acted on: kpng implements "
                "kube-proxy 1.37's default semantics"
            )
    return Gates(
        external_ips=bool(gates.get("AllowServiceExternalIPs", True)),
        nftables_localhost_nodeports=bool(gates.get(LOCALHOST_GATE, False)),
        warnings=warnings,
    )


def mode_warnings(mode: str, gates: Mapping[str, object], name: str, where: str) -> list[str]:
    """kube-proxy 1.37's checks of its proxy mode (``name``: the field or flag that sets it,
    ``where``: that name as an error states it): warnings, or UsageError where kube-proxy
    refuses to start."""
    if mode == "ipvs" and gates.get("KubeProxyIPVS", True) is False:
        # kube-proxy's validation refuses the mode the gate turns off; serving nftables in its
        # place would hide that the configuration no longer starts kube-proxy itself.
        raise UsageError(
            f'{where} is "ipvs" but feature gate KubeProxyIPVS is false, which turns ipvs mode '
            "off (kube-proxy refuses to start so): choose iptables or nftables, or drop the gate"
        )
    if mode:
        return []
    # KEP-5343: kube-proxy warns of an unset mode because its default moves to nftables in 1.40,
    # when the same configuration changes backend on upgrade. kpng warns alike, so that the
    # choice is made before then.
    return [
        f"{name} is not set: iptables (to-iptables) is kube-proxy 1.37's default, but the "
        "default becomes nftables in kube-proxy 1.40; set iptables to keep it, or nftables to "
        "move now"
    ]


def _from_fields(
    file: v1alpha1.KubeProxyConfiguration,
    raw: Mapping[Any, Any],
    warnings: list[str],
    source: str,
) -> ProxyConfig:
    def duration(path: str, text: str | None, default: float, *, zero_is_default: bool) -> float:
        """kube-proxy's periods take their default when 0; its conntrack timeouts, when unset
        (0 leaves the kernel's value)."""
        if text is None:
            return default
        try:
            seconds = parse_duration(text)
        except ValueError as exc:
            raise UsageError(f'{source}: field "{path}": {exc}') from None
        return seconds or (default if zero_is_default else 0.0)

    def field(path: str) -> str:
        return f'{source}: field "{path}"'

    mode = file.mode or ""
    if mode not in MODES:
        raise UsageError(
            f'{source}: field "mode": one of iptables, nftables or ipvs on Linux, not {mode!r}'
        )
    gates: Mapping[Any, object] = file.feature_gates or {}
    acted_on = feature_gates(gates, source)
    warnings += mode_warnings(mode, gates, 'field "mode"', f'{source}: field "mode"')
    # kube-proxy's own choice of section for the settings every mode has: only that section's
    # are read, and so typed.
    section = {"nftables": "nftables", "ipvs": "ipvs"}.get(mode, "iptables")
    bits = "nftables" if mode == "nftables" else "iptables"
    if mode == "ipvs":
        warnings.append(
            'field "mode" is "ipvs": kpng programs nftables instead (the ipvs.* periods and the '
            "iptables.* masquerade settings apply to it, as in kube-proxy); remove kube-proxy's "
            "own rules once with `kpng cleanup kube-proxy`"
        )
    logging = file.logging or v1alpha1.Logging()
    logging_format = logging.format or "text"
    if logging_format not in ("text", "json"):
        raise UsageError(
            f'{source}: field "logging.format": "text" or "json", not {logging_format!r}'
        )
    detect = file.detect_local_mode or "ClusterCIDR"
    if detect not in DETECT_LOCAL_MODES:
        raise UsageError(
            f'{source}: field "detectLocalMode": one of {", ".join(DETECT_LOCAL_MODES)}, '
            f"not {detect!r}"
        )
    masquerade = v1alpha1.decode_section(raw, bits, v1alpha1.MasqueradeSettings, source=source)
    periods = v1alpha1.decode_section(raw, section, v1alpha1.PeriodSettings, source=source)
    ct, given = ConntrackConfig(), file.conntrack or v1alpha1.Conntrack()

    def timeout(name: str, text: str | None, default: float, *, zero_is_default: bool) -> float:
        return duration(f"conntrack.{name}", text, default, zero_is_default=zero_is_default)

    conntrack = ConntrackConfig(
        max_per_core=_or(given.max_per_core, ct.max_per_core),
        min=_or(given.min, ct.min),
        tcp_established_timeout_s=timeout(
            "tcpEstablishedTimeout",
            given.tcp_established_timeout,
            ct.tcp_established_timeout_s,
            zero_is_default=False,
        ),
        tcp_close_wait_timeout_s=timeout(
            "tcpCloseWaitTimeout",
            given.tcp_close_wait_timeout,
            ct.tcp_close_wait_timeout_s,
            zero_is_default=False,
        ),
        tcp_be_liberal=_or(given.tcp_be_liberal, False),
        udp_timeout_s=timeout("udpTimeout", given.udp_timeout, 0.0, zero_is_default=True),
        udp_stream_timeout_s=timeout(
            "udpStreamTimeout", given.udp_stream_timeout, 0.0, zero_is_default=True
        ),
    )
    nodeport = file.node_port_addresses or []
    warnings += acted_on.warnings
    at_least(0, given.max_per_core, field("conntrack.maxPerCore"))
    at_least(0, given.min, field("conntrack.min"))
    detect_local = file.detect_local or v1alpha1.DetectLocal()
    iptables = file.iptables or v1alpha1.Iptables()
    return ProxyConfig(
        kubeconfig=(file.client_connection or v1alpha1.ClientConnection()).kubeconfig or "",
        hostname_override=file.hostname_override or "",
        bind_address=ip_address(file.bind_address or "0.0.0.0", field("bindAddress")),
        healthz_bind_address=file.healthz_bind_address or "",
        metrics_bind_address=file.metrics_bind_address or "",
        log_format=logging_format,
        verbosity=_or(logging.verbosity, 0),
        mode=mode,
        masquerade_all=_or(masquerade.masquerade_all, False),
        masquerade_bit=masquerade_bit(
            _or(masquerade.masquerade_bit, 14), field(f"{bits}.masqueradeBit")
        ),
        sync_period_s=duration(
            f"{section}.syncPeriod", periods.sync_period, 30.0, zero_is_default=True
        ),
        min_sync_period_s=duration(
            f"{section}.minSyncPeriod", periods.min_sync_period, 1.0, zero_is_default=True
        ),
        detect_local_mode=detect,
        bridge_interface=detect_local.bridge_interface or "",
        interface_name_prefix=detect_local.interface_name_prefix or "",
        cluster_cidrs=cidrs((file.cluster_cidr or "").split(","), field("clusterCIDR")),
        nodeport_addresses=cidrs(
            [str(a) for a in nodeport], field("nodePortAddresses"), keywords=True
        ),
        localhost_nodeports=iptables.localhost_node_ports,
        conntrack=conntrack,
        external_ips=acted_on.external_ips,
        nftables_localhost_nodeports=acted_on.nftables_localhost_nodeports,
    )


_T = TypeVar("_T")


def _or(value: _T | None, default: _T) -> _T:
    """A field's value, or its default when null (kube-proxy's)."""
    return default if value is None else value


# kube-proxy's validation of the values kpng hands on to its backend's flags: what it refuses is
# a UsageError naming the field (``where``), not a command line kpng's own parser then refuses,
# or a crash building it.


def ip_address(value: str, where: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise UsageError(f"{where}: not an IP address: {value!r}") from None
    return value


def cidrs(values: list[str], where: str, *, keywords: bool = False) -> tuple[str, ...]:
    """The CIDRs among ``values``, blanks dropped; with ``keywords``, also ``primary``, ``all``
    and ``localhost`` (nodePortAddresses), each at most once."""
    out: list[str] = []
    for value in (v.strip() for v in values):
        if not value:
            continue
        if keywords and value in NODEPORT_KEYWORDS:
            if value in out:
                raise UsageError(f"{where}: {value!r} is given twice")
            out.append(value)
            continue
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise UsageError(f"{where}: not a CIDR: {value!r}") from None
        out.append(value)
    return tuple(out)


def masquerade_bit(value: int, where: str) -> int:
    if not 0 <= value <= 31:
        raise UsageError(f"{where}: a bit number from 0 to 31, not {value}")
    return value


def at_least(minimum: int, value: object, where: str) -> None:
    if isinstance(value, int) and value < minimum:
        raise UsageError(f"{where}: must be {minimum} or more, not {value}")


def kpng_argv(config: ProxyConfig) -> list[str]:
    """kpng's own command line for ``config`` (resolved): ``kpng kube ... to-local ...
    to-iptables|to-nft ...``, what ``kpng kube-proxy`` runs."""
    healthz_off = config.healthz_bind_address.endswith(":0")
    metrics_off = config.metrics_bind_address.endswith(":0")
    argv = [
        "--log-level",
        "debug" if config.verbosity >= 4 else "info",
        "--log-format",
        config.log_format,
        # kube-proxy: unhealthy once a change has waited two sync periods.
        "--healthz-timeout",
        f"{2 * config.sync_period_s:g}",
    ]
    if not healthz_off:
        argv += ["--healthz-bind-address", config.healthz_bind_address]
    if not metrics_off:
        argv += ["--metrics-bind-address", config.metrics_bind_address]
    argv += ["kube"]
    if config.kubeconfig:
        argv += _flag("--kubeconfig", config.kubeconfig)
    argv += ["to-local", *_flag("--hostname-override", config.node_name())]
    if not config.external_ips:
        argv += ["--no-external-ips"]
    argv += [config.backend, "--detect-local-mode", config.detect_local_mode]
    if config.cluster_cidrs:
        argv += ["--cluster-cidr", ",".join(config.cluster_cidrs)]
    if config.bridge_interface:
        argv += _flag("--pod-bridge-interface", config.bridge_interface)
    if config.interface_name_prefix:
        argv += _flag("--pod-interface-name-prefix", config.interface_name_prefix)
    if config.masquerade_all:
        argv += ["--masquerade-all"]
    argv += ["--masquerade-bit", str(config.masquerade_bit)]
    if config.nodeport_addresses:
        argv += ["--nodeport-addresses", ",".join(config.nodeport_addresses)]
    if config.backend == "to-iptables":
        if config.localhost_served:
            argv += ["--localhost-nodeports"]
        if config.conntrack.tcp_be_liberal:
            # kube-proxy installs no INVALID drop once conntrack is liberal.
            argv += ["--no-drop-invalid"]
    elif config.mode == "nftables" and config.nftables_localhost_nodeports:
        # Whatever nodePortAddresses say, as kube-proxy: without loopback among them, to-nft
        # refuses node ports there rather than serving them. iptables.localhostNodePorts is
        # iptables mode's alone; ipvs mode never had localhost node ports.
        argv += ["--localhost-nodeports"]
    if config.bind_address and not ipaddress.ip_address(config.bind_address).is_unspecified:
        argv += ["--bind-address", config.bind_address]
    argv += ["--min-sync-period", format_duration(config.min_sync_period_s)]
    argv += ["--sync-period", format_duration(config.sync_period_s)]
    return argv


def _flag(name: str, value: str) -> list[str]:
    """A flag with a name or path the user chose: joined to the flag when it starts with "-",
    or argparse would take it for a flag, and the flag for one without its argument."""
    return [f"{name}={value}"] if value.startswith("-") else [name, value]
