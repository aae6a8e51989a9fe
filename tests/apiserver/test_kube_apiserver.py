"""The kube source against a real kube-apiserver: kpng's node-local state follows the cluster.

kpng runs in process (KubeSource + run_local + a recording backend); objects are written with a
separate client. Each test has its own namespace in the session's control plane; the fault tests
(apiserver killed, 410 Gone) start a control plane of their own, as they stop its apiserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import yaml

from kpng.sources.kube.reflector import BackoffPolicy, ReflectorSettings
from kpng.testing.recording import KpngUnderTest, View, view_of
from kpng.testing.waiting import eventually
from rig import kubeapi as k
from rig.cluster import ControlPlane, ensure_binaries, issue_client_cert
from rig.kubeapi import ApiError, KubeApi
from tests.proxying import ConnectProxy

pytestmark = pytest.mark.apiserver

R = TypeVar("R")
# Fault tests reconnect within a second or two instead of client-go's 0.8-30 s.
FAST = ReflectorSettings(backoff=BackoffPolicy(initial=0.1, maximum=1.0, jitter=0.5))
PROXY_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"


async def call(fn: Callable[..., R], *args: Any) -> R:
    """A blocking API call off the event loop, so kpng keeps reading its watches meanwhile."""
    return await asyncio.to_thread(fn, *args)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 100))


def has(view: View, name: str, ips: tuple[str, ...] | None = None) -> bool:
    return name in view and (ips is None or view[name] == ips)


def test_services_and_slices_created_updated_deleted(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace

    async def scenario() -> None:
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {})
            await call(kube_api.create, k.service("web", ns))
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ()})
            eps = [k.endpoint("10.1.0.1", node="n1"), k.endpoint("10.1.0.2", node="n2")]
            await call(kube_api.create, k.endpoint_slice("web-a", ns, "web", eps))
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.1.0.1", "10.1.0.2")})
            # A second slice of the same service, then an update of the first.
            await call(
                kube_api.create, k.endpoint_slice("web-b", ns, "web", [k.endpoint("10.1.0.3")])
            )
            await kpng.wait_for(lambda v: v[f"{ns}/web"] == ("10.1.0.1", "10.1.0.2", "10.1.0.3"))
            await call(
                kube_api.patch,
                "EndpointSlice",
                ns,
                "web-a",
                {"endpoints": [k.endpoint("10.1.0.9", node="n1")]},
            )
            await kpng.wait_for(lambda v: v[f"{ns}/web"] == ("10.1.0.3", "10.1.0.9"))
            # A Service update that changes the node's state: a new port.
            ports = [{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}]
            await call(kube_api.patch, "Service", ns, "web", {"spec": {"ports": ports}})
            await kpng.wait_for(
                lambda _: any(
                    len(e.service.Ports) == 2
                    for key, e in kpng.backend.states[-1].services.items()
                    if key == (ns, "web")
                )
            )
            await call(kube_api.delete, "EndpointSlice", ns, "web-a")
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.1.0.3",)})
            await call(kube_api.delete, "Service", ns, "web")
            await kpng.wait_for(lambda v: v == {})

    run(scenario)


def test_service_cidrs_are_followed(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    """The API server's own ServiceCIDR ("kubernetes", its --service-cluster-ip-range) and one
    added and deleted later reach the store."""
    from rig.cluster import SERVICE_CIDR

    name = f"{kube_namespace}-extra"[-60:]

    def cidrs(kpng: KpngUnderTest) -> dict[str, tuple[str, ...]]:
        return {n: sc.cidrs for n, sc in kpng.store.service_cidrs.items()}

    async def scenario() -> None:
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=kube_namespace) as kpng:
            await kpng.wait_for(lambda _: cidrs(kpng).get("kubernetes") == (SERVICE_CIDR,))
            extra = {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "ServiceCIDR",
                "metadata": {"name": name},
                "spec": {"cidrs": ["10.100.7.0/24"]},
            }
            await call(kube_api.create, extra)
            await kpng.wait_for(lambda _: cidrs(kpng).get(name) == ("10.100.7.0/24",))
            await call(kube_api.delete, "ServiceCIDR", "", name)
            await kpng.wait_for(lambda _: name not in cidrs(kpng))

    run(scenario)


def test_service_label_flips_both_ways(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace

    async def scenario() -> None:
        await call(kube_api.create, k.service("web", ns))
        await call(kube_api.create, k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.2.0.1")]))
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.2.0.1",)})
            for label in (PROXY_LABEL, HEADLESS_LABEL):
                await call(
                    kube_api.patch, "Service", ns, "web", {"metadata": {"labels": {label: "x"}}}
                )
                await kpng.wait_for(lambda v: v == {})
                await call(
                    kube_api.patch, "Service", ns, "web", {"metadata": {"labels": {label: None}}}
                )
                await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.2.0.1",)})

    run(scenario)


def test_slice_label_flips_both_ways(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace

    async def scenario() -> None:
        await call(kube_api.create, k.service("web", ns))
        await call(kube_api.create, k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.3.0.1")]))
        await call(kube_api.create, k.endpoint_slice("web-b", ns, "web", [k.endpoint("10.3.0.2")]))
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            both = {f"{ns}/web": ("10.3.0.1", "10.3.0.2")}
            await kpng.wait_for(lambda v: v == both)
            for label in (PROXY_LABEL, HEADLESS_LABEL):
                patch: k.Obj = {"metadata": {"labels": {label: "x"}}}
                await call(kube_api.patch, "EndpointSlice", ns, "web-a", patch)
                await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.3.0.2",)})
                patch = {"metadata": {"labels": {label: None}}}
                await call(kube_api.patch, "EndpointSlice", ns, "web-a", patch)
                await kpng.wait_for(lambda v: v == both)

    run(scenario)


def test_headless_and_foreign_objects_never_reach_kpng(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace

    async def scenario() -> None:
        await call(kube_api.create, k.service("web", ns))
        await call(kube_api.create, k.service("none", ns, cluster_ip="None"))
        await call(kube_api.create, k.service("theirs", ns, labels={PROXY_LABEL: "other"}))
        await call(kube_api.create, k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.4.0.1")]))
        headless = k.endpoint_slice(
            "web-h", ns, "web", [k.endpoint("10.4.0.2")], labels={HEADLESS_LABEL: ""}
        )
        await call(kube_api.create, headless)
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.4.0.1",)})
            # Filtered by the server: the reflectors never even saw them.
            known = {
                r.name: {key for key in r.known if key[0] == ns} for r in kpng.source.reflectors
            }
            assert known["Service"] == {(ns, "web")}
            assert known["EndpointSlice"] == {(ns, "web-a")}

    run(scenario)


def test_service_proxy_name_selects_exactly_its_objects(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace
    mine = {PROXY_LABEL: "mine"}

    async def scenario() -> None:
        await call(kube_api.create, k.service("ours", ns, labels=mine))
        await call(kube_api.create, k.service("default", ns))
        await call(kube_api.create, k.service("theirs", ns, labels={PROXY_LABEL: "theirs"}))
        ours_slice = k.endpoint_slice("ours-a", ns, "ours", [k.endpoint("10.5.0.1")], labels=mine)
        await call(kube_api.create, ours_slice)
        # A slice of our Service without our label is not ours.
        await call(
            kube_api.create, k.endpoint_slice("ours-b", ns, "ours", [k.endpoint("10.5.0.2")])
        )
        async with KpngUnderTest.start(
            control_plane.kubeconfig, namespace=ns, proxy_name="mine"
        ) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/ours": ("10.5.0.1",)})
            await call(kube_api.patch, "Service", ns, "default", {"metadata": {"labels": mine}})
            await kpng.wait_for(lambda v: set(v) == {f"{ns}/ours", f"{ns}/default"})

    run(scenario)


def test_objects_kpng_cannot_use_are_skipped(
    control_plane: ControlPlane,
    kube_api: KubeApi,
    kube_namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Objects the API accepts but that give kpng nothing to serve: a slice for a Service that
    does not exist, a slice port without a number. The rest is served, kpng keeps running."""
    ns = kube_namespace

    def _orphan_message(name: str, service: str) -> str:
        return f"EndpointSlice {ns}/{name}: Service {ns}/{service} is missing or not served"

    async def scenario() -> None:
        await call(kube_api.create, k.service("web", ns))
        await call(
            kube_api.create, k.endpoint_slice("orphan", ns, "missing", [k.endpoint("10.6.0.9")])
        )
        no_port = k.endpoint_slice(
            "web-a", ns, "web", [k.endpoint("10.6.0.1")], ports=[{"name": "http"}]
        )
        await call(kube_api.create, no_port)
        async with KpngUnderTest.start(
            control_plane.kubeconfig, namespace=ns, orphan_check_s=0.2
        ) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ()})
            await call(
                kube_api.create, k.endpoint_slice("web-b", ns, "web", [k.endpoint("10.6.0.2")])
            )
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.6.0.2",)})
            # An orphan that arrives by watch is reported too, once, after a grace period.
            await call(
                kube_api.create, k.endpoint_slice("late", ns, "gone", [k.endpoint("10.6.0.3")])
            )
            await eventually(lambda: _orphan_message("late", "gone") in caplog.text, "a report")
            await asyncio.sleep(0.6)  # three more checks

    with caplog.at_level(logging.WARNING):
        run(scenario)
    assert caplog.text.count(_orphan_message("orphan", "missing")) == 1
    assert caplog.text.count(_orphan_message("late", "gone")) == 1


