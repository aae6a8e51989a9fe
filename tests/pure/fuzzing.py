"""What the fuzz tests (tests/pure/test_fuzz_*.py) share: their Hypothesis settings and strategies.

Each fuzz test is bounded in examples and in time, so that the whole set adds about a minute to
the suite. ``KPNG_FUZZ_EXAMPLES=N`` runs N examples per test instead, for a long campaign (the
per-example deadline is lifted then: a loaded machine must not turn a slow example into a
failure). Hypothesis's example database is off: the seeds of the bugs found are kept as ordinary
regression tests beside the fuzz tests, not in a local directory.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_CAMPAIGN = int(os.environ.get("KPNG_FUZZ_EXAMPLES", "0"))


F = TypeVar("F", bound=Callable[..., Any])


def fuzz_settings(examples: int, *, deadline_ms: int = 500) -> Callable[[F], F]:
    """A fuzz test's bounds: ``examples`` per run (``KPNG_FUZZ_EXAMPLES`` if set), each within
    ``deadline_ms``. A campaign also lifts pytest-timeout's limit on the whole test, which
    thousands of examples exceed."""
    if _CAMPAIGN:
        bounds = settings(
            max_examples=_CAMPAIGN,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
    else:
        bounds = settings(
            max_examples=examples,
            deadline=datetime.timedelta(milliseconds=deadline_ms),
            database=None,
            # Generating nested documents is slower than running the code under test on them.
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
    timeout = pytest.mark.timeout(0 if _CAMPAIGN else 120)

    def bounded(test: F) -> F:
        # Fuzzing is a third of the pure tier's time: `make check` leaves it to `make test`.
        return pytest.mark.slow(timeout(bounds(test)))  # type: ignore[no-any-return]

    return bounded


# --- values of the kinds Kubernetes objects and YAML documents hold

scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
"""Any JSON/YAML scalar: the wrong type in a field is as likely as the right one."""

json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def perturbed(value: Any, draw: st.DrawFn, odds: int = 10) -> Any:
    """``value`` (a plausible object) with about one field in ``odds`` replaced by anything,
    removed, or one added: the shapes a hand-written or hostile manifest has, near enough to
    valid that the code under test gets past its first check. A reader that refuses a whole
    document for one bad field needs high odds, or it would see nothing else."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            choice = draw(st.integers(0, odds - 1))
            if choice == 0:
                continue  # dropped
            if choice == 1:
                out[key] = draw(json_values)
            else:
                out[key] = perturbed(item, draw, odds)
        if draw(st.integers(0, odds - 1)) == 0:
            out[draw(st.text(max_size=8))] = draw(json_values)
        return out
    if isinstance(value, list):
        items = [perturbed(v, draw, odds) for v in value]
        if draw(st.integers(0, odds - 1)) == 0:
            items.append(draw(json_values))
        return items
    if draw(st.integers(0, odds - 1)) == 0:
        return draw(scalars)
    return value


ips = st.one_of(
    st.sampled_from(
        [
            "10.0.0.1", "10.96.0.10", "fd00::1", "2001:db8::7", "::ffff:10.0.0.1", "0.0.0.0",
            "::", "010.0.0.1", "fe80::1%eth0", "999.1.1.1", "10.0.0.1/32", "", " 10.0.0.1",
            "None", "1.2.3", "::1::", "10.0.0.0/8", "fd00::/64", "10.0.0.1/33", "0/0",
        ]
    ),
    st.ip_addresses().map(str),
    st.text(max_size=12),
)  # fmt: skip
"""Addresses and ranges, valid in every spelling, and not."""

names = st.one_of(st.sampled_from(["web", "api", "kube-dns", "n1", "", "a/b"]), st.text(max_size=8))
ports = st.one_of(st.integers(0, 65535), st.integers(-1, 70000), st.sampled_from(["http", ""]))
protocols = st.sampled_from(["TCP", "UDP", "SCTP", "", "tcp", "ICMP"])


