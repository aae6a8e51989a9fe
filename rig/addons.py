"""What a real cluster runs in kube-system once its nodes are up: a service proxy (kpng from its
Helm chart in ``deploy/helm/kpng``, or upstream kube-proxy as the baseline), as a kubeadm user
would deploy them.

Both proxies run as DaemonSets from images imported into every node (no registry here), reach
the API server by its real address (the ``kubernetes`` Service needs a proxy first), and are
Ready when their ``/healthz`` says the node's rules are programmed.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kpng.backends.ebpf import system
from kpng.testing.waiting import until
from rig import chart
from rig.chart import DEPLOY_DIR as DEPLOY_DIR
from rig.nodes import (
    CLUSTER_CIDR,
    CLUSTER_DNS,
    NodeError,
    RealCluster,
    RealNode,
)

_PLACEHOLDER = re.compile(r"\$\{(KPNG_[A-Z_]+)\}")


def render(template: str, values: dict[str, str]) -> str:
    """``envsubst`` restricted to ``${KPNG_...}``, as deploy/kpng.yaml tells users to run it: the
    manifest's own ``$(NODE_NAME)`` expansions are Kubernetes', left alone."""
    missing = sorted(set(_PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise NodeError(f"no value for {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _deploy_file(name: str) -> str:
    path = DEPLOY_DIR / name
    if not path.is_file():
        raise NodeError(f"{path} is missing: deploying needs kpng's source checkout")
    return path.read_text()


def manifests(shape: str, values: dict[str, str], mode: str = "nftables") -> str:
    """What an operator without helm applies for ``shape`` (and ``mode``): deploy/rbac.yaml, then
    the manifest with ``values`` (``KPNG_...``) filled in."""
    name = MODE_MANIFESTS.get((shape, mode), SHAPES[shape])
    return "---\n".join([_deploy_file("rbac.yaml"), render(_deploy_file(name), values)])


SHAPES = {"daemonset": "kpng.yaml", "sidecar": "kpng-sidecar.yaml", "central": "kpng-central.yaml"}
"""How kpng is deployed (the chart's ``shape``), each with the manifest in deploy/ that the chart
renders for it: one process per node (``kpng kube-proxy``), a brain and a backend container per
node sharing a socket, or a Deployment of brains serving a backend on every node."""

MODES = ("nftables", "iptables", "ebpf")
"""The chart's ``mode``: to-nft, to-iptables or to-ebpf programs the nodes."""

MODE_MANIFESTS = {("daemonset", "ebpf"): "kpng-ebpf.yaml"}
"""The manifests in deploy/ of a shape in another mode than its file's (nftables): the chart
renders each exactly. to-ebpf's differs in more than a word (its command line, capabilities and
host paths), so it has its own."""

BRAIN_PORT = 12090
BRAIN_METRICS_PORT = BRAIN_PORT + 2
"""The chart's brains serve /metrics on loopback, two ports above their watches."""


def deploy_kpng(
    cluster: RealCluster,
    image: str,
    *,
    mode: str = "nftables",
    shape: str = "daemonset",
    timeout_s: int = 180,
) -> None:
    """kpng's Helm chart in ``shape`` and ``mode``, rendered with ``helm template`` and applied
    as an operator would; returns once every node's kpng pod (and every brain) is Ready."""
    brains = _prepare_brains(cluster) if shape == "central" else ()
    manifest = chart.template(chart_values(cluster, image, mode=mode, shape=shape, brains=brains))
    daemonsets = ["kpng"]
    if mode == "ebpf":
        manifest, daemonsets = ebpf_per_node(manifest, cluster)
        for node in cluster.nodes:
            ebpf_pin_dir(node).mkdir(exist_ok=True)
    cluster.kubectl("apply", "-f", "-", input=manifest)
    if shape == "central":
        wait_rollout(cluster, "deployment/kpng-brain", timeout_s)
    for name in daemonsets:
        wait_rollout(cluster, f"daemonset/{name}", timeout_s)


def chart_values(
    cluster: RealCluster,
    image: str,
    *,
    mode: str = "nftables",
    shape: str = "daemonset",
    brains: Sequence[str] = (),
) -> dict[str, Any]:
    """The chart's values for ``cluster`` (its operator's ``kpng-values.yaml``)."""
    given = chart.values(
        api_server=cluster.server,
        cluster_cidr=",".join(cluster.cluster_cidrs),
        image=image,
        shape=shape,
        mode=mode,
        brains=brains,
    )
    # Nodes are network namespaces of one machine, where only the first may size the machine's
    # conntrack table (as for the kube-proxy baseline below); the timeouts are per namespace.
    given["conntrack"] = {"maxPerCore": 0}
    return given


def ebpf_per_node(manifest: str, cluster: RealCluster) -> tuple[str, list[str]]:
    """The chart's to-ebpf DaemonSet made one per node, each given its node's cgroup2 directory
    and a bpffs directory of its own; the manifest and the DaemonSets' names.

    On a real node the host's cgroup2 root holds just that node's sockets and its bpffs just its
    pins, as the chart assumes. These nodes share one machine: with the chart's paths, each
    node's programs would balance the other node's pods too, and the two kpngs would take over
    each other's maps. A capability this machine's own bounding set lacks is left out (runc
    could not grant it): in this sandbox SYS_RESOURCE, which only kernels before 5.11 use."""
    grantable = grantable_capabilities()
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    (chart_set,) = [d for d in documents if d["kind"] == "DaemonSet"]
    documents.remove(chart_set)
    names = []
    for node in cluster.nodes:
        daemonset = copy.deepcopy(chart_set)
        name = f"kpng-{node.name}"
        daemonset["metadata"]["name"] = name
        spec = daemonset["spec"]
        spec["selector"]["matchLabels"]["kpng.io/node"] = node.name
        pod = spec["template"]
        pod["metadata"]["labels"]["kpng.io/node"] = node.name
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
        paths = {"host-cgroup": cluster.node_cgroup2(node), "bpffs": ebpf_pin_dir(node)}
        for volume in pod["spec"]["volumes"]:
            if volume["name"] in paths:
                volume["hostPath"]["path"] = str(paths[volume["name"]])
        for container in pod["spec"]["containers"]:
            capabilities = container["securityContext"]["capabilities"]
            capabilities["add"] = [c for c in capabilities["add"] if c in grantable]
        documents.append(daemonset)
        names.append(name)
    return yaml.safe_dump_all(documents, sort_keys=False), names


def grantable_capabilities(status: str | None = None) -> set[str]:
    """Those of to-ebpf's capabilities in this process's bounding set (``/proc/self/status``)."""
    bounding = system.capabilities("CapBnd", status)
    return {name for name, bit in system.CAPABILITIES.items() if bounding >> bit & 1}


def ebpf_pin_dir(node: RealNode) -> Path:
    """The directory of the host's bpffs that ``node``'s to-ebpf sees as /sys/fs/bpf."""
    return node.layout.pins


def rbac_manifest() -> str:
    """deploy/rbac.yaml: kpng's ServiceAccount and what it may read."""
    return _deploy_file("rbac.yaml")


def kpng_manifest(cluster: RealCluster, image: str, *, mode: str = "nftables") -> str:
    """deploy/kpng.yaml as the migration runbook has the operator render it for ``cluster``
    (``envsubst``), in kube-proxy's ``mode``: the runbook edits the raw manifest (its commented
    node selector), where deploy_kpng installs the chart."""
    values = {
        "KPNG_API_SERVER": cluster.server,
        "KPNG_CLUSTER_CIDR": ",".join(cluster.cluster_cidrs),
        "KPNG_IMAGE": image,
    }
    manifest = render(_deploy_file(SHAPES["daemonset"]), values)
    # Nodes are network namespaces of one machine, where only the first may size the machine's
    # conntrack table (as for the kube-proxy baseline below); the timeouts are per namespace.
    sized = "      maxPerCore: null\n"
    assert sized in manifest, "deploy/kpng.yaml no longer sets conntrack.maxPerCore"
    manifest = manifest.replace(sized, "      maxPerCore: 0\n")
    assert "    mode: nftables\n" in manifest, "deploy/kpng.yaml no longer says mode: nftables"
    return manifest.replace("    mode: nftables\n", f"    mode: {mode}\n")


def _prepare_brains(cluster: RealCluster) -> list[str]:
    """deploy/kpng-central.yaml's steps 1 and 2, as its header (and docs/operators/helm.md) tells an
    operator: every node labelled to run a brain, a serving certificate for their addresses (from
    a CA of the test's) in a Secret, the CA in a ConfigMap. Returns the brains' addresses."""
    from rig.cluster import make_pki

    for node in cluster.nodes:
        cluster.kubectl("label", "--overwrite", "node", node.name, "kpng.io/brain=true")
    directory = cluster.workdir / "kpng-brain-pki"
    directory.mkdir(exist_ok=True)
    pki = make_pki(directory, [node.ip for node in cluster.nodes])
    cluster.kubectl(
        "-n", "kube-system", "create", "secret", "tls", "kpng-brain-tls",
        f"--cert={pki.serving_cert}", f"--key={pki.serving_key}",
    )  # fmt: skip
    cluster.kubectl(
        "-n",
        "kube-system",
        "create",
        "configmap",
        "kpng-brain-ca",
        f"--from-file=ca.crt={pki.ca_cert}",
    )
    return [f"tcp://{node.ip}:{BRAIN_PORT}" for node in cluster.nodes]


def wait_rollout(cluster: RealCluster, workload: str, timeout_s: int) -> None:
    """Until every pod of a kube-system ``workload`` (``daemonset/kpng``) is updated and Ready."""
    cluster.kubectl("-n", "kube-system", "rollout", "status", workload, f"--timeout={timeout_s}s")


def kube_proxy_manifests(
    server: str, image: str, mode: str = "nftables", cluster_cidr: str = CLUSTER_CIDR
) -> str:
    """kubeadm's kube-proxy add-on, in ``mode``: its ServiceAccount and RBAC, a ConfigMap with a
    KubeProxyConfiguration and a kubeconfig, and a privileged DaemonSet. ``cluster_cidr``: the
    pod CIDRs, comma-separated (both families' on a dual-stack cluster)."""
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": mode,
        "clusterCIDR": cluster_cidr,
        "clientConnection": {"kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf"},
        "healthzBindAddress": "0.0.0.0:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Nodes are network namespaces of one machine: kube-proxy must not size the machine's
        # conntrack table. Its timeouts are per namespace, so those keep their defaults.
        "conntrack": {"maxPerCore": 0, "min": 0},
    }
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "default",
                "cluster": {
                    "certificate-authority": "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                    "server": server,
                },
            }
        ],
        "users": [
            {
                "name": "default",
                "user": {"tokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"},
            }
        ],
        "contexts": [{"name": "default", "context": {"cluster": "default", "user": "default"}}],
        "current-context": "default",
    }
    documents = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:node-proxier"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node-proxier",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": "kube-proxy", "namespace": "kube-system"}
            ],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
            "data": {
                "config.conf": yaml.safe_dump(config, sort_keys=False),
                "kubeconfig.conf": yaml.safe_dump(kubeconfig, sort_keys=False),
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {
                "name": "kube-proxy",
                "namespace": "kube-system",
                "labels": {"k8s-app": "kube-proxy"},
            },
            "spec": {
                "selector": {"matchLabels": {"k8s-app": "kube-proxy"}},
                "template": {
                    "metadata": {"labels": {"k8s-app": "kube-proxy"}},
                    "spec": {
                        "priorityClassName": "system-node-critical",
                        "serviceAccountName": "kube-proxy",
                        "hostNetwork": True,
                        "nodeSelector": {"kubernetes.io/os": "linux"},
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [
                            {
                                "name": "kube-proxy",
                                "image": image,
                                "imagePullPolicy": "IfNotPresent",
                                "command": [
                                    "/usr/local/bin/kube-proxy",
                                    "--config=/var/lib/kube-proxy/config.conf",
                                    "--hostname-override=$(NODE_NAME)",
                                ],
                                "env": [
                                    {
                                        "name": "NODE_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                    }
                                ],
                                "securityContext": {"privileged": True},
                                "volumeMounts": [
                                    {"name": "kube-proxy", "mountPath": "/var/lib/kube-proxy"}
                                ],
                                "readinessProbe": {
                                    "httpGet": {"path": "/healthz", "port": 10256},
                                    "periodSeconds": 5,
                                },
                            }
                        ],
                        "volumes": [{"name": "kube-proxy", "configMap": {"name": "kube-proxy"}}],
                    },
                },
            },
        },
    ]
    return yaml.safe_dump_all(documents, sort_keys=False)


