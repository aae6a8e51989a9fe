"""``kpng kube-proxy``: kube-proxy's flags and KubeProxyConfiguration turned into kpng's pipeline
(tables), the conntrack sysctls (on files standing in for /proc/sys), and node IPs and durations
as kube-proxy reads them. The command runs on real nodes in tests/nodes/test_real_cluster.py, as
deploy/kpng.yaml runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kpng.durations import format_duration, parse_duration
from kpng.errors import UsageError
from kpng.kubeproxy import conntrack
from kpng.kubeproxy.command import build
from kpng.kubeproxy.config import ConntrackConfig, kpng_argv
from kpng.model.cluster import primary_ips
from kpng.model.messages import NodeAddress

# What `kubeadm init` writes into kube-proxy's ConfigMap (config.conf), nftables mode.
KUBEADM = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: nftables
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""

KUBEADM_ARGV = [
    "--log-level", "info", "--log-format", "text", "--healthz-timeout", "60",
    "--healthz-bind-address", "0.0.0.0:10256", "--metrics-bind-address", "127.0.0.1:10249",
    "kube", "--kubeconfig", "/var/lib/kube-proxy/kubeconfig.conf",
    "to-local", "--hostname-override", "node-1",
    "to-nft", "--detect-local-mode", "ClusterCIDR", "--cluster-cidr", "10.244.0.0/16",
    "--masquerade-bit", "14", "--nodeport-addresses", "primary", "--min-sync-period", "1s",
    "--sync-period", "30s",
]  # fmt: skip


def _build(argv: list[str], config: str | None = None) -> tuple[list[str], list[str]]:
    files = {"config.conf": config} if config is not None else {}
    invocation = build(argv, read=lambda path: files[path])
    return kpng_argv(invocation.config), invocation.warnings


def test_kubeadms_configuration_runs_as_is_without_a_warning() -> None:
    argv, warnings = _build(["--config=config.conf", "--hostname-override=Node-1"], KUBEADM)
    assert argv == KUBEADM_ARGV
    assert warnings == []


def _edited(old: str, new: str) -> str:
    assert old in KUBEADM
    return KUBEADM.replace(old, new, 1)


@pytest.mark.parametrize(
    ("config", "fragment", "value"),
    [
        (_edited("clusterCIDR: 10.244.0.0/16", "clusterCIDR: 10.1.0.0/16,fd00::/48"),
         "--cluster-cidr", "10.1.0.0/16,fd00::/48"),
        (_edited("  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s\nnodePort",
                 "  masqueradeBit: 3\n  minSyncPeriod: 5s\n  syncPeriod: 1m\nnodePort"),
         "--masquerade-bit", "3"),
        (_edited("  minSyncPeriod: 0s\n  syncPeriod: 0s\nnodePort",
                 "  minSyncPeriod: 5s\n  syncPeriod: 1m\nnodePort"),
         "--min-sync-period", "5s"),
        (_edited("  minSyncPeriod: 0s\n  syncPeriod: 0s\nnodePort",
                 "  minSyncPeriod: 5s\n  syncPeriod: 1m\nnodePort"),
         "--healthz-timeout", "120"),
        (_edited("  minSyncPeriod: 0s\n  syncPeriod: 0s\nnodePort",
                 "  minSyncPeriod: 5s\n  syncPeriod: 1m\nnodePort"),
         "--sync-period", "1m0s"),
        (_edited("detectLocalMode: \"\"", "detectLocalMode: InterfaceNamePrefix")
         .replace('interfaceNamePrefix: ""', "interfaceNamePrefix: veth"),
         "--pod-interface-name-prefix", "veth"),
        (_edited("nodePortAddresses: null", "nodePortAddresses: [10.0.0.0/8, primary]"),
         "--nodeport-addresses", "10.0.0.0/8,primary"),
        (_edited("nodePortAddresses: null", "nodePortAddresses: [all, localhost, primary]"),
         "--nodeport-addresses", "all,localhost,primary"),
        (_edited('healthzBindAddress: ""', "healthzBindAddress: 10.0.0.5"),
         "--healthz-bind-address", "10.0.0.5:10256"),
        (_edited("bindAddress: 0.0.0.0", "bindAddress: fd00::5"),
         "--metrics-bind-address", "[::1]:10249"),
        (_edited("bindAddress: 0.0.0.0", "bindAddress: 10.0.0.7"), "--bind-address", "10.0.0.7"),
        (_edited("  verbosity: 0", "  verbosity: 4"), "--log-level", "debug"),
        (_edited("  verbosity: 0", "  verbosity: 2\n  format: json"), "--log-format", "json"),
    ],
    ids=["cluster-cidr", "nftables-bit", "nftables-min-sync", "nftables-sync",
         "nftables-sync-period", "interface-prefix",
         "nodeport-addresses", "nodeport-address-keywords-1.37",
         "healthz-port-appended", "ipv6-bind-address", "bind-address", "verbosity", "json-logs"],
)  # fmt: skip
def test_configuration_fields_become_kpngs_flags(config: str, fragment: str, value: str) -> None:
    argv, _ = _build(["--config=config.conf"], config)
    assert argv[argv.index(fragment) + 1] == value


@pytest.mark.parametrize(
    ("mode", "backend", "warned"),
    [
        ("nftables", "to-nft", ""),
        ("iptables", "to-iptables", ""),
        ('""', "to-iptables", 'field "mode" is not set'),
        ("ipvs", "to-nft", 'field "mode" is "ipvs"'),
    ],
    ids=["nftables", "iptables", "default-is-iptables", "ipvs"],
)
def test_the_mode_picks_the_backend_and_the_section_its_settings_come_from(
    mode: str, backend: str, warned: str
) -> None:
    """kube-proxy's: nftables.* for nftables mode, iptables.* otherwise (ipvs.* periods for
    ipvs); the masquerade settings of iptables.* serve ipvs too. IPVS is not programmed."""
    config = _edited("mode: nftables", f"mode: {mode}").replace(
        "iptables:\n  localhostNodePorts: null\n  masqueradeAll: false\n  masqueradeBit: null\n"
        "  minSyncPeriod: 0s\n  syncPeriod: 0s",
        "iptables:\n  localhostNodePorts: null\n  masqueradeAll: true\n  masqueradeBit: null\n"
        "  minSyncPeriod: 3s\n  syncPeriod: 45s",
    )
    argv, warnings = _build(["--config=config.conf"], config)
    assert argv[argv.index("to-local") + 3] == backend
    from_iptables_section = mode != "nftables"
    assert ("--masquerade-all" in argv) is from_iptables_section
    min_sync = argv[argv.index("--min-sync-period") + 1]
    assert min_sync == ("3s" if backend == "to-iptables" else "1s")
    # kube-proxy's sync period: how often the rules are checked and repaired, from the
    # section of the mode (the nftables section's is 30s here).
    sync = argv[argv.index("--sync-period") + 1]
    assert sync == ("45s" if backend == "to-iptables" else "30s")
    assert [w.split(":")[0] for w in warnings] == ([warned] if warned else [])
    if mode == "ipvs":
        assert "kpng cleanup kube-proxy" in warnings[0]


def test_a_change_from_kube_proxys_iptables_mode_needs_no_cleanup_and_is_not_warned_of() -> None:
    """to-iptables takes over kube-proxy's chains in its first full sync, as a restarted
    kube-proxy does."""
    _, warnings = _build(["--proxy-mode=iptables", "--kubeconfig=/k"])
    assert warnings == []
    _, warnings = _build(["--proxy-mode=ipvs", "--kubeconfig=/k"])
    assert warnings == [
        "--proxy-mode ipvs: kpng programs nftables instead; remove kube-proxy's own rules once "
        "with `kpng cleanup kube-proxy`"
    ]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (_edited("enableProfiling: false", "enableProfiling: true"), "enableProfiling"),
        (_edited("  qps: 0", "  qps: 50"), "clientConnection.qps"),
        (_edited('  scheduler: ""', "  scheduler: rr"), "ipvs.scheduler"),
        (_edited("oomScoreAdj: null", "oomScoreAdj: -500"), "oomScoreAdj"),
        (_edited("configSyncPeriod: 0s", "configSyncPeriod: 1m"), "configSyncPeriod"),
    ],
)
def test_a_field_kpng_does_not_act_on_is_a_warning_naming_it(config: str, field: str) -> None:
    _, warnings = _build(["--config=config.conf"], config)
    assert len(warnings) == 1, warnings
    assert f'field "{field}"' in warnings[0]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (KUBEADM + "masqueradeAll: true\n", 'unknown field "masqueradeAll"'),
        (_edited("  min: null", "  minimum: 5"), 'unknown field "conntrack.minimum"'),
        (_edited("mode: nftables", "mode: kernelspace"), 'field "mode"'),
        (_edited("detectLocalMode: \"\"", "detectLocalMode: Everything"),
         'field "detectLocalMode"'),
        (_edited("  syncPeriod: 0s\nnodePort", "  syncPeriod: soon\nnodePort"),
         'field "nftables.syncPeriod"'),
        (_edited("  tcpBeLiberal: false", "  tcpBeLiberal: 3"),
         'field "conntrack.tcpBeLiberal" must be a bool'),
        (_edited("kind: KubeProxyConfiguration", "kind: KubeletConfiguration"),
         "kind 'KubeletConfiguration'"),
        ("clusterCIDR: [\n", "not YAML"),
        # Found by tests/pure/test_fuzz_kubeproxy_config.py: a bindAddress that is no IP crashed
        # kpng_argv (ValueError); the others made a command line kpng's backend parser refused.
        (_edited("bindAddress: 0.0.0.0", "bindAddress: node-1"), 'field "bindAddress": not an IP'),
        (_edited("clusterCIDR: 10.244.0.0/16", "clusterCIDR: 10.244.0.0/16,pods"),
         "field \"clusterCIDR\": not a CIDR: 'pods'"),
        (_edited("nodePortAddresses: null", "nodePortAddresses: [null]"),
         "field \"nodePortAddresses\": not a CIDR: 'None'"),
        (_edited("nodePortAddresses: null", "nodePortAddresses: [primary, primary]"),
         "field \"nodePortAddresses\": 'primary' is given twice"),
        (_edited("nftables:\n  masqueradeAll: false\n  masqueradeBit: null",
                 "nftables:\n  masqueradeAll: false\n  masqueradeBit: 32"),
         'field "nftables.masqueradeBit": a bit number from 0 to 31, not 32'),
        (_edited("  min: null", "  min: -1"), 'field "conntrack.min": must be 0 or more'),
    ],
)  # fmt: skip
def test_what_kube_proxy_refuses_is_an_error_naming_the_field(config: str, message: str) -> None:
    with pytest.raises(UsageError, match=r"^config\.conf: ") as raised:
        _build(["--config=config.conf"], config)
    assert message in str(raised.value)


_HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


@pytest.mark.parametrize(
    ("fragment", "message"),
    [
        # A misspelt field, in each section: named by its path in the file.
        ("clusterCidr: 10.0.0.0/8", 'unknown field "clusterCidr"'),
        ("iptables: {localhostNodeports: true}", 'unknown field "iptables.localhostNodeports"'),
        ("nftables: {localhostNodePorts: true}", 'unknown field "nftables.localhostNodePorts"'),
        ("ipvs: {strictArp: true}", 'unknown field "ipvs.strictArp"'),
        ("winkernel: {enableDsr: true}", 'unknown field "winkernel.enableDsr"'),
        ("logging: {verbose: 2}", 'unknown field "logging.verbose"'),
        ("clientConnection: {kubeConfig: /k}", 'unknown field "clientConnection.kubeConfig"'),
        ("detectLocal: {bridge: br0}", 'unknown field "detectLocal.bridge"'),
        ("conntrack: {1: 2}", 'unknown field "conntrack.1"'),
        # A value of the wrong type, named with the value.
        ("conntrack: {maxPerCore: '5'}", "field \"conntrack.maxPerCore\" must be a int, not '5'"),
        ("conntrack: {tcpBeLiberal: 'yes'}",
         "field \"conntrack.tcpBeLiberal\" must be a bool, not 'yes'"),
        ("logging: {verbosity: true}", 'field "logging.verbosity" must be a int, not True'),
        ("hostnameOverride: 2001-01-01",
         'field "hostnameOverride" must be a str, not datetime.date(2001, 1, 1)'),
        ("nodePortAddresses: primary", "field \"nodePortAddresses\" must be a list, not 'primary'"),
        ("featureGates: [A]", "field \"featureGates\" must be a dict, not ['A']"),
        ("featureGates: {A: 'yes'}", "feature gate A: true or false, not 'yes'"),
        ("iptables: 5", 'field "iptables" must be a mapping'),
        ("detectLocal: [a]", 'field "detectLocal" must be a mapping'),
        # The section the mode reads its periods and masquerade settings from.
        ("mode: nftables\nnftables: {syncPeriod: 30}",
         'field "nftables.syncPeriod" must be a str, not 30'),
        ("mode: ipvs\niptables: {masqueradeBit: x}",
         "field \"iptables.masqueradeBit\" must be a int, not 'x'"),
    ],
)  # fmt: skip
def test_a_misspelt_field_or_a_value_of_the_wrong_type_is_refused_naming_it(
    fragment: str, message: str
) -> None:
    with pytest.raises(UsageError) as raised:
        _build(["--config=config.conf"], _HEAD + fragment + "\n")
    assert str(raised.value).startswith(f"config.conf: {message}")


@pytest.mark.parametrize(
    "fragment",
    [
        # Every field null, or every section: kube-proxy's defaults.
        "\n".join(f"{line.split(':')[0]}: null" for line in KUBEADM.splitlines()
                  if line[0] != " " and not line.startswith(("apiVersion", "kind"))),
        "conntrack: {maxPerCore: null, min: null, tcpBeLiberal: null}",
        # What kpng does not read holds any value, as before these fields were typed (kpng
        # warns of what it does not act on, and reads the periods of the mode's section only).
        "mode: iptables\nnftables: {syncPeriod: 30, masqueradeBit: x, masqueradeAll: 2}",
        "mode: nftables\niptables: {syncPeriod: 30, masqueradeBit: x}\nipvs: {syncPeriod: 4}",
        "ipvs: {scheduler: [rr], excludeCIDRs: 10.0.0.0/8, strictARP: 1}",
        "clientConnection: {qps: '5', burst: [1]}\nwinkernel: {enableDSR: 3}",
        "logging: {vmodule: {a: 1}, options: 3, flushFrequency: 1s}",
        "featureGates: {1: true, SomeGate: false}",
        "oomScoreAdj: x\nportRange: 1\nbindAddressHardFail: 3\nwindowsRunAsService: []",
        # A big number where kube-proxy has an int32 (kpng's sysctl writer reports it).
        "conntrack: {maxPerCore: 100000000000000000000}",
        "nodePortAddresses: [' 10.0.0.0/8', primary]",
    ],
    ids=["all-null", "conntrack-null", "nftables-unread", "iptables-unread", "ipvs",
         "not-acted-on", "logging", "gates", "others", "big-int", "nodeports"],
)  # fmt: skip
def test_what_kpng_accepted_before_its_fields_were_typed_is_still_accepted(fragment: str) -> None:
    invocation = build(["--config=c"], read=lambda path: _HEAD + fragment + "\n")
    assert kpng_argv(invocation.config)


def test_names_that_start_with_a_dash_are_values_of_their_flags() -> None:
    """Found by tests/pure/test_fuzz_kubeproxy_config.py: interfaceNamePrefix "-x" made
    ``--pod-interface-name-prefix -x``, which kpng's parser refused (expected one argument)."""
    config = _edited('hostnameOverride: ""', "hostnameOverride: -node")
    config = config.replace('interfaceNamePrefix: ""', "interfaceNamePrefix: -veth")
    config = config.replace('bridgeInterface: ""', "bridgeInterface: --br")
    argv, _ = _build(["--config=config.conf"], config)
    for flag in ("--hostname-override=-node", "--pod-interface-name-prefix=-veth",
                 "--pod-bridge-interface=--br"):  # fmt: skip
        assert flag in argv


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bind-address=node-1"], "--bind-address: not an IP address: 'node-1'"),
        (["--cluster-cidr=pods"], "--cluster-cidr: not a CIDR: 'pods'"),
        (["--nodeport-addresses=primary,nodes"], "--nodeport-addresses: not a CIDR: 'nodes'"),
        (["--iptables-masquerade-bit=40"], "--iptables-masquerade-bit: a bit number from 0"),
        (["--conntrack-max-per-core=-1"], "--conntrack-max-per-core: must be 0 or more"),
    ],
)
def test_flags_kube_proxy_refuses_are_errors_naming_the_flag(args: list[str], message: str) -> None:
    with pytest.raises(UsageError) as raised:
        _build(args)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    "args",
    [
        ["--feature-gates=AllowServiceExternalIPs=false,SomeGate=true", "--proxy-mode=nftables"],
        ["--config=config.conf"],
    ],
    ids=["flag", "config-file"],
)
def test_allow_service_external_ips_false_serves_no_external_ip(args: list[str]) -> None:
    """kube-proxy 1.36+'s kill switch for externalIPs (CVE-2020-8554): to-local leaves them out.
    Other gates are only warned of."""
    config = KUBEADM + "featureGates:\n  AllowServiceExternalIPs: false\n  SomeGate: true\n"
    argv, warnings = _build(args, config)
    backend = argv.index("--detect-local-mode") - 1
    assert argv[argv.index("to-local") : backend][-1] == "--no-external-ips"
    assert [w.split(" is ")[0] for w in warnings] == ["feature gate SomeGate=true"]
    default, _ = _build(["--config=config.conf"], config.replace("AllowServiceExternalIPs", "X"))
    assert "--no-external-ips" not in default