@st.composite
def k8s_service(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"])),
        "clusterIP": draw(ips),
        "clusterIPs": draw(st.lists(ips, max_size=3)),
        "externalIPs": draw(st.lists(ips, max_size=2)),
        "ports": [
            {
                "name": draw(names),
                "protocol": draw(protocols),
                "port": draw(ports),
                "nodePort": draw(ports),
                "targetPort": draw(ports),
            }
            for _ in range(draw(st.integers(0, 3)))
        ],
        "sessionAffinity": draw(st.sampled_from(["None", "ClientIP", "", "Other"])),
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": draw(st.integers(-5, 90000))}},
        "loadBalancerSourceRanges": draw(st.lists(ips, max_size=2)),
        "externalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local", "", "Nope"])),
        "internalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local", ""])),
        "healthCheckNodePort": draw(ports),
        "trafficDistribution": draw(st.sampled_from(["", "PreferClose", "PreferSameNode"])),
    }
    ingress = [{"ip": draw(ips), "ipMode": draw(st.sampled_from(["VIP", "Proxy", None]))}]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(draw),
        "spec": spec,
        "status": {"loadBalancer": {"ingress": ingress}},
    }


def _metadata(draw: st.DrawFn) -> dict[str, Any]:
    labels = draw(
        st.dictionaries(
            st.sampled_from(
                [
                    "kubernetes.io/service-name", "service.kubernetes.io/service-proxy-name",
                    "service.kubernetes.io/headless", "topology.kubernetes.io/zone", "app",
                ]
            ),
            names,
            max_size=3,
        )
    )  # fmt: skip
    annotations = {
        "endpoints.kubernetes.io/last-change-trigger-time": draw(
            st.one_of(
                st.datetimes(timezones=st.none() | st.timezones()).map(lambda d: d.isoformat()),
                st.text(max_size=25),
            )
        )
    }
    return {
        "name": draw(names),
        "namespace": draw(names),
        "labels": labels,
        "annotations": annotations,
    }


@st.composite
def k8s_slice(draw: st.DrawFn) -> dict[str, Any]:
    endpoints = [
        {
            "addresses": draw(st.lists(ips, max_size=2)),
            "conditions": {
                "ready": draw(st.none() | st.booleans()),
                "serving": draw(st.none() | st.booleans()),
                "terminating": draw(st.none() | st.booleans()),
            },
            "hostname": draw(names),
            "nodeName": draw(names),
            "zone": draw(names),
            "targetRef": {"kind": "Pod", "name": draw(names)},
            "hints": {"forZones": [{"name": draw(names)}], "forNodes": [{"name": draw(names)}]},
        }
        for _ in range(draw(st.integers(0, 3)))
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": _metadata(draw),
        "addressType": draw(st.sampled_from(["IPv4", "IPv6", "FQDN", "Other"])),
        "endpoints": endpoints,
        "ports": [
            {"name": draw(st.none() | names), "protocol": draw(protocols), "port": draw(ports)}
            for _ in range(draw(st.integers(0, 2)))
        ],
    }


@st.composite
def k8s_node(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": _metadata(draw),
        "spec": {
            "podCIDRs": draw(st.lists(ips, max_size=2)),
            "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}],
        },
        "status": {
            "addresses": [
                {"type": draw(st.sampled_from(["InternalIP", "ExternalIP", "Hostname"])),
                 "address": draw(ips)}
                for _ in range(draw(st.integers(0, 2)))
            ]
        },
    }  # fmt: skip


@st.composite
def k8s_service_cidr(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": _metadata(draw),
        "spec": {"cidrs": draw(st.lists(ips, max_size=2))},
    }


@st.composite
def k8s_objects(draw: st.DrawFn, odds: int = 10) -> Any:
    """A Kubernetes object of a kind kpng reads, plausible and then perturbed."""
    base = draw(st.one_of(k8s_service(), k8s_slice(), k8s_node(), k8s_service_cidr()))
    return perturbed(base, draw, odds)
