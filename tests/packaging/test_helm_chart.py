"""deploy/helm/kpng with helm itself (built from its Go module): ``helm lint`` passes in every
shape and mode, each shape renders exactly deploy/'s manifest of that shape (so installing with
helm or with envsubst gives the same cluster), and the values do what docs/operators/helm.md
says."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

import kpng
from kpng.backends.ebpf import system
from kpng.kubeproxy.config import load
from rig import addons, chart
from rig.chart import ChartError
from rig.nodes import RealCluster

API_SERVER = "https://10.0.0.1:6443"
CLUSTER_CIDR = "10.244.0.0/16"
IMAGE = "registry.example:5000/kpng:1.2.3"
BRAINS = ("tcp://10.0.0.11:12090", "tcp://10.0.0.12:12090")

Key = tuple[str, str, str]


def _values(shape: str = "daemonset", mode: str = "nftables") -> dict[str, Any]:
    brains = BRAINS if shape == "central" else ()
    return chart.values(
        api_server=API_SERVER,
        cluster_cidr=CLUSTER_CIDR,
        image=IMAGE,
        shape=shape,
        mode=mode,
        brains=brains,
    )


def _by_key(documents: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Objects by kind, namespace and name, with each ConfigMap entry that is a YAML document
    (config.conf, kubeconfig.conf) parsed: what kpng reads, not how the text is laid out."""
    found: dict[Key, dict[str, Any]] = {}
    for document in documents:
        meta = document["metadata"]
        key = (document["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in found, f"{key} twice"
        if document["kind"] == "ConfigMap":
            document = {
                **document,
                "data": {k: yaml.safe_load(v) for k, v in document["data"].items()},
            }
        found[key] = document
    return found


def _deploy_objects(shape: str, mode: str = "nftables") -> dict[Key, dict[str, Any]]:
    text = addons.manifests(
        shape,
        {
            "KPNG_API_SERVER": API_SERVER,
            "KPNG_CLUSTER_CIDR": CLUSTER_CIDR,
            "KPNG_IMAGE": IMAGE,
            "KPNG_BRAINS": ",".join(BRAINS),
        },
        mode,
    )
    return _by_key([d for d in yaml.safe_load_all(text) if d])


def _daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (daemonset,) = [d for d in objects if d["kind"] == "DaemonSet"]
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in spec["containers"] if c["name"] == name]
    assert isinstance(container, dict)
    return container


@pytest.mark.parametrize(
    ("shape", "mode"),
    [(shape, "nftables") for shape in addons.SHAPES] + list(addons.MODE_MANIFESTS),
)
def test_each_shape_renders_its_manifest_in_deploy(shape: str, mode: str) -> None:
    """The defaults render deploy/kpng.yaml (with deploy/rbac.yaml); the sidecar and central
    shapes render their own files, and mode=ebpf deploy/kpng-ebpf.yaml: operators get the same
    objects either way."""
    rendered = _by_key(chart.objects(_values(shape, mode)))
    expected = _deploy_objects(shape, mode)
    assert sorted(rendered) == sorted(expected)
    for key, document in expected.items():
        assert rendered[key] == document, key


@pytest.mark.parametrize(("shape", "mode"), list(itertools.product(addons.SHAPES, addons.MODES)))
def test_helm_lint_passes_in_every_shape_and_mode(shape: str, mode: str) -> None:
    result = chart.lint(_values(shape, mode))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_the_chart_runs_this_release_of_kpng_by_default() -> None:
    meta = yaml.safe_load((chart.CHART_DIR / "Chart.yaml").read_text())
    assert meta["appVersion"] == kpng.__version__
    given = _values()
    del given["image"]["tag"]
    spec = _daemonset(chart.objects(given))
    assert _container(spec, "kpng")["image"] == f"registry.example:5000/kpng:{kpng.__version__}"


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("kpng.local/kpng:0.1.0", {"repository": "kpng.local/kpng", "tag": "0.1.0"}),
        ("registry:5000/kpng", {"repository": "registry:5000/kpng"}),
        ("registry:5000/a/kpng:v1", {"repository": "registry:5000/a/kpng", "tag": "v1"}),
    ],
)
def test_an_image_reference_splits_at_its_tag_not_at_a_registry_port(
    reference: str, expected: dict[str, str]
) -> None:
    assert chart.image_values(reference) == expected