UNSET_MODE_FLAG = (
    "--proxy-mode is not set: iptables (to-iptables) is kube-proxy 1.37's default, but the "
    "default becomes nftables in kube-proxy 1.40; set iptables to keep it, or nftables to move now"
)


@pytest.mark.parametrize(
    ("args", "config", "warned"),
    [
        ([], None, UNSET_MODE_FLAG),
        (["--proxy-mode="], None, UNSET_MODE_FLAG),
        (["--proxy-mode=iptables"], None, None),
        (["--proxy-mode=nftables"], None, None),
        (["--config=config.conf"], _edited("mode: nftables", 'mode: ""'), 'field "mode"'),
        (["--config=config.conf"], _edited("mode: nftables\n", ""), 'field "mode"'),
        (["--config=config.conf"], _edited("mode: nftables", "mode: iptables"), None),
        # kube-proxy ignores --proxy-mode beside --config: the file's mode is what counts.
        (["--config=config.conf", "--proxy-mode=iptables"],
         _edited("mode: nftables\n", ""), 'field "mode"'),
    ],
    ids=["no-flag", "empty-flag", "iptables-flag", "nftables-flag", "empty-field",
         "no-field", "iptables-field", "flag-beside-config"],
)  # fmt: skip
def test_an_unset_mode_is_warned_of_as_its_default_changes_in_1_40(
    args: list[str], config: str | None, warned: str | None
) -> None:
    """KEP-5343: kube-proxy 1.37 warns when it defaults the mode to iptables, as 1.40 defaults
    to nftables; the backend stays to-iptables until the user chooses."""
    argv, warnings = _build(["--kubeconfig=/k", *args], config)
    mode_warnings = [w for w in warnings if "kube-proxy 1.40" in w]
    if warned is None:
        assert mode_warnings == []
        return
    assert argv[argv.index("to-local") + 3] == "to-iptables"
    (warning,) = mode_warnings
    assert warning.startswith(warned)
    assert "is not set" in warning
    assert "becomes nftables" in warning


