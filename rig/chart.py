"""kpng's Helm chart (``deploy/helm/kpng``) as operators install it, with ``helm`` itself.

helm is built from its Go module (``helm.sh/helm/v4``) with the machine's Go toolchain and
cached beside the Kubernetes programs (``~/.cache/kpng/control-plane/go/``), as CoreDNS is:
``python -m rig.chart build`` (``make control-plane``, on ``make test``'s path)
builds it, in about two minutes on two cores, and later calls find it at once.

``template`` renders the chart as ``helm template`` does for ``kubectl apply`` (the real-node
tests deploy kpng that way); ``lint`` runs ``helm lint``; ``install`` and ``uninstall`` manage a
release in a cluster, as the migration runbook's Helm path does. All run helm with homes of their
own, so that an operator's helm configuration, repositories and plugins change nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rig.cluster import ControlPlaneError, ensure_go_program

HELM_MODULE = "helm.sh/helm/v4"
HELM_VERSION = "v4.3.1"
"""The newest helm release the Go module proxy served when this was written."""

DEPLOY_DIR = Path(__file__).resolve().parents[1] / "deploy"
"""The manifests a cluster operator applies; present in a source checkout."""
CHART_DIR = DEPLOY_DIR / "helm" / "kpng"

NAMESPACE = "kube-system"
"""Where deploy/'s manifests put kpng, beside the kube-proxy it replaces."""


class ChartError(ControlPlaneError):
    """helm refused the chart or the values (the message is helm's)."""


def ensure_helm() -> Path:
    return ensure_go_program(HELM_MODULE, HELM_VERSION, f"{HELM_MODULE}/cmd/helm")


def image_values(reference: str) -> dict[str, str]:
    """``image.repository`` and ``image.tag`` of a reference such as ``registry:5000/kpng:1``:
    the tag is after the last colon of the last path element (a registry's port is not one)."""
    slash = reference.rfind("/")
    colon = reference.rfind(":")
    if colon <= slash:
        return {"repository": reference}
    return {"repository": reference[:colon], "tag": reference[colon + 1 :]}


def values(
    *,
    api_server: str,
    cluster_cidr: str,
    image: str,
    shape: str = "daemonset",
    mode: str = "nftables",
    brains: Sequence[str] = (),
) -> dict[str, Any]:
    """The values an operator sets: what the cluster decides (the API server's real address,
    the pod CIDRs, the image), the shape and the mode; the rest keeps the chart's defaults."""
    result: dict[str, Any] = {
        "shape": shape,
        "mode": mode,
        "apiServer": api_server,
        "clusterCIDR": cluster_cidr,
        "image": image_values(image),
    }
    if brains:
        result["central"] = {"brains": list(brains)}
    return result


def _helm(args: Sequence[str], *given: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """helm with ``args`` and one values file per mapping of ``given``, in that order (later
    files override earlier ones, as ``-f`` does)."""
    if not (CHART_DIR / "Chart.yaml").is_file():
        raise ChartError(f"{CHART_DIR} is missing: the chart is in kpng's source checkout")
    with tempfile.TemporaryDirectory(prefix="kpng-helm-") as tmp:
        home = Path(tmp)
        files: list[str] = []
        for index, mapping in enumerate(given):
            path = home / f"values-{index}.yaml"
            # JSON is YAML: the values exactly as given, no --set parsing of commas or dots.
            path.write_text(json.dumps(dict(mapping)))
            files += ["--values", str(path)]
        env = {
            **os.environ,
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        return subprocess.run(
            [str(ensure_helm()), *args, *files],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )


def template(given: Mapping[str, Any], *, namespace: str = NAMESPACE, release: str = "kpng") -> str:
    """``helm template`` of the chart: the manifests, as ``kubectl apply -f -`` takes them."""
    proc = _helm(["template", release, str(CHART_DIR), "--namespace", namespace], given)
    if proc.returncode != 0:
        raise ChartError(f"helm template failed: {proc.stderr.strip()}")
    return proc.stdout


def objects(given: Mapping[str, Any], *, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The chart's objects, parsed."""
    return [d for d in yaml.safe_load_all(template(given, namespace=namespace)) if d]


def lint(given: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """``helm lint --strict``: its output says what is wrong, its status whether anything is."""
    return _helm(["lint", "--strict", str(CHART_DIR), "--namespace", NAMESPACE], given)


def install(
    kubeconfig: Path,
    *given: Mapping[str, Any],
    namespace: str = NAMESPACE,
    release: str = "kpng",
) -> None:
    """``helm install`` of the chart into the cluster of ``kubeconfig``, with one values file per
    mapping of ``given`` (``-f`` after ``-f``)."""
    args = ["install", release, str(CHART_DIR), "--namespace", namespace]
    proc = _helm([*args, "--kubeconfig", str(kubeconfig)], *given)
    if proc.returncode != 0:
        raise ChartError(f"helm install failed: {proc.stderr.strip()}")


def uninstall(kubeconfig: Path, *, namespace: str = NAMESPACE, release: str = "kpng") -> None:
    """``helm uninstall``: the release's objects deleted from the cluster of ``kubeconfig``."""
    args = ["uninstall", release, "--namespace", namespace, "--kubeconfig", str(kubeconfig)]
    proc = _helm(args)
    if proc.returncode != 0:
        raise ChartError(f"helm uninstall failed: {proc.stderr.strip()}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rig.chart build``: build (or find) helm, print its path."""
    parser = argparse.ArgumentParser(prog="python -m rig.chart", description=main.__doc__)
    parser.add_argument("command", choices=["build"])
    parser.parse_args(argv)
    try:
        print(f"helm {HELM_VERSION}: {ensure_helm()}")
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
