"""Fuzzing the KubeProxyConfiguration reader (kpng.kubeproxy): whatever ``--config`` holds,
``kpng kube-proxy`` either refuses it with a ``UsageError`` naming the file (or the field), or
turns it into a kpng command line that kpng's own parser accepts.

Bounded: see tests/pure/fuzzing.py (``KPNG_FUZZ_EXAMPLES`` runs a longer campaign).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import yaml
from hypothesis import event, given
from hypothesis import strategies as st

from kpng import cli
from kpng.backends import registry
from kpng.errors import UsageError
from kpng.kubeproxy import command
from kpng.kubeproxy.config import API_VERSION, KIND, kpng_argv
from tests.pure.fuzzing import fuzz_settings, ips, perturbed


def _pick(draw: st.DrawFn, valid: list[Any], odd: st.SearchStrategy[Any]) -> Any:
    """A valid value, or now and then (about one in 30) an odd one: a configuration holds some
    twenty such fields, and a single bad one refuses the whole file, so mostly valid values are
    what lets examples get past the reader to the command line it builds."""
    if draw(st.integers(0, 29)):
        return draw(st.sampled_from(valid))
    return draw(odd)


_odd_durations = st.one_of(
    st.sampled_from(["-1s", "inf", "nan", "1e400", "9999999999999h", "1e-400", "s", ""]),
    st.floats().map(str),
    st.text(max_size=6),
)
_odd_names = st.one_of(st.sampled_from(["-x", "--y", "a b", "a,b", "="]), st.text(max_size=8))
_ADDRESSES = ["0.0.0.0", "10.0.0.1", "::", "fd00::1", ""]
_CIDRS = ["10.244.0.0/16", "fd00:244::/64", " 10.0.0.0/8"]
_NODEPORT = [*_CIDRS, "primary", "all", "localhost"]


@st.composite
def _configuration(draw: st.DrawFn) -> Any:
    """A configuration as kubeadm writes one (every section present), then perturbed."""

    def duration() -> Any:
        return _pick(draw, ["30s", "1m0s", "0s", "0", "1h", "500ms", "1.5s", "2"], _odd_durations)

    def address() -> Any:
        return _pick(draw, _ADDRESSES, ips)

    def cidrs(valid: list[str]) -> Any:
        return [_pick(draw, valid, ips) for _ in range(draw(st.integers(0, 2)))]

    def name() -> Any:
        return _pick(draw, ["node-1", "", "eth", "Node-2 "], _odd_names)

    def number(valid: list[int], low: int, high: int) -> Any:
        return _pick(draw, valid, st.integers(low, high))

    config = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bindAddress": address(),
        "healthzBindAddress": _pick(
            draw, ["", "0.0.0.0:10256", "[::]:0", "10.0.0.1"], st.sampled_from(["host:x", "::1:"])
        ),
        "metricsBindAddress": address(),
        "clusterCIDR": ",".join(cidrs(_CIDRS)),
        "mode": _pick(draw, ["", "iptables", "nftables", "ipvs"], st.just("kernelspace")),
        "hostnameOverride": name(),
        "detectLocalMode": _pick(
            draw, ["", "ClusterCIDR", "NodeCIDR", "BridgeInterface"], st.just("Other")
        ),
        "detectLocal": {"bridgeInterface": name(), "interfaceNamePrefix": name()},
        "nodePortAddresses": cidrs(_NODEPORT),
        "featureGates": {"AllowServiceExternalIPs": draw(st.booleans())},
        "logging": {"format": _pick(draw, ["text", "json", ""], st.just("xml")), "verbosity": 2},
        "clientConnection": {"kubeconfig": name(), "qps": 5, "contentType": ""},
        "iptables": {
            "masqueradeBit": number([14, 0, 31], -2, 40),
            "masqueradeAll": draw(st.booleans()),
            "syncPeriod": duration(),
            "minSyncPeriod": duration(),
        },
        "nftables": {"syncPeriod": duration(), "minSyncPeriod": duration()},
        "ipvs": {"syncPeriod": duration(), "minSyncPeriod": duration()},
        "conntrack": {
            "maxPerCore": number([0, 32768], -1, 2**40),
            "min": number([0, 131072], -1, 2**40),
            "tcpEstablishedTimeout": duration(),
            "tcpCloseWaitTimeout": duration(),
            "udpTimeout": duration(),
            "udpStreamTimeout": duration(),
        },
        "configSyncPeriod": duration(),
        "oomScoreAdj": -999,
    }
    return perturbed(config, draw, odds=200)


def _parse_pipeline(argv: list[str]) -> None:
    """Each part of a kpng command line through its own parser, as ``kpng`` cuts and parses it
    (without creating the source, which would read the kubeconfig). argparse exits on a
    refusal: that is a failure here."""
    head, segments = cli._split(argv)
    _, unknown = cli._main_parser().parse_known_args(head)
    assert not unknown, unknown
    source, sink, *backends = segments
    assert (source.name, sink.name) == ("kube", "to-local")
    parts: list[tuple[list[str], Callable[[argparse.ArgumentParser], None]]] = [
        (source.args, cli.SOURCES[source.name].add_arguments),
        (sink.args, cli.SINKS[sink.name].add_arguments),
    ]
    parts += [(b.args, registry.lookup(b.name.removeprefix("to-")).add_arguments) for b in backends]
    for args, add_arguments in parts:
        cli._parser("kpng", "", add_arguments).parse_args(args)


def _check(text: str) -> None:
    refusal = None
    try:
        invocation = command.build(["--config", "kube-proxy.yaml"], read=lambda _: text)
    except UsageError as exc:
        refusal = str(exc)
    if refusal is not None:
        # Named: the file, or the field whose value kpng cannot use.
        assert refusal.startswith(("kube-proxy.yaml: ", "healthzBindAddress: ", "metricsBind"))
        event("refused")
        return
    event("runs")
    # What kpng kube-proxy would run is a command kpng's parsers take.
    _parse_pipeline(kpng_argv(invocation.config))


@fuzz_settings(300)
@given(_configuration())
def test_a_configuration_is_refused_by_name_or_runs(config: Any) -> None:
    _check(yaml.safe_dump(config))


@fuzz_settings(200)
@given(st.text(max_size=200))
def test_any_text_is_refused_by_name_or_runs(text: str) -> None:
    _check(text)