@pytest.mark.parametrize(
    ("args", "config", "message"),
    [
        (["--proxy-mode=ipvs", "--feature-gates=KubeProxyIPVS=false"], None,
         '--proxy-mode is "ipvs" but feature gate KubeProxyIPVS is false'),
        (["--config=config.conf"],
         _edited("mode: nftables", "mode: ipvs") + "featureGates:\n  KubeProxyIPVS: false\n",
         'config.conf: field "mode" is "ipvs" but feature gate KubeProxyIPVS is false'),
    ],
    ids=["flags", "config-file"],
)  # fmt: skip
def test_ipvs_mode_with_the_kube_proxy_ipvs_gate_off_is_refused(
    args: list[str], config: str | None, message: str
) -> None:
    """kube-proxy 1.37 refuses ipvs mode when its KubeProxyIPVS gate is off (KEP-5495)."""
    with pytest.raises(UsageError) as raised:
        _build(args, config)
    assert str(raised.value).startswith(message)
    assert "iptables or nftables" in str(raised.value)


@pytest.mark.parametrize(
    ("args", "config"),
    [
        (["--proxy-mode=ipvs", "--feature-gates=KubeProxyIPVS=true"], None),
        (["--proxy-mode=nftables", "--feature-gates=KubeProxyIPVS=false"], None),
        (["--config=config.conf"],
         _edited("mode: nftables", "mode: ipvs") + "featureGates:\n  KubeProxyIPVS: true\n"),
        (["--config=config.conf"], KUBEADM + "featureGates:\n  KubeProxyIPVS: false\n"),
    ],
    ids=["ipvs-gate-on-flags", "nftables-gate-off-flags", "ipvs-gate-on-config",
         "nftables-gate-off-config"],
)  # fmt: skip
def test_the_kube_proxy_ipvs_gate_otherwise_changes_nothing(
    args: list[str], config: str | None
) -> None:
    """Gate on (its 1.37 default): ipvs runs on to-nft with today's warning; gate off, the other
    modes run as before. Either way the gate is acted on, so it is no warning of its own."""
    argv, warnings = _build(args, config)
    assert argv[argv.index("to-local") + 3] == "to-nft"
    ipvs = "--proxy-mode=ipvs" in args or "mode: ipvs" in (config or "")
    assert [w.split(":")[0] for w in warnings] == (
        ["--proxy-mode ipvs" if config is None else 'field "mode" is "ipvs"'] if ipvs else []
    )