def test_a_slice_with_1000_endpoints(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace
    ips = [f"10.7.{i // 250}.{i % 250 + 1}" for i in range(1000)]

    async def scenario() -> None:
        await call(kube_api.create, k.service("big", ns))
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/big": ()})
            # Created while watched: one watch event of about 200 KB on one line.
            endpoints = [k.endpoint(ip, node=f"n{i % 3}") for i, ip in enumerate(ips)]
            await call(kube_api.create, k.endpoint_slice("big-a", ns, "big", endpoints))
            await kpng.wait_for(lambda v: len(v[f"{ns}/big"]) == 1000)
            assert kpng.view[f"{ns}/big"] == tuple(sorted(ips))
            # And listed: a restarted kpng reads it from a list page.
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: len(v.get(f"{ns}/big", ())) == 1000)

    run(scenario)


def test_kpng_command_follows_the_cluster(
    control_plane: ControlPlane,
    kube_api: KubeApi,
    kube_namespace: str,
    kpng_command: list[str],
    subprocess_env: dict[str, str],
) -> None:
    ns = kube_namespace
    kube_api.create(k.service("web", ns))
    kube_api.create(k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.8.0.1", node="n1")]))
    argv = [
        *kpng_command,
        "--log-level",
        "warning",
        "kube",
        "--kubeconfig",
        str(control_plane.kubeconfig),
        "to-local",
        "--node-name",
        "n1",
        "to-json",
        "--output",
        "-",
    ]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env
    ) as proc:
        try:
            assert proc.stdout is not None

            def next_state() -> dict[str, list[str]]:
                line = proc.stdout.readline() if proc.stdout else b""
                assert line, "kpng ended"
                state = msgspec.json.decode(line)
                return {
                    s["service"]["Name"]: sorted(
                        ip for e in s["endpoints"] for ip in e["IPs"]["V4"]
                    )
                    for s in state["services"]
                    if s["service"]["Namespace"] == ns
                }

            assert next_state() == {"web": ["10.8.0.1"]}
            kube_api.create(
                k.endpoint_slice("web-b", ns, "web", [k.endpoint("10.8.0.2", node="n2")])
            )
            assert next_state() == {"web": ["10.8.0.1", "10.8.0.2"]}
        finally:
            proc.terminate()
            proc.wait(10)
    assert proc.returncode == 0