def test_the_daemonset_shape_in_iptables_mode_is_kube_proxys_iptables_mode() -> None:
    objects = chart.objects(_values("daemonset", "iptables"))
    (config_map,) = [d for d in objects if d["kind"] == "ConfigMap"]
    loaded = load(config_map["data"]["config.conf"], source="config.conf")
    assert loaded.warnings == []
    assert loaded.config.backend == "to-iptables"
    assert loaded.config.cluster_cidrs == (CLUSTER_CIDR,)
    container = _container(_daemonset(objects), "kpng")
    assert container["command"][:2] == ["kpng", "kube-proxy"]


@pytest.mark.parametrize(("shape", "container"), [("sidecar", "backend"), ("central", "kpng")])
@pytest.mark.parametrize(("mode", "backend"), [("nftables", "to-nft"), ("iptables", "to-iptables")])
def test_the_split_shapes_run_the_modes_backend_with_net_admin_only(
    shape: str, container: str, mode: str, backend: str
) -> None:
    spec = _daemonset(chart.objects(_values(shape, mode)))
    node = _container(spec, container)
    command = node["command"]
    assert command[command.index(backend) + 1 :] == [
        f"--cluster-cidr={CLUSTER_CIDR}",
        "--nodeport-addresses=primary",
    ]
    assert node["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert "privileged" not in node["securityContext"]
    assert "hostPID" not in spec


@pytest.mark.parametrize(
    ("shape", "container"), list(zip(addons.SHAPES, ["kpng", "backend", "kpng"], strict=True))
)
def test_ebpf_mode_balances_the_hosts_cgroups_and_pins_on_its_bpffs_unprivileged(
    shape: str, container: str
) -> None:
    spec = _daemonset(chart.objects(_values(shape, "ebpf")))
    node = _container(spec, container)
    command = node["command"]
    # Not kube-proxy's command line: ebpf is no kube-proxy mode. The object is the image's own.
    assert "kube-proxy" not in command
    assert command[command.index("to-ebpf") :] == [
        "to-ebpf",
        f"--cluster-cidr={CLUSTER_CIDR}",
        "--nodeport-addresses=primary",
        "--cgroup=/run/kpng/host-cgroup",
    ]
    # What the kernel asks of to-ebpf's calls (tests/kernel/test_ebpf_kernel.py runs it with
    # exactly these), not privileged; SYS_ADMIN, SYS_PTRACE and the host's PIDs to enter the
    # pods' network namespaces (local traffic detection, --connected-udp destroy).
    assert node["securityContext"] == {
        "capabilities": {
            "drop": ["ALL"],
            "add": ["BPF", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE", "SYS_RESOURCE"],
        },
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
    }
    assert spec["hostPID"] is True
    # The host's bpffs (the pins outlive the pod) and cgroup2 hierarchy (read-only), and no
    # other host path; no cache: nothing is compiled.
    mounts = {m["name"]: m for m in node["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["bpffs"] == {"name": "bpffs", "mountPath": "/sys/fs/bpf"}
    assert volumes["bpffs"]["hostPath"] == {"path": "/sys/fs/bpf", "type": "Directory"}
    assert mounts["host-cgroup"]["mountPath"] == "/run/kpng/host-cgroup"
    assert mounts["host-cgroup"]["readOnly"] is True
    assert volumes["host-cgroup"]["hostPath"]["path"] == "/sys/fs/cgroup"
    assert sorted(v["name"] for v in spec["volumes"] if "hostPath" in v) == [
        "bpffs",
        "host-cgroup",
    ]
    assert not any(e["name"] == "XDG_CACHE_HOME" for e in node["env"])
    if shape == "daemonset":
        assert command[command.index("kube") : command.index("to-ebpf")] == [
            "kube",
            "--kubeconfig=/var/lib/kpng/kubeconfig.conf",
            "to-local",
            "--node-name=$(NODE_NAME)",
        ]


def test_ebpf_mode_takes_another_object_in_the_image() -> None:
    given = _values("daemonset", "ebpf")
    given["ebpf"] = {"bpfObject": "/opt/kpng/other.bpf.o"}
    command = _container(_daemonset(chart.objects(given)), "kpng")["command"]
    assert command[-1] == "--bpf-object=/opt/kpng/other.bpf.o"


def test_values_set_resources_replicas_conntrack_and_the_namespace() -> None:
    given = _values("central")
    given["resources"] = {"backend": {"requests": {"cpu": "10m"}}}
    given["central"]["replicas"] = 3
    given["conntrack"] = {"maxPerCore": 0}
    objects = chart.objects(given, namespace="networking")
    spec = _daemonset(objects)
    # Merged into the defaults, as helm merges every map of values.
    assert _container(spec, "kpng")["resources"] == {
        "requests": {"cpu": "10m", "memory": "64Mi"},
        "limits": {"memory": "1Gi"},
    }
    (brains,) = [d for d in objects if d["kind"] == "Deployment"]
    assert brains["spec"]["replicas"] == 3
    brain = brains["spec"]["template"]["spec"]["containers"][0]
    assert "--node-user=system:serviceaccount:networking:kpng-node" in brain["command"]
    (config_map,) = [d for d in objects if d["kind"] == "ConfigMap"]
    conntrack = yaml.safe_load(config_map["data"]["config.conf"])["conntrack"]
    assert conntrack == {
        "maxPerCore": 0,
        "min": None,
        "tcpEstablishedTimeout": "24h0m0s",
        "tcpCloseWaitTimeout": "1h0m0s",
    }
    assert {d["metadata"].get("namespace", "networking") for d in objects} == {"networking"}


MIGRATION_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {"key": "kpng.io/proxy", "operator": "In", "values": ["kpng"]}
                    ]
                }
            ]
        }
    }
}


