"""``kpng explain``: its booleans equal what backends are served, on every semantics table, and
its reasons word the decision taken (the tables' conventions:
tests/pure/test_resolver_semantics.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kpng.model.cluster import Slice
from kpng.resolver.explaining import ServiceExplanation, explain_service, render_text
from kpng.resolver.resolving import resolve_service
from tests.pure.test_resolver_semantics import (
    DUAL_STACK_CASES,
    NODE,
    NS,
    PORT_CASES,
    REJECT_DROP_CASES,
    TERMINATING_CASES,
    TOPOLOGY_CASES,
    TRAFFIC_POLICY_CASES,
    WEB,
    ZONE,
    Case,
    _scope_letters,
    ready,
    scopes_by_port,
    service,
    serving_terminating,
    slice6,
    slice_,
    terminating,
    unready,
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "cluster.yaml"


def explained_scopes(ex: ServiceExplanation) -> dict[str, dict[str, str]]:
    """{"name/PROTO": {"ip:port": "IEC"}}, the view scopes_by_port takes of a served state."""
    view: dict[str, dict[str, str]] = {}
    for port in ex.ports:
        used = view[f"{port.name}/{port.protocol}"] = {}
        for ep in port.endpoints:
            letters = _scope_letters(ep.internal, ep.external, ep.cluster)
            if letters:
                address = f"[{ep.address}]" if ":" in ep.address else ep.address
                used[f"{address}:{ep.port}"] = letters
    return view


ALL_CASES = [
    *TRAFFIC_POLICY_CASES,
    *REJECT_DROP_CASES,
    *TERMINATING_CASES,
    *TOPOLOGY_CASES,
    *DUAL_STACK_CASES,
    *PORT_CASES,
]


@pytest.mark.parametrize("case", ALL_CASES)
def test_explain_booleans_equal_the_served_state(case: Case) -> None:
    served = resolve_service(case.service, case.slices, node=NODE, zone=case.zone)
    ex = explain_service((NS, WEB), case.service, case.slices, node=NODE, zone=case.zone)
    assert explained_scopes(ex) == scopes_by_port(served)
    for port in ex.ports:
        # Every endpoint of every slice is listed, used or not, each with a reason.
        assert len(port.endpoints) == sum(len(sl.endpoints) for sl in case.slices)
        for ep in port.endpoints:
            assert ep.reasons, ep
            # The served scopes follow from the two sets and the policies
            # (docs/design/semantics.md).
            assert ep.internal == (ep.local if port.internal_policy == "Local" else ep.cluster)
            if port.external_policy:
                assert ep.external == (ep.local if port.external_policy == "Local" else ep.cluster)
            else:
                assert not ep.external


def codes(ex: ServiceExplanation, address: str, port: int = 0) -> set[str]:
    (found,) = [e for e in ex.ports[port].endpoints if e.address == address]
    return {r.code for r in found.reasons}


def verdict(ex: ServiceExplanation, address: str) -> tuple[bool, bool]:
    (found,) = [e for e in ex.ports[0].endpoints if e.address == address]
    return found.cluster, found.local


def test_an_endpoint_hinted_for_another_zone_names_both_zones() -> None:
    ex = explain_service(
        (NS, WEB),
        service(),
        [slice_("s", ready("10.0.2.1", zones=["zone-a"]), ready("10.0.3.1", zones=["zone-b"]))],
        node=NODE,
        zone=ZONE,
    )
    assert verdict(ex, "10.0.3.1") == (False, False)
    (reason,) = ex.ports[0].endpoints[1].reasons
    assert reason.code == "hint-for-other-zone"
    assert "zone-b" in reason.text
    assert "zone-a" in reason.text
    assert codes(ex, "10.0.2.1") == {"hint-for-zone"}


def test_hints_that_are_not_used_are_said_so() -> None:
    ex = explain_service(
        (NS, WEB),
        service(),
        [slice_("s", ready("10.0.2.1", zones=["zone-a"]), ready("10.0.3.1"))],
        node=NODE,
        zone=ZONE,
    )
    assert codes(ex, "10.0.2.1") == {"hints-unused"}
    assert codes(ex, "10.0.3.1") == {"ready"}


def test_conditions_and_the_terminating_fallback() -> None:
    with_ready = explain_service(
        (NS, WEB),
        service(),
        [
            slice_(
                "s",
                ready("10.0.2.1"),
                unready("10.0.2.2"),
                serving_terminating("10.0.2.3"),
                terminating("10.0.2.4"),
            )
        ],
        node=NODE,
        zone=ZONE,
    )
    assert codes(with_ready, "10.0.2.2") == {"not-ready"}
    assert codes(with_ready, "10.0.2.3") == {"terminating"}
    assert codes(with_ready, "10.0.2.4") == {"terminating-not-serving"}
    fallback = explain_service(
        (NS, WEB), service(), [slice_("s", serving_terminating("10.0.2.3"))], node=NODE, zone=ZONE
    )
    assert verdict(fallback, "10.0.2.3") == (True, False)
    assert codes(fallback, "10.0.2.3") == {"terminating-fallback"}


def test_internal_traffic_policy_local_says_where_the_endpoint_runs() -> None:
    ex = explain_service(
        (NS, WEB),
        service(itp_local=True),
        [slice_("s", ready("10.0.1.1", NODE), ready("10.0.2.1"))],
        node=NODE,
        zone=ZONE,
    )
    assert verdict(ex, "10.0.1.1") == (False, True)
    assert codes(ex, "10.0.1.1") == {"local"}
    assert codes(ex, "10.0.2.1") == {"other-node"}
    assert "node-b" in ex.ports[0].endpoints[1].reasons[0].text
    assert ex.ports[0].internal_policy == "Local"


def test_no_local_endpoint_under_internal_traffic_policy_local_is_a_drop() -> None:
    ex = explain_service(
        (NS, WEB), service(itp_local=True), [slice_("s", ready("10.0.2.1"))], node=NODE, zone=ZONE
    )
    assert "dropped-internal" in {n.code for n in ex.ports[0].notes}
    rejected = explain_service((NS, WEB), service(), [], node=NODE, zone=ZONE)
    assert {n.code for n in rejected.ports[0].notes} >= {"rejected"}
    assert rejected.ports[0].endpoints == []


def test_wrong_family_missing_port_and_duplicates_are_named() -> None:
    slices: list[Slice] = [
        slice6("v6", ready("fd00:2::1")),
        slice_("other-port", ready("10.0.2.9"), ports=[("grpc", "TCP", 9000)]),
        slice_("a", serving_terminating("10.0.2.1")),
        slice_("b", ready("10.0.2.1", "node-c")),
    ]
    ex = explain_service((NS, WEB), service(), slices, node=NODE, zone=ZONE)
    assert codes(ex, "fd00:2::1") == {"family"}
    assert codes(ex, "10.0.2.9") == {"no-port"}
    (missing,) = [e for e in ex.ports[0].endpoints if e.address == "10.0.2.9"]
    assert "'http'" in missing.reasons[0].text
    duplicate = [e for e in ex.ports[0].endpoints if e.address == "10.0.2.1"]
    assert [(e.slice, e.cluster, {r.code for r in e.reasons}) for e in duplicate] == [
        ("a", False, {"duplicate"}),
        ("b", True, {"ready"}),
    ]


def test_a_service_kpng_does_not_serve_says_why_it_might_not() -> None:
    ex = explain_service((NS, "gone"), None, [], node=NODE, zone=ZONE)
    assert not ex.served
    assert ex.notes[0].code == "not-served"
    assert "service-proxy-name" in ex.notes[0].text
    assert "headless" in ex.notes[0].text
    assert "not-served" not in render_text([ex])
    assert "kpng has no such Service" in render_text([ex])


def _kpng(*argv: str) -> bytes:
    return subprocess.run(
        [sys.executable, "-m", "kpng", *argv], check=True, capture_output=True, timeout=60
    ).stdout


@pytest.mark.slow
@pytest.mark.parametrize("node", ["node-1", "node-2", "node-3"])
def test_explain_command_agrees_with_to_json_on_the_example_cluster(node: str) -> None:
    explained = json.loads(
        _kpng("file", "--input", str(EXAMPLE), "explain", "--node-name", node, "-o", "json")
    )
    served = json.loads(
        _kpng(
            "file", "--input", str(EXAMPLE), "to-local", "--node-name", node,
            "to-json", "--once", "--output", "-",
        )
    )  # fmt: skip
    served_scopes = {}
    for entry in served["services"]:
        svc = entry["service"]
        for ep in entry.get("endpoints", []):
            for address in [*ep["IPs"].get("V4", []), *ep["IPs"].get("V6", [])]:
                for port in ep["PortOverrides"]:
                    scopes = ep.get("Scopes", {})
                    served_scopes[(svc["Namespace"], svc["Name"], port["Name"], address)] = (
                        scopes.get("Internal", False),
                        scopes.get("External", False),
                        scopes.get("Cluster", False),
                    )
    explained_scopes = {
        (ex["namespace"], ex["name"], port["name"], ep["address"]): (
            ep["internal"],
            ep["external"],
            ep["cluster"],
        )
        for ex in explained
        for port in ex["ports"]
        for ep in port["endpoints"]
        if ep["internal"] or ep["external"] or ep["cluster"]
    }
    assert explained_scopes == served_scopes
    assert {(ex["namespace"], ex["name"]) for ex in explained} == {
        (e["service"]["Namespace"], e["service"]["Name"]) for e in served["services"]
    }


def test_explain_one_service_as_a_table() -> None:
    out = _kpng(
        "file", "--input", str(EXAMPLE), "explain", "--node-name", "node-2", "--service", "shop/web"
    ).decode()
    assert out.startswith("shop/web on node node-2 (zone zone-a)\n")
    assert "10.244.3.12:8080" in out
    assert "hint for zone zone-b" in out


def test_explain_rejects_a_malformed_service_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kpng", "file", "--input", str(EXAMPLE), "explain",
         "--node-name", "node-2", "--service", "web"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "NAMESPACE/NAME" in done.stderr


def test_explanations_encode_as_json_with_their_reasons() -> None:
    ex = explain_service(
        (NS, WEB), service(), [slice_("s", unready("10.0.2.2"))], node=NODE, zone=""
    )
    data = msgspec.json.decode(msgspec.json.encode(ex))
    (endpoint,) = data["ports"][0]["endpoints"]
    assert endpoint["address"] == "10.0.2.2"
    assert endpoint["cluster"] is False
    assert endpoint["local"] is False
    assert endpoint["reasons"] == [{"code": "not-ready", "text": "not ready"}]
    assert data["notes"][0]["code"] == "no-zone"


IGNORED = """
apiVersion: v1
kind: Service
metadata:
  name: theirs
  namespace: shop
  labels: {service.kubernetes.io/service-proxy-name: other-proxy}
spec: {clusterIP: 10.96.0.50, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: headless, namespace: shop}
spec: {clusterIP: None, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: dns-name, namespace: shop}
spec: {type: ExternalName, externalName: example.com}
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("service", "why"),
    [
        ("theirs", "another proxy: labelled service.kubernetes.io/service-proxy-name=other-proxy"),
        ("headless", "headless: clusterIP None"),
        ("dns-name", "ExternalName"),
        ("missing", None),
    ],
)
def test_explain_says_why_the_file_source_ignores_a_service(
    tmp_path: Path, service: str, why: str | None
) -> None:
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(IGNORED)
    (explained,) = json.loads(
        _kpng(
            "file", "--input", str(manifest), "explain", "--node-name", "n1",
            "--service", f"shop/{service}", "-o", "json",
        )
    )  # fmt: skip
    assert explained["served"] is False
    (note,) = explained["notes"]
    if why is None:
        assert note["code"] == "not-served"
    else:
        assert note["code"] == "ignored"
        assert why in note["text"]