# --- faults: each with a control plane of its own


@pytest.fixture
def own_control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    watch_cache = getattr(request, "param", True)
    with ControlPlane(ensure_binaries(), watch_cache=watch_cache) as plane:
        yield plane


async def _change_behind_kpngs_back(plane: ControlPlane, ns: str, *, compact: bool) -> None:
    """With kpng's apiserver down: change the cluster through a second apiserver on the same
    etcd, optionally compact etcd's history, stop the second one, restart the first."""
    port = plane.apiserver_port
    await call(plane.stop_apiserver)
    other = await call(plane.start_apiserver)
    api = KubeApi.of(plane, other)
    try:
        await call(api.delete, "Service", ns, "gone")
        await call(api.delete, "EndpointSlice", ns, "gone-a")
        await call(api.create, k.service("new", ns))
        await call(api.create, k.endpoint_slice("new-a", ns, "new", [k.endpoint("10.9.0.3")]))
        await call(
            api.patch, "EndpointSlice", ns, "kept-a", {"endpoints": [k.endpoint("10.9.0.11")]}
        )
        if compact:
            await call(plane.compact_etcd)
    finally:
        api.close()
        await call(plane.stop_apiserver, other)
    await call(plane.start_apiserver, port)


async def _populate(plane: ControlPlane, ns: str) -> None:
    api = KubeApi.of(plane)
    try:
        await call(api.ensure_namespace, ns)
        for name, ip in (("gone", "10.9.0.1"), ("kept", "10.9.0.2")):
            await call(api.create, k.service(name, ns))
            await call(api.create, k.endpoint_slice(f"{name}-a", ns, name, [k.endpoint(ip)]))
    finally:
        api.close()