@pytest.mark.parametrize("shape", addons.SHAPES)
@pytest.mark.parametrize(
    ("given", "field", "expected"),
    [
        # Merged with the default selector, as Helm merges maps: still Linux nodes only.
        ({"nodeSelector": {"kpng.io/proxy": "kpng"}}, "nodeSelector",
         {"kubernetes.io/os": "linux", "kpng.io/proxy": "kpng"}),
        ({"nodeSelector": {"kubernetes.io/os": None, "kpng.io/proxy": "kpng"}}, "nodeSelector",
         {"kpng.io/proxy": "kpng"}),
        ({"affinity": MIGRATION_AFFINITY}, "affinity", MIGRATION_AFFINITY),
        ({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "net",
                           "effect": "NoSchedule"}]},
         "tolerations",
         [{"key": "dedicated", "operator": "Equal", "value": "net", "effect": "NoSchedule"}]),
        ({"tolerations": []}, "tolerations", None),
        ({"priorityClassName": "kpng-critical"}, "priorityClassName", "kpng-critical"),
        ({"priorityClassName": ""}, "priorityClassName", None),
        ({"imagePullSecrets": [{"name": "regcred"}]}, "imagePullSecrets", [{"name": "regcred"}]),
    ],
    ids=["node-selector", "node-selector-without-os", "affinity", "tolerations",
         "no-tolerations", "priority-class", "no-priority-class", "image-pull-secrets"],
)  # fmt: skip
def test_values_place_the_node_daemonset_for_a_node_by_node_migration(
    shape: str, given: dict[str, Any], field: str, expected: object
) -> None:
    """Each value lands in the node DaemonSet's pod spec (None: the field is left out), in every
    shape; everything else renders as with the defaults."""
    values = {**_values(shape), **copy.deepcopy(given)}
    spec = _daemonset(chart.objects(values))
    assert spec.get(field) == expected
    default = _daemonset(chart.objects(_values(shape)))
    assert {k: v for k, v in spec.items() if k != field} == {
        k: v for k, v in default.items() if k != field
    }