def test_flags_alone_take_kube_proxys_defaults() -> None:
    argv, warnings = _build(
        ["--kubeconfig=/k", "--hostname-override=N", "--cluster-cidr=10.0.0.0/8",
         "--masquerade-all", "--iptables-min-sync-period=2s", "--detect-local-mode=NodeCIDR",
         "--feature-gates=A=true", "--healthz-port=10300"]
    )  # fmt: skip
    assert argv == [
        "--log-level", "info", "--log-format", "text", "--healthz-timeout", "60",
        "--healthz-bind-address", "0.0.0.0:10300", "--metrics-bind-address", "127.0.0.1:10249",
        "kube", "--kubeconfig", "/k", "to-local", "--hostname-override", "n",
        "to-iptables", "--detect-local-mode", "NodeCIDR", "--cluster-cidr", "10.0.0.0/8",
        "--masquerade-all", "--masquerade-bit", "14", "--localhost-nodeports",
        "--min-sync-period", "2s", "--sync-period", "30s",
    ]  # fmt: skip
    assert warnings == [UNSET_MODE_FLAG,
                        "feature gate A=true is not acted on: kpng implements kube-proxy 1.37's "
                        "default semantics"]  # fmt: skip


def test_flags_beside_config_are_ignored_as_kube_proxy_does_but_said() -> None:
    argv, warnings = _build(
        ["--config=config.conf", "--hostname-override=n2", "--masquerade-all", "--init-only"],
        KUBEADM,
    )
    assert "--masquerade-all" not in argv
    assert argv[argv.index("--hostname-override") + 1] == "n2"
    assert warnings == ["--masquerade-all: ignored because --config is given, as kube-proxy does"]


