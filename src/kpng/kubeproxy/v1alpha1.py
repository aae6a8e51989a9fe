"""kube-proxy's ``KubeProxyConfiguration`` (``kubeproxy.config.k8s.io/v1alpha1``, kube-proxy 1.37)
as typed msgspec Structs, field for field, that refuse unknown fields as kube-proxy's strict
decoding does; and the one place where msgspec's refusals (read by ``kpng.errors.field_problem``)
become the messages ``kpng kube-proxy`` has always given.

Every field kube-proxy has is here, so a misspelt one is refused wherever it is. A field is typed
where kpng reads it whatever the mode (``mode``, ``conntrack.*``, ``iptables.localhostNodePorts``,
...). The others hold any value (``Any``), as they did before these Structs: what kpng does not act
on is only warned of, and the masquerade and period fields of ``iptables``, ``nftables`` and
``ipvs`` are read from the section the mode picks, where ``MasqueradeSettings`` and
``PeriodSettings`` type them (``decode_section``). Every field may be null, which means its
default, as in kube-proxy (kubeadm writes ``null`` for most of them).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from kpng.errors import UsageError, field_problem


class _Section(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """Fields by kube-proxy's names (camelCase), none but those."""


class ClientConnection(_Section):
    kubeconfig: str | None = None
    accept_content_types: Any = None
    content_type: Any = None
    qps: Any = None
    burst: Any = None


class Logging(_Section):
    format: str | None = None
    flush_frequency: Any = None
    verbosity: int | None = None
    vmodule: Any = None
    options: Any = None


class Iptables(_Section):
    masquerade_bit: Any = None
    masquerade_all: Any = None
    localhost_node_ports: bool | None = None
    sync_period: Any = None
    min_sync_period: Any = None


class Ipvs(_Section):
    sync_period: Any = None
    min_sync_period: Any = None
    scheduler: Any = None
    exclude_cidrs: Any = msgspec.field(default=None, name="excludeCIDRs")
    strict_arp: Any = msgspec.field(default=None, name="strictARP")
    tcp_timeout: Any = None
    tcp_fin_timeout: Any = None
    udp_timeout: Any = None


class Nftables(_Section):
    masquerade_bit: Any = None
    masquerade_all: Any = None
    sync_period: Any = None
    min_sync_period: Any = None


class Winkernel(_Section):
    network_name: Any = None
    source_vip: Any = None
    enable_dsr: Any = msgspec.field(default=None, name="enableDSR")
    root_hns_endpoint_name: Any = None
    forward_health_check_vip: Any = None


class DetectLocal(_Section):
    bridge_interface: str | None = None
    interface_name_prefix: str | None = None


class Conntrack(_Section):
    max_per_core: int | None = None
    min: int | None = None
    tcp_established_timeout: str | None = None
    tcp_close_wait_timeout: str | None = None
    tcp_be_liberal: bool | None = None
    udp_timeout: str | None = None
    udp_stream_timeout: str | None = None


class KubeProxyConfiguration(_Section):
    """The file, as read. ``feature_gates`` keeps any key and value: ``config.feature_gates``
    checks each value, naming the gate (msgspec's error path would not name it)."""

    api_version: str | None = None
    kind: str | None = None
    feature_gates: dict[Any, object] | None = None
    client_connection: ClientConnection | None = None
    logging: Logging | None = None
    hostname_override: str | None = None
    bind_address: str | None = None
    healthz_bind_address: str | None = None
    metrics_bind_address: str | None = None
    bind_address_hard_fail: Any = None
    enable_profiling: Any = None
    show_hidden_metrics_for_version: Any = None
    mode: str | None = None
    iptables: Iptables | None = None
    ipvs: Ipvs | None = None
    nftables: Nftables | None = None
    winkernel: Winkernel | None = None
    detect_local_mode: str | None = None
    detect_local: DetectLocal | None = None
    cluster_cidr: str | None = msgspec.field(default=None, name="clusterCIDR")
    node_port_addresses: list[Any] | None = None
    """Each element is read as text (``str()``), and refused unless it is a CIDR or keyword."""
    oom_score_adj: Any = None
    conntrack: Conntrack | None = None
    config_sync_period: Any = None
    port_range: Any = None
    windows_run_as_service: Any = None


class MasqueradeSettings(msgspec.Struct, rename="camel", frozen=True):
    """``masqueradeBit`` and ``masqueradeAll`` of the section the mode reads them from."""

    masquerade_bit: int | None = None
    masquerade_all: bool | None = None


class PeriodSettings(msgspec.Struct, rename="camel", frozen=True):
    """``syncPeriod`` and ``minSyncPeriod`` of the section the mode reads them from."""

    sync_period: str | None = None
    min_sync_period: str | None = None


def decode(raw: Mapping[Any, Any], *, source: str) -> KubeProxyConfiguration:
    """``raw`` (the file's YAML) as typed; UsageError naming the field kube-proxy would refuse."""
    try:
        return msgspec.convert(raw, KubeProxyConfiguration)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, raw, KubeProxyConfiguration, source=source, at="") from None


_S = TypeVar("_S", bound=msgspec.Struct)


def decode_section(raw: Mapping[Any, Any], name: str, kind: type[_S], *, source: str) -> _S:
    """The fields of ``kind`` in section ``name`` of ``raw`` (already decoded, so a mapping or
    null); UsageError naming the field whose value is of the wrong type."""
    section = raw.get(name) or {}
    try:
        return msgspec.convert(section, kind)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, section, kind, source=source, at=f"{name}.") from None


_TYPE_NAMES = {"str": "str", "int": "int", "bool": "bool", "array": "list", "object": "dict"}
"""msgspec's names of JSON types, as Python's (kpng's messages have said "must be a int")."""


def _refusal(
    exc: msgspec.ValidationError,
    raw: Mapping[Any, Any],
    kind: type[msgspec.Struct],
    *,
    source: str,
    at: str,
) -> UsageError:
    """msgspec's error as kpng's messages: each names the field by its dotted path in the file
    (``conntrack.min``), as kube-proxy's strict decoding does."""
    problem = field_problem(exc)
    where = at + problem.dotted
    if problem.key:
        # A key that is no string: no field kube-proxy has.
        bad = problem.bad_key(raw)
        return _unknown(f"{where}.{bad}" if where else str(bad), source)
    if problem.unknown is not None:
        return _unknown(f"{where}.{problem.unknown}" if where else problem.unknown, source)
    if problem.expected is None:
        return UsageError(f'{source}: field "{where}": {problem.detail}')
    if problem.dotted in _sections(kind):
        return UsageError(f'{source}: field "{where}" must be a mapping')
    name = _TYPE_NAMES.get(problem.expected, problem.expected)
    return UsageError(f'{source}: field "{where}" must be a {name}, not {problem.value(raw)!r}')


def _unknown(path: str, source: str) -> UsageError:
    return UsageError(f'{source}: unknown field "{path}" (kube-proxy refuses it too)')


@functools.cache
def _sections(kind: type[msgspec.Struct]) -> frozenset[str]:
    """The dotted paths (encoded names) of ``kind``'s fields that are Structs."""
    found: set[str] = set()

    def walk(info: msgspec.inspect.Type, prefix: str) -> None:
        if isinstance(info, msgspec.inspect.UnionType):
            for member in info.types:
                walk(member, prefix)
        elif isinstance(info, msgspec.inspect.StructType):
            if prefix:
                found.add(prefix.removesuffix("."))
            for field in info.fields:
                walk(field.type, f"{prefix}{field.encode_name}.")

    walk(msgspec.inspect.type_info(kind), "")
    return frozenset(found)