def deploy_kube_proxy(
    cluster: RealCluster, image: str, *, mode: str = "nftables", timeout_s: int = 180
) -> None:
    manifest = kube_proxy_manifests(
        cluster.server, image, mode, cluster_cidr=",".join(cluster.cluster_cidrs)
    )
    cluster.kubectl("apply", "-f", "-", input=manifest)
    wait_rollout(cluster, "daemonset/kube-proxy", timeout_s)


COREFILE = """\
.:53 {
    errors
    health {
        lameduck 5s
    }
    ready
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }
    cache 30
    loop
    loadbalance
}
"""
"""kubeadm's Corefile without ``forward``: names outside the cluster get no answer, so no query
leaves the machine."""


def coredns_manifests(image: str, cluster_ip: str) -> str:
    """kubeadm's CoreDNS add-on: the ``kube-dns`` Service at the kubelets' clusterDNS address,
    a Deployment of two replicas, and the rights to list and watch what it serves."""
    labels = {"k8s-app": "kube-dns"}
    documents: list[dict[str, object]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:coredns",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
            "data": {"Corefile": COREFILE},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "coredns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "priorityClassName": "system-cluster-critical",
                        "serviceAccountName": "coredns",
                        "dnsPolicy": "Default",
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [
                            {
                                "name": "coredns",
                                "image": image,
                                "imagePullPolicy": "IfNotPresent",
                                "args": ["-conf", "/etc/coredns/Corefile"],
                                "ports": [
                                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                ],
                                "securityContext": {
                                    "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True,
                                },
                                "readinessProbe": {
                                    "httpGet": {"path": "/ready", "port": 8181},
                                    "periodSeconds": 2,
                                },
                                "livenessProbe": {
                                    "httpGet": {"path": "/health", "port": 8080},
                                    "initialDelaySeconds": 60,
                                },
                                "volumeMounts": [
                                    {
                                        "name": "config",
                                        "mountPath": "/etc/coredns",
                                        "readOnly": True,
                                    }
                                ],
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "selector": labels,
                "clusterIP": cluster_ip,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                ],
            },
        },
    ]
    return yaml.safe_dump_all(documents, sort_keys=False)