BEFORE = {"f/gone": ("10.9.0.1",), "f/kept": ("10.9.0.2",)}
AFTER = {"f/kept": ("10.9.0.11",), "f/new": ("10.9.0.3",)}


def test_apiserver_killed_and_restarted_with_changes_meanwhile(
    own_control_plane: ControlPlane,
) -> None:
    plane = own_control_plane

    async def scenario() -> None:
        await _populate(plane, "f")
        async with KpngUnderTest.start(plane.kubeconfig, namespace="f", settings=FAST) as kpng:
            await kpng.wait_for(lambda v: v == BEFORE)
            seen = len(kpng.backend.states)
            await call(plane.stop_apiserver)  # SIGKILL mid-watch
            await asyncio.sleep(1.5)
            # The outage changes nothing: the last state keeps being served. States may still
            # arrive from before the kill (the fresh apiserver reconciles default/kubernetes),
            # so each later one is checked rather than counted.
            assert [view_of(s.services, "f") for s in kpng.backend.states[seen:]] == [
                BEFORE for _ in kpng.backend.states[seen:]
            ]
            assert kpng.view == BEFORE
            await _change_behind_kpngs_back(plane, "f", compact=False)
            await kpng.wait_for(lambda v: v == AFTER)
            # And stays so: no phantom object comes back later.
            await asyncio.sleep(1.0)
            assert kpng.view == AFTER

    run(scenario)


@pytest.mark.parametrize("own_control_plane", [False], indirect=True, ids=["no-watch-cache"])
def test_410_gone_after_compaction_relists_and_deletes_what_was_missed(
    own_control_plane: ControlPlane,
) -> None:
    plane = own_control_plane

    async def scenario() -> None:
        await _populate(plane, "f")
        async with KpngUnderTest.start(plane.kubeconfig, namespace="f", settings=FAST) as kpng:
            await kpng.wait_for(lambda v: v == BEFORE)
            reflectors = {r.name: r for r in kpng.source.reflectors}
            await _change_behind_kpngs_back(plane, "f", compact=True)
            await kpng.wait_for(lambda v: v == AFTER)
            # The watches resumed from compacted resourceVersions: 410, then a relist.
            assert reflectors["Service"].stats.relists_gone >= 1
            assert reflectors["EndpointSlice"].stats.relists_gone >= 1
            await asyncio.sleep(1.0)
            assert kpng.view == AFTER

    run(scenario)


def test_kpng_command_reports_an_unreachable_server_and_keeps_trying(
    own_control_plane: ControlPlane, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    """Started while its apiserver is down, kpng logs why and comes up when the server does."""
    plane = own_control_plane
    port = plane.apiserver_port
    api = KubeApi.of(plane)
    api.create(k.service("web", "default"))
    api.close()
    plane.stop_apiserver()
    argv = [*kpng_command, "kube", "--kubeconfig", str(plane.kubeconfig)]
    argv += ["to-local", "--node-name", "n1", "to-json", "--output", "-"]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env
    ) as proc:
        try:
            assert proc.stderr is not None
            assert proc.stdout is not None
            line = proc.stderr.readline().decode()
            while "cannot list" not in line:
                assert line, "kpng ended"
                line = proc.stderr.readline().decode()
            assert f"cannot connect to https://127.0.0.1:{port}" in line
            plane.start_apiserver(port)
            state = msgspec.json.decode(proc.stdout.readline())
            assert "web" in [s["service"]["Name"] for s in state["services"]]
        finally:
            proc.terminate()
            proc.wait(10)


