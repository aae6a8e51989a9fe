"""The kubernetes-mixin's "Proxy" dashboard and kube-proxy alerts, evaluated by promtool against
scrapes of a running kpng: proof that an operator's kube-proxy dashboards read kpng unchanged.

Neither is kpng's: promtool is built from the Prometheus Go module, the mixin's sources come
from the Go module proxy (which serves any public GitHub repository as a module zip), both
cached under ``~/.cache/kpng/`` as the control plane is. Where the module proxy will not serve
the mixin, ``$KPNG_KUBERNETES_MIXIN`` names a checkout of it.

Queries are read from ``dashboards/proxy.libsonnet`` and the alert library, with the mixin's
``config.libsonnet`` values substituted as jsonnet would, then Grafana's template variables as
Grafana would for one instance (``$cluster`` empty: the mixin's single-cluster default).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kpng.harness.cluster import ControlPlaneError, _go, cache_root, ensure_go_program

PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_VERSION = "v0.316.0"
MIXIN_MODULE = "github.com/kubernetes-monitoring/kubernetes-mixin"
MIXIN_VERSION = "v0.0.0-20260806101029-aa38e2bfa7ea"
"""The mixin's main branch of 2026-08-06 (it tags no Go-style versions)."""
SCRAPE_INTERVAL_S = 15
RATE_INTERVAL = "1m15s"
"""Grafana's ``$__rate_interval`` for the dashboard's 1 m minimum interval and a 15 s scrape
interval: max(interval + scrape interval, 4 x scrape interval)."""

Sample = tuple[str, tuple[tuple[str, str], ...]]


class MixinUnavailable(Exception):
    """The mixin's sources cannot be had here (the reason says why)."""


def ensure_promtool() -> Path:
    return ensure_go_program(
        PROMETHEUS_MODULE, PROMETHEUS_VERSION, f"{PROMETHEUS_MODULE}/cmd/promtool"
    )


def ensure_mixin() -> Path:
    """A directory holding the mixin's sources: ``$KPNG_KUBERNETES_MIXIN``, else the cached
    module zip, downloaded first if absent."""
    given = os.environ.get("KPNG_KUBERNETES_MIXIN")
    if given:
        return Path(given)
    target = cache_root().parent / "kubernetes-mixin" / MIXIN_VERSION
    if (target / "dashboards" / "proxy.libsonnet").exists():
        return target
    with tempfile.TemporaryDirectory(prefix="kpng-mixin-") as tmp:
        (Path(tmp) / "go.mod").write_text("module kpng.local/mixin\n")
        try:
            out = _go(["mod", "download", "-json", f"{MIXIN_MODULE}@{MIXIN_VERSION}"], Path(tmp))
        except ControlPlaneError as exc:
            raise MixinUnavailable(
                f"the Go module proxy does not serve {MIXIN_MODULE}@{MIXIN_VERSION} ({exc}); "
                "set KPNG_KUBERNETES_MIXIN to a checkout of it"
            ) from exc
        archive = json.loads(out)["Zip"]
        staging = Path(tmp) / "unpacked"
        with zipfile.ZipFile(archive) as z:
            z.extractall(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging / f"{MIXIN_MODULE}@{MIXIN_VERSION}"), target)
    return target


@dataclass(frozen=True)
class Query:
    panel: str
    expr: str


def _config(mixin: Path) -> dict[str, str]:
    text = (mixin / "config.libsonnet").read_text()
    values = {}
    for name in ("kubeProxySelector", "clusterLabel", "grafanaIntervalVar"):
        found = re.search(rf"^\s*{name}:[^'\n]*'([^']*)'", text, re.M)
        if found is None:
            raise MixinUnavailable(f"config.libsonnet no longer sets {name}")
        values[name] = found.group(1)
    return values


