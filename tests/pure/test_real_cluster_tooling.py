"""The pure parts of the real-cluster tooling: manifests as rendered, e2e reports as read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kpng.kubeproxy.config import load
from rig import addons
from rig.e2e import Outcome, Report, compare, parse_junit, regressions
from rig.nodes import NodeError

_VALUES = {
    "KPNG_API_SERVER": "https://10.0.0.1:6443",
    "KPNG_CLUSTER_CIDR": "10.244.0.0/16",
    "KPNG_IMAGE": "registry.example/kpng:1",
}


def _kpng_manifest() -> list[dict[str, object]]:
    text = addons.render((addons.DEPLOY_DIR / "kpng.yaml").read_text(), _VALUES)
    return [d for d in yaml.safe_load_all(text) if d]


def test_rendering_fills_kpng_values_and_leaves_kubernetes_expansions() -> None:
    text = addons.render((addons.DEPLOY_DIR / "kpng.yaml").read_text(), _VALUES)
    assert "${" not in text
    assert "--hostname-override=$(NODE_NAME)" in text
    assert "server: https://10.0.0.1:6443" in text


def test_rendering_refuses_a_missing_value() -> None:
    with pytest.raises(NodeError, match="KPNG_IMAGE"):
        addons.render("image: ${KPNG_IMAGE}", {})


def test_the_daemonset_is_what_the_deploy_guide_promises() -> None:
    (daemonset,) = [d for d in _kpng_manifest() if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]  # type: ignore[index]
    (container,) = spec["containers"]
    assert spec["hostNetwork"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert container["image"] == "registry.example/kpng:1"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert "privileged" not in container["securityContext"]
    # Only the init container that sets the conntrack sysctls is privileged.
    (init,) = spec["initContainers"]
    assert init["securityContext"] == {"privileged": True}
    assert init["image"] == container["image"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert set(container["resources"]) == {"requests", "limits"}
    # kube-proxy's command line after `kpng`; the init container sets the sysctls only.
    assert container["command"][:3] == ["kpng", "kube-proxy", "--config=/var/lib/kpng/config.conf"]
    assert init["command"] == [*container["command"][:3], "--init-only"]


def test_the_config_map_is_a_kube_proxy_configuration_kpng_reads_without_a_warning() -> None:
    (config_map,) = [d for d in _kpng_manifest() if d["kind"] == "ConfigMap"]
    loaded = load(config_map["data"]["config.conf"], source="config.conf")  # type: ignore[index]
    assert loaded.warnings == []
    assert loaded.config.cluster_cidrs == ("10.244.0.0/16",)
    assert loaded.config.kubeconfig == "/var/lib/kpng/kubeconfig.conf"
    assert loaded.config.mode == "nftables"


_JUNIT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="5">
  <testsuite name="Kubernetes e2e suite" tests="5">
    <testcase name="[SynchronizedBeforeSuite]" status="passed" time="3"></testcase>
    <testcase name="[It] [sig-network] Services should pass" status="passed" time="12.5">
    </testcase>
    <testcase name="[It] [sig-network] Services should fail" status="failed" time="30">
      <failure message="timed out" type="failed">stack</failure>
    </testcase>
    <testcase name="[It] [sig-network] Services should need a cloud" status="skipped" time="0.1">
      <skipped message="skipped - Only supported for providers [gce]"></skipped>
    </testcase>
    <testcase name="[It] [sig-storage] not selected" status="skipped" time="0">
      <skipped message="skipped"></skipped>
    </testcase>
  </testsuite>
</testsuites>
"""


def test_a_junit_report_gives_the_selected_specs_and_why_they_skipped(tmp_path: Path) -> None:
    path = tmp_path / "junit_01.xml"
    path.write_text(_JUNIT)
    assert parse_junit(path) == [
        Outcome("[sig-network] Services should pass", "passed", 12.5),
        Outcome("[sig-network] Services should fail", "failed", 30.0, "timed out"),
        Outcome(
            "[sig-network] Services should need a cloud",
            "skipped",
            0.1,
            "skipped - Only supported for providers [gce]",
        ),
    ]


def _report(proxy: str, **states: str) -> Report:
    return Report(
        proxy=proxy,
        kubernetes_version="v1.35.4",
        focus="",
        skip="",
        seconds=600,
        outcomes=[Outcome(name, state, 1.0) for name, state in states.items()],
    )


def test_kpng_regresses_where_kube_proxy_passes_and_kpng_does_not() -> None:
    kpng = _report("kpng", a="passed", b="failed", c="failed", d="skipped")
    baseline = _report("kube-proxy", a="passed", b="passed", c="failed", d="passed")
    assert regressions(kpng, baseline) == ["b", "d"]
    table = compare([kpng, baseline])
    assert "| kpng | 1 | 2 | 1 | 10 |" in table
    assert "| kube-proxy | 3 | 1 | 0 | 10 |" in table
    assert "| b | failed | passed |" in table
    assert "| a |" not in table  # the same for both