def test_env_kubeconfig_is_used(
    control_plane: ControlPlane, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    env = {**subprocess_env, "KUBECONFIG": f"/nonexistent{os.pathsep}{control_plane.kubeconfig}"}
    done = subprocess.run(
        [*kpng_command, "kube", "--context", "kpng-cert", "to-file", "--output", "-", "--once"],
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert b'"Name":"kubernetes"' in done.stdout


def test_lists_and_watches_go_through_the_environments_proxy_as_client_go_s_do(
    control_plane: ControlPlane,
    kube_api: KubeApi,
    kube_namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No proxy-url: ``HTTPS_PROXY`` is used, unless ``NO_PROXY`` names the server. The server
    is named (a loopback address is never proxied), and only the proxy resolves the name."""
    proxy = ConnectProxy(hosts={"api.proxied.test": "127.0.0.1"})
    ns = kube_namespace

    async def scenario() -> None:
        async with proxy.running() as port:
            config = yaml.safe_load(control_plane.kubeconfig.read_text())
            for cluster in config["clusters"]:
                server = cluster["cluster"]["server"]
                cluster["cluster"]["server"] = server.replace("127.0.0.1", "api.proxied.test")
                cluster["cluster"]["tls-server-name"] = "127.0.0.1"
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump(config))
            monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{port}")
            monkeypatch.setenv("NO_PROXY", "localhost,.svc,10.0.0.0/8")
            async with KpngUnderTest.start(kubeconfig, namespace=ns) as kpng:
                await kpng.wait_for(lambda v: v == {})
                await call(kube_api.create, k.service("web", ns))
                await kpng.wait_for(lambda v: v == {f"{ns}/web": ()})

    run(scenario)
    assert proxy.asked
    assert all(a.startswith("CONNECT api.proxied.test:") for a in proxy.asked), proxy.asked


def test_lists_and_watches_go_through_the_kubeconfigs_proxy(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str, tmp_path: Path
) -> None:
    """``proxy-url``: every request goes through a CONNECT tunnel of the proxy, and the watch's
    events still stream through it."""
    proxy = ConnectProxy()
    ns = kube_namespace

    async def scenario() -> None:
        async with proxy.running() as port:
            config = yaml.safe_load(control_plane.kubeconfig.read_text())
            for cluster in config["clusters"]:
                cluster["cluster"]["proxy-url"] = f"http://127.0.0.1:{port}"
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump(config))
            async with KpngUnderTest.start(kubeconfig, namespace=ns) as kpng:
                await kpng.wait_for(lambda v: v == {})
                await call(kube_api.create, k.service("web", ns))
                await kpng.wait_for(lambda v: v == {f"{ns}/web": ()})

    run(scenario)
    server = control_plane.kubeconfig.read_text()
    assert proxy.asked
    assert all(a.startswith("CONNECT 127.0.0.1:") for a in proxy.asked), proxy.asked
    assert all(a.split()[1] in server for a in proxy.asked)


def test_exec_credential_plugin(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str, tmp_path: Path
) -> None:
    """A kubeconfig whose user is an exec plugin (client.authentication.k8s.io/v1) that prints
    the token; the plugin's output is all kpng has to authenticate with."""
    ns = kube_namespace
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": control_plane.token},
    }
    kubeconfig = tmp_path / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "exec",
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": control_plane.server,
                    "certificate-authority": str(control_plane.pki.ca_cert),
                },
            }
        ],
        "users": [
            {
                "name": "plugin",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": sys.executable,
                        "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
        "contexts": [{"name": "exec", "context": {"cluster": "c", "user": "plugin"}}],
    }
    kubeconfig.write_text(json.dumps(config))
    kube_api.create(k.service("web", ns))

    async def scenario() -> None:
        async with KpngUnderTest.start(kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ()})

    run(scenario)


# Watches end every 1-2 s, so that requests made with a new certificate come soon.
ROTATING = ReflectorSettings(watch_timeout_s=1, backoff=FAST.backoff)
SHORT_LIVED = datetime.timedelta(seconds=8)


def _kubeconfig(plane: ControlPlane, path: Path, user: dict[str, Any]) -> Path:
    return k.write_kubeconfig(path, server=plane.server, ca=plane.pki.ca_cert, user=user)