@pytest.mark.slow
def test_init_only_and_an_unreadable_config_through_the_cli(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    done = subprocess.run(
        [*kpng_command, "kube-proxy", f"--config={tmp_path}/missing.conf"],
        capture_output=True, text=True, env=subprocess_env, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.conf: No such file or directory" in done.stderr
    done = subprocess.run(
        [*kpng_command, "kube-proxy", "--master=https://x"],
        capture_output=True, text=True, env=subprocess_env, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--master is not supported" in done.stderr


def test_conntrack_settings_follow_kube_proxy() -> None:
    root = Path("/proc/sys")
    nf = root / "net" / "netfilter"
    got = {(s.path, s.value) for s in conntrack.settings(ConntrackConfig(), cpus=8, root=root)}
    assert got == {
        (nf / "nf_conntrack_max", 262144),  # 32768 a CPU
        (nf / "nf_conntrack_tcp_timeout_established", 86400),
        (nf / "nf_conntrack_tcp_timeout_close_wait", 3600),
    }
    small = ConntrackConfig(max_per_core=0, tcp_established_timeout_s=0, tcp_be_liberal=True,
                      udp_timeout_s=30, udp_stream_timeout_s=120)  # fmt: skip
    named = {(s.path.name, s.value) for s in conntrack.settings(small, cpus=1, root=root)}
    assert named == {
        ("nf_conntrack_tcp_timeout_close_wait", 3600),
        ("nf_conntrack_tcp_be_liberal", 1),
        ("nf_conntrack_udp_timeout", 30),
        ("nf_conntrack_udp_timeout_stream", 120),
    }
    # The floor: 2 CPUs x 32768 is under conntrack-min.
    assert conntrack.settings(ConntrackConfig(), cpus=2, root=root)[0].value == 131072


def test_conntrack_apply_writes_only_what_differs_and_reports_what_it_cannot(
    tmp_path: Path,
) -> None:
    nf = tmp_path / "net" / "netfilter"
    nf.mkdir(parents=True)
    (nf / "nf_conntrack_max").write_text("65536\n")
    (nf / "nf_conntrack_tcp_timeout_established").write_text("86400\n")
    hashsize = tmp_path / "hashsize"
    hashsize.write_text("16384\n")
    wanted = conntrack.settings(ConntrackConfig(), cpus=4, root=tmp_path)
    established = nf / "nf_conntrack_tcp_timeout_established"
    before = established.stat().st_mtime_ns
    # close_wait is missing: conntrack not loaded, a warning and no problem.
    assert conntrack.apply(wanted, hashsize=hashsize) == []
    assert (nf / "nf_conntrack_max").read_text() == "131072\n"
    assert hashsize.read_text() == "32768\n"
    assert established.stat().st_mtime_ns == before  # equal: not written
    (nf / "nf_conntrack_max").write_text("1\n")
    problems = conntrack.apply(wanted, hashsize=tmp_path / "absent")
    assert problems == [f"cannot set {tmp_path}/absent to 32768: [Errno 2] No such file or "
                        f"directory: '{tmp_path}/absent'"]  # fmt: skip
    established.write_text("a day\n")
    problems = conntrack.apply(wanted, hashsize=hashsize)
    assert len(problems) == 1
    assert problems[0].startswith(f"cannot read {established}")


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        ([], ()),
        ([("ExternalIP", "1.2.3.4"), ("InternalIP", "10.0.0.1")], ("10.0.0.1",)),
        ([("InternalIP", "fd00::1"), ("InternalIP", "10.0.0.1")], ("fd00::1", "10.0.0.1")),
        ([("InternalIP", "10.0.0.1"), ("InternalIP", "10.0.0.2"), ("ExternalIP", "2001:db8::1")],
         ("10.0.0.1", "2001:db8::1")),
    ],
)  # fmt: skip
def test_node_ips_are_kube_proxys_primary_ips(
    addresses: list[tuple[str, str]], expected: tuple[str, ...]
) -> None:
    assert primary_ips([NodeAddress(Type=t, Address=a) for t, a in addresses]) == expected


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1h0m0s", 3600.0), ("500ms", 0.5), ("1.5s", 1.5), ("0", 0.0), ("2", 2.0), ("1m30s", 90.0)],
)
def test_durations_read_as_go_writes_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