def dashboard_queries(mixin: Path, *, instance: str) -> list[Query]:
    """Every target of the Proxy dashboard, as Grafana sends it for ``instance``."""
    config = _config(mixin)
    text = (mixin / "dashboards" / "proxy.libsonnet").read_text()
    queries = []
    quoted = r"'((?:[^'\\]|\\.)*)'"
    for panel in re.split(r"\n\s*(?=(?:statPanel\(|tsPanel\.new\())", text)[1:]:
        title = re.match(r"(?:statPanel\(|tsPanel\.new\()'([^']*)'", panel)
        assert title is not None
        exprs = re.findall(rf"prometheus\.new\('\$\{{datasource\}}', {quoted}", panel)
        # A stat panel's query is its third argument.
        exprs += re.findall(rf"^statPanel\('[^']*', '[^']*', {quoted}", panel)
        for expr in exprs:
            expr = expr % config
            expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "1m")
            # Grafana escapes a regex variable's value, then PromQL's string its backslashes.
            regex = re.escape(instance).replace("\\", "\\\\")
            expr = expr.replace("$cluster", "").replace("$instance", regex)
            queries.append(Query(title.group(1), expr))
    if not queries:
        raise MixinUnavailable("dashboards/proxy.libsonnet has no prometheus targets any more")
    return queries


def alert_expressions(mixin: Path) -> dict[str, str]:
    """The kube-proxy alerts (``alerts/kube_proxy.libsonnet``): name -> expression."""
    selector = _config(mixin)["kubeProxySelector"]
    rules = (mixin / "alerts" / "kube_proxy.libsonnet").read_text()
    found = {}
    for lib in re.findall(r"import '\.\./lib/([a-z_]+\.libsonnet)'", rules):
        text = (mixin / "lib" / lib).read_text()
        name = re.search(r"alert: '%s(\w+)'", text)
        expr = re.search(r"expr: \|\|\|\n(.*?)\n\s*\|\|\| % \w+\.selector", text, re.S)
        if name is None or expr is None:
            raise MixinUnavailable(f"lib/{lib} is no longer an alert kpng knows how to read")
        found[f"KubeProxy{name.group(1)}"] = expr.group(1).strip() % selector
    return found


def _series(name: str, labels: Sequence[tuple[str, str]]) -> str:
    body = ",".join(f"{k}={json.dumps(v)}" for k, v in labels)
    return f"{name}{{{body}}}"


def promtool_tests(
    scrapes: Sequence[Mapping[Sample, float]],
    *,
    job: str,
    instance: str,
    nonempty: Sequence[str],
    empty: Sequence[str],
) -> str:
    """A ``promtool test rules`` file: the scrapes as Prometheus stores them (``job`` and
    ``instance`` added, ``up`` 1, one scrape interval apart), each of ``nonempty`` asserted to
    return series at the last scrape, each of ``empty`` to return none."""
    target = (("instance", instance), ("job", job))
    keys = sorted({key for scrape in scrapes for key in scrape})
    series = [
        {
            "series": _series("up", target),
            "values": " ".join("1" for _ in scrapes),
        }
    ]
    for name, labels in keys:
        values = [
            repr(float(scrape[(name, labels)])) if (name, labels) in scrape else "_"
            for scrape in scrapes
        ]
        values = [v.replace("inf", "Inf").replace("nan", "NaN") for v in values]
        series.append({"series": _series(name, (*labels, *target)), "values": " ".join(values)})
    at = f"{SCRAPE_INTERVAL_S * (len(scrapes) - 1)}s"
    tests = [
        {
            "expr": f"clamp_max(count({expr}), 1)",
            "eval_time": at,
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for expr in nonempty
    ] + [{"expr": expr, "eval_time": at, "exp_samples": []} for expr in empty]
    document = {
        "rule_files": [],
        "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        "tests": [
            {"interval": f"{SCRAPE_INTERVAL_S}s", "input_series": series, "promql_expr_test": tests}
        ],
    }
    return json.dumps(document, indent=1)


def run_promtool_tests(document: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` on ``document`` (JSON is YAML): its output says which failed."""
    path = workdir / "kpng-mixin-test.yaml"
    path.write_text(document)
    return subprocess.run(
        [str(ensure_promtool()), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