def _replace(path: Path, content: bytes) -> None:
    """As rotators do: the new file is renamed over the old one, never seen half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


async def _past(moment: datetime.datetime, margin_s: float) -> None:
    delay = (moment - datetime.datetime.now(datetime.UTC)).total_seconds() + margin_s
    await asyncio.sleep(max(0.0, delay))


def test_client_certificate_files_rotated(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str, tmp_path: Path
) -> None:
    """The kubeconfig names client certificate and key files that a rotator rewrites before the
    certificate expires (kubelet's kubelet-client-current.pem, cert-manager): kpng goes on past
    the first certificate's end."""
    ns = kube_namespace
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    first = issue_client_cert(control_plane.pki, valid_for=SHORT_LIVED)
    _replace(cert, first.cert_pem)
    _replace(key, first.key_pem)
    kubeconfig = _kubeconfig(
        control_plane,
        tmp_path / "kubeconfig",
        {"client-certificate": str(cert), "client-key": str(key)},
    )
    kube_api.create(k.service("before", ns))

    async def scenario() -> None:
        async with KpngUnderTest.start(kubeconfig, namespace=ns, settings=ROTATING) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/before": ()})
            fresh = issue_client_cert(control_plane.pki)
            _replace(cert, fresh.cert_pem)
            _replace(key, fresh.key_pem)
            # Past the first certificate's end and the watches opened before it.
            await _past(first.not_after, 3.0)
            await call(kube_api.create, k.service("after", ns))
            await kpng.wait_for(lambda v: f"{ns}/after" in v)

    run(scenario)


_CERT_PLUGIN = """
import os, pathlib, sys
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text()) if runs.exists() else 0
# atomically: the test (or a second run) may read the count while this run writes it
written = runs.with_name(f"runs.{os.getpid()}")
written.write_text(str(n + 1))
written.replace(runs)
print(pathlib.Path(sys.argv[2 if n == 0 else 3]).read_text())
"""


def test_exec_plugin_client_certificate_renewed(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str, tmp_path: Path
) -> None:
    """An exec plugin that returns a client certificate, short-lived on its first run and fresh
    on later ones: once the server rejects the first, kpng runs the plugin again and uses the
    certificate it gets."""
    ns = kube_namespace
    first = issue_client_cert(control_plane.pki, valid_for=SHORT_LIVED)
    fresh = issue_client_cert(control_plane.pki)
    credentials = []
    for name, issued in (("first", first), ("fresh", fresh)):
        path = tmp_path / f"{name}.json"
        status = {
            "clientCertificateData": issued.cert_pem.decode(),
            "clientKeyData": issued.key_pem.decode(),
        }
        credential = {
            "apiVersion": "client.authentication.k8s.io/v1",
            "kind": "ExecCredential",
            "status": status,
        }
        path.write_text(json.dumps(credential))
        credentials.append(str(path))
    runs = tmp_path / "runs"
    kubeconfig = _kubeconfig(
        control_plane,
        tmp_path / "kubeconfig",
        {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": sys.executable,
                "args": ["-c", _CERT_PLUGIN, str(runs), *credentials],
                "interactiveMode": "Never",
            }
        },
    )
    kube_api.create(k.service("before", ns))

    async def scenario() -> None:
        async with KpngUnderTest.start(kubeconfig, namespace=ns, settings=ROTATING) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/before": ()})
            await _past(first.not_after, 3.0)
            await call(kube_api.create, k.service("after", ns))
            await kpng.wait_for(lambda v: f"{ns}/after" in v)
        assert int(runs.read_text()) >= 2

    run(scenario)


def test_to_local_watches_only_its_own_node(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    me, other = f"{kube_namespace}-me", f"{kube_namespace}-other"

    async def scenario() -> None:
        await call(kube_api.create, k.node(me, zone="zone-a"))
        await call(kube_api.create, k.node(other, zone="zone-b"))
        async with KpngUnderTest.start(
            control_plane.kubeconfig, node_name=me, namespace=kube_namespace
        ) as kpng:
            await kpng.wait_for(lambda v: v == {})
            # the API server filtered: the other node never reached kpng's memory
            assert set(kpng.store.nodes) == {me}
            assert kpng.store.nodes[me].Labels["topology.kubernetes.io/zone"] == "zone-a"

    run(scenario)


def test_a_node_marked_for_removal_is_draining(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    """The autoscaler's taint, then a deletion held by a finalizer: /healthz drains on both."""
    me = f"{kube_namespace}-draining"
    held = k.node(me)
    held["metadata"]["finalizers"] = ["kpng.test/hold"]

    async def scenario() -> None:
        await call(kube_api.create, held)
        try:
            async with KpngUnderTest.start(
                control_plane.kubeconfig, node_name=me, namespace=kube_namespace
            ) as kpng:
                await kpng.wait_for(lambda v: v == {})
                assert not kpng.store.nodes[me].Draining
                taint = {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}
                await call(kube_api.patch, "Node", "", me, {"spec": {"taints": [taint]}})
                await eventually(lambda: kpng.store.nodes[me].Draining, "the taint")
                await call(kube_api.patch, "Node", "", me, {"spec": {"taints": None}})
                await eventually(lambda: not kpng.store.nodes[me].Draining, "the taint gone")
                await call(kube_api.delete, "Node", "", me)
                await eventually(lambda: kpng.store.nodes[me].Draining, "the deletion")
        finally:
            await call(kube_api.patch, "Node", "", me, {"metadata": {"finalizers": None}})
            with contextlib.suppress(ApiError):  # gone already when the test got that far
                await call(kube_api.delete, "Node", "", me)

    run(scenario)