def deploy_coredns(cluster: RealCluster, image: str, *, timeout_s: int = 180) -> None:
    """CoreDNS, Ready: it reaches the API server through the ``kubernetes`` Service, so this
    also proves the proxy deployed before it works."""
    cluster.kubectl("apply", "-f", "-", input=coredns_manifests(image, CLUSTER_DNS))
    wait_rollout(cluster, "deployment/coredns", timeout_s)


def debug_node(
    cluster: RealCluster, node: str, image: str, argv: Sequence[str], *, timeout_s: float = 90
) -> str:
    """The runbook's (docs/operators/migration.md) ``kubectl debug node/NODE --profile=sysadmin
    --image=IMAGE -- ARGV``: ``argv`` as root in the node's network namespace, in a pod of
    ``image``. Returns its output once it exited, which it must have done with 0; the debugging
    pod, which ``kubectl debug`` leaves, is deleted."""
    prefix = f"node-debugger-{node}-"

    def debuggers() -> set[str]:
        pods = cluster.get("pods")["items"]
        return {p["metadata"]["name"] for p in pods if p["metadata"]["name"].startswith(prefix)}

    before = debuggers()
    cluster.kubectl("debug", f"node/{node}", "--profile=sysadmin", f"--image={image}", "--", *argv)
    (pod,) = debuggers() - before
    try:
        phase = ""

        def exited() -> bool:
            nonlocal phase
            phase = cluster.get("pod", pod)["status"].get("phase", "")
            return phase in ("Succeeded", "Failed")

        until(exited, f"{' '.join(argv)} on {node}", within=timeout_s, interval=0.5)
        output = cluster.kubectl("logs", pod)
        if phase != "Succeeded":
            raise NodeError(f"{' '.join(argv)} failed on {node}: {output.strip()}")
        return output
    finally:
        cluster.kubectl("delete", "pod", pod, "--wait=false", check=False)