# "inf", "nan" and "1e400" were found by tests/pure/test_fuzz_kubeproxy_config.py: float() reads
# them, and a sync period of inf crashed kpng_argv (OverflowError formatting it) and the conntrack
# settings (int(inf)).
@pytest.mark.parametrize("text", ["", "-1s", "1x", "1s2", "soon", "inf", "nan", "-nan", "1e400"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_a_configuration_with_an_infinite_period_is_refused_naming_the_field() -> None:
    with pytest.raises(UsageError, match=r'config\.conf: field "nftables\.syncPeriod"'):
        _build(
            ["--config=config.conf"],
            _edited("  syncPeriod: 0s\nnodePort", "  syncPeriod: inf\nnodePort"),
        )


def test_durations_are_written_as_go_writes_them() -> None:
    assert [format_duration(s) for s in (86400, 3600, 90, 1, 0.5)] == [
        "24h0m0s", "1h0m0s", "1m30s", "1s", "0.5s",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("seconds", "text"), [(3.2868e-192, "0s"), (1.5e-9, "0.000000002s"), (2.5e-5, "0.000025s")]
)
def test_tiny_durations_are_written_to_the_nanosecond_and_read_back(
    seconds: float, text: str
) -> None:
    """Found by tests/pure/test_fuzz_kubeproxy_config.py: a minSyncPeriod of 3.2868e-192 was written
    "3.2868e-192s" on kpng's command line, which its parser refused (not a duration)."""
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(round(seconds * 1e9) / 1e9)


@pytest.mark.parametrize(
    ("mode", "given", "nodeports", "localhost", "defaults"),
    [
        # kube-proxy's iptables mode: every local address, and 127.0.0.1 too.
        ("iptables", "", None, True, ["nodePortAddresses", "iptables.localhostNodePorts"]),
        ('""', "", None, True, ["nodePortAddresses", "iptables.localhostNodePorts"]),
        (
            "iptables",
            "nodePortAddresses: [10.0.0.0/8]\n",
            "10.0.0.0/8",
            False,  # on, but loopback is not among them
            ["iptables.localhostNodePorts"],
        ),
        ("iptables", "iptables: {localhostNodePorts: false}\n", None, False, ["nodePortAddresses"]),
        # nftables mode: the primary IPs, never loopback.
        ("nftables", "", "primary", False, ["nodePortAddresses"]),
    ],
    ids=["iptables", "default-mode", "cidrs-given", "localhost-off", "nftables"],
)
def test_each_mode_takes_kube_proxys_node_port_defaults_of_that_mode_and_says_which(
    mode: str, given: str, nodeports: str | None, localhost: bool, defaults: list[str]
) -> None:
    text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
    text += f"mode: {mode}\n{given}"
    invocation = build(["--config=c"], read=lambda path: text)
    argv = kpng_argv(invocation.config)
    if nodeports is None:
        assert "--nodeport-addresses" not in argv  # to-iptables' default: every local address
    else:
        assert argv[argv.index("--nodeport-addresses") + 1] == nodeports
    assert ("--localhost-nodeports" in argv) is localhost
    assert invocation.config.localhost_served is localhost
    assert [d.split(":")[0] for d in invocation.config.defaults] == defaults
    # The one warning: a mode left empty, whose default changes in 1.40.
    unset = [w for w in invocation.warnings if "becomes nftables in kube-proxy 1.40" in w]
    assert len(unset) == (mode == '""')
    assert invocation.warnings == unset


@pytest.mark.parametrize(
    ("nodeports", "served"),
    [("primary", False), ("localhost", True), ("all", True), ("127.0.0.1/32,primary", True)],
)
def test_localhost_node_ports_need_loopback_among_the_node_port_addresses(
    nodeports: str, served: bool
) -> None:
    """kube-proxy sets route_localnet (kpng: at --init-only too) only then."""
    mode = "--proxy-mode=iptables"
    config = build([mode, f"--nodeport-addresses={nodeports}"]).config
    assert config.localhost_served is served
    off = build([mode, f"--nodeport-addresses={nodeports}", "--iptables-localhost-nodeports=false"])
    assert not off.config.localhost_served
    assert "--localhost-nodeports" not in kpng_argv(off.config)
    assert off.warnings == []


def test_a_liberal_conntrack_drops_no_invalid_packet_in_iptables_mode() -> None:
    """kube-proxy installs its INVALID drop unless nf_conntrack_tcp_be_liberal is set, which
    conntrack.tcpBeLiberal does; its nftables mode has no such drop to turn off."""
    for mode, turned_off in (("iptables", True), ("nftables", False)):
        liberal = kpng_argv(build([f"--proxy-mode={mode}", "--conntrack-tcp-be-liberal"]).config)
        assert ("--no-drop-invalid" in liberal) is turned_off
        assert "--no-drop-invalid" not in kpng_argv(build([f"--proxy-mode={mode}"]).config)


@pytest.mark.parametrize(
    ("argv", "config", "passed"),
    [
        (["--proxy-mode=nftables", "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true"],
         None, True),
        # Loopback not among the node port addresses: kube-proxy still refuses node ports on
        # loopback (TCP included), which to-nft does under the same flag.
        (["--proxy-mode=nftables", "--nodeport-addresses=primary",
          "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true"], None, True),
        (["--config=c"],
         KUBEADM + "featureGates:\n  KubeProxyNFTablesLocalhostNodePorts: true\n", True),
        # The gate is alpha: off by default, and iptables.localhostNodePorts is iptables mode's.
        (["--proxy-mode=nftables", "--nodeport-addresses=localhost"], None, False),
        (["--config=c"], KUBEADM.replace("localhostNodePorts: null", "localhostNodePorts: true"),
         False),
        # ipvs mode (to-nft in kpng) never had localhost node ports.
        (["--proxy-mode=ipvs", "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true"],
         None, False),
    ],
    ids=["gate", "gate-primary", "gate-in-config", "no-gate", "iptables-field", "ipvs"],
)  # fmt: skip
def test_nftables_mode_serves_localhost_node_ports_with_kube_proxys_gate(
    argv: list[str], config: str | None, passed: bool
) -> None:
    invocation = build(argv, read=lambda path: config or "")
    kpng = kpng_argv(invocation.config)
    assert kpng[kpng.index("--detect-local-mode") - 1] == "to-nft"
    assert ("--localhost-nodeports" in kpng) is passed
    # Acted on, so not warned of; nor is route_localnet set for it.
    assert not [w for w in invocation.warnings if "KubeProxyNFTablesLocalhostNodePorts" in w]
    assert not invocation.config.localhost_served