def test_image_pull_secrets_reach_the_central_brains_too() -> None:
    """The brains run the same image from the same registry."""
    values = {**_values("central"), "imagePullSecrets": [{"name": "regcred"}]}
    (brains,) = [d for d in chart.objects(values) if d["kind"] == "Deployment"]
    assert brains["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    (default,) = [d for d in chart.objects(_values("central")) if d["kind"] == "Deployment"]
    assert "imagePullSecrets" not in default["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ({"type": "OnDelete"}, {"type": "OnDelete"}),
        ({"rollingUpdate": {"maxUnavailable": "10%"}},
         {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}),
        ({"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
         {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
        ({}, {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}),
    ],
    ids=["on-delete", "ten-percent", "surge", "default"],
)  # fmt: skip
def test_update_strategy_sets_how_nodes_take_a_new_release(
    strategy: dict[str, Any], expected: dict[str, Any]
) -> None:
    """OnDelete leaves rollingUpdate out although Helm merges the default's in: the API server
    refuses a DaemonSet with both."""
    (daemonset,) = [
        d
        for d in chart.objects({**_values(), "updateStrategy": strategy})
        if d["kind"] == "DaemonSet"
    ]
    assert daemonset["spec"]["updateStrategy"] == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"updateStrategy": {"type": "Recreate"}}, "/updateStrategy/type"),
        ({"imagePullSecrets": ["regcred"]}, "/imagePullSecrets/0"),
        ({"apiServer": ""}, "apiServer: the API server's real address"),
        ({"clusterCIDR": ""}, "clusterCIDR: the pod CIDRs"),
        ({"shape": "mesh"}, "/shape"),
        ({"mode": "ipvs"}, "/mode"),
        ({"apiServer": "http://10.0.0.1:8080"}, "/apiServer"),
        ({"shape": "central", "central": {"brains": []}}, "central.brains"),
    ],
)
def test_values_kpng_cannot_run_with_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ChartError, match=message):
        chart.template({**_values(), **change})


def test_the_e2e_nodes_of_one_machine_get_a_to_ebpf_daemonset_each(tmp_path: Path) -> None:
    """The real-node harness's nodes share one machine: each gets the chart's to-ebpf DaemonSet
    with its own cgroup2 directory and bpffs directory, on that node only; nothing else
    differs."""
    cluster = RealCluster(nodes=2, pause_image="pause", workdir=tmp_path, cgroup2=True)
    rendered = chart.template(_values(mode="ebpf"))
    manifest, names = addons.ebpf_per_node(rendered, cluster)
    chart_set = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "DaemonSet")
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    daemonsets = {d["metadata"]["name"]: d for d in documents if d["kind"] == "DaemonSet"}
    assert names == ["kpng-node-1", "kpng-node-2"] == sorted(daemonsets)
    others = [d for d in documents if d["kind"] != "DaemonSet"]
    assert others == [d for d in yaml.safe_load_all(rendered) if d and d["kind"] != "DaemonSet"]
    for node in ("node-1", "node-2"):
        daemonset = daemonsets[f"kpng-{node}"]
        pod = daemonset["spec"]["template"]
        assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": node}
        assert daemonset["spec"]["selector"]["matchLabels"]["kpng.io/node"] == node
        assert pod["metadata"]["labels"]["kpng.io/node"] == node
        volumes = pod["spec"]["volumes"]
        paths = {v["name"]: v["hostPath"]["path"] for v in volumes if "hostPath" in v}
        assert paths == {
            "host-cgroup": f"/sys/fs/cgroup/unified/kpng-{node}",
            "bpffs": f"/sys/fs/bpf/kpng-{node}",
        }
        (container,) = pod["spec"]["containers"]
        (expected,) = copy.deepcopy(chart_set["spec"]["template"]["spec"]["containers"])
        added = expected["securityContext"]["capabilities"]["add"]
        grantable = addons.grantable_capabilities()
        expected["securityContext"]["capabilities"]["add"] = [c for c in added if c in grantable]
        assert container == expected


def test_capabilities_this_machine_cannot_grant_are_found_in_its_bounding_set() -> None:
    status = "Name:\tx\nCapBnd:\t000001fffeffffff\nCapAmb:\t0000000000000000\n"
    assert addons.grantable_capabilities(status) == {"NET_ADMIN", "SYS_PTRACE", "SYS_ADMIN", "BPF"}
    full = "CapBnd:\t000001ffffffffff\n"
    assert addons.grantable_capabilities(full) == set(system.CAPABILITIES)
