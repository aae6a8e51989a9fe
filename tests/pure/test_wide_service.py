"""One Service as wide as Kubernetes lets it be (20,000 ports in 200 EndpointSlices): resolved
and rendered at a cost that grows with its size, not its size squared, while the health port
keeps answering."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kpng.model.cluster import Slice, SliceEndpoint, SlicePort
from kpng.model.messages import IPSet, PortMapping, Service, ServiceIPs
from kpng.resolver.resolving import resolve_service
from kpng.testing.ports import free_port

PORTS = 20_000
SLICES = 200
ENDPOINTS = 5
ANSWER_S = 2.0
"""The longest a /healthz answer may take meanwhile (a loaded CI machine's thread scheduling
included). The pipeline's loop is busy for several seconds rendering 100,000 endpoint elements;
before, the health port answered on that loop, and the resolver's and renderers' quadratic
matching of ports held it 58 s."""
DONE_S = 180.0


def _manifest(path: Path) -> None:
    per = PORTS // SLICES
    items: list[dict[str, object]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"namespace": "default", "name": "wide"},
            "spec": {
                "clusterIP": "10.96.5.5",
                "ports": [
                    {"name": f"p{i}", "port": 1000 + i, "targetPort": 1000 + i}
                    for i in range(PORTS)
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "n0"},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.250.0.1"}]},
        },
    ]
    for s in range(SLICES):
        items.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "namespace": "default",
                    "name": f"wide-{s}",
                    "labels": {"kubernetes.io/service-name": "wide"},
                },
                "addressType": "IPv4",
                "ports": [
                    {"name": f"p{i}", "port": 1000 + i} for i in range(s * per, (s + 1) * per)
                ],
                "endpoints": [
                    {"addresses": [f"10.1.{s}.{e + 1}"], "nodeName": f"n{e}"}
                    for e in range(ENDPOINTS)
                ],
            }
        )
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def _healthz(port: int) -> tuple[float, bytes]:
    """How long /healthz took to answer, and its status line (with the verdict's body)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: kpng\r\nConnection: close\r\n\r\n")
        answer = conn.makefile("rb").read()
    return time.monotonic() - start, answer


@pytest.mark.slow
def test_the_health_port_answers_while_a_wide_service_is_programmed(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    _manifest(tmp_path / "in" / "wide.json")
    port = free_port()
    rules = tmp_path / "rules.nft"
    argv = [sys.executable, "-m", "kpng", "--healthz-bind-address", f"127.0.0.1:{port}"]
    argv += ["file", "--input", str(tmp_path / "in"), "to-local", "--node-name", "n0"]
    argv += ["to-nft", "--dry-run"]
    log = tmp_path / "kpng.log"
    with rules.open("wb") as out, log.open("wb") as err:
        kpng = subprocess.Popen(argv, stdout=out, stderr=err)
    try:
        answers: list[tuple[float, bytes]] = []
        deadline = time.monotonic() + DONE_S
        while time.monotonic() < deadline:
            try:
                answers.append(_healthz(port))
            except ConnectionRefusedError:
                assert kpng.poll() is None, log.read_text()[-2000:]
            if answers and answers[-1][1].startswith(b"HTTP/1.1 200 "):
                break
            time.sleep(0.05)
        assert answers
        assert answers[-1][1].startswith(b"HTTP/1.1 200 "), answers[-3:]
        slow = [(round(took, 2), body[-200:]) for took, body in answers if took > ANSWER_S]
        assert not slow, f"{len(slow)} of {len(answers)} answers slower than {ANSWER_S} s: {slow}"
        # Only then is the busy time over: the rules of the last port were rendered.
        assert f"10.1.{SLICES - 1}.{ENDPOINTS} . {1000 + PORTS - 1}" in rules.read_text()
    finally:
        kpng.terminate()
        kpng.wait(timeout=15)


def test_each_port_of_a_wide_service_takes_its_number_from_the_slices_that_name_it() -> None:
    ports = tuple(PortMapping(Name=f"p{i}", Protocol="TCP", Port=80 + i) for i in range(4))
    service = Service(
        Namespace="ns",
        Name="wide",
        Type="ClusterIP",
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=("10.96.0.1",))),
        Ports=ports,
    )

    def sl(name: str, ip: str, *numbered: tuple[str, int]) -> Slice:
        return Slice(
            namespace="ns",
            name=name,
            service="wide",
            v6=False,
            ports=tuple(SlicePort(name=n, protocol="TCP", port=number) for n, number in numbered),
            endpoints=(SliceEndpoint(ip=ip, node="n1"),),
        )

    resolved = resolve_service(
        service,
        [
            # p0 named twice: its first number counts. p1 in two slices, numbered differently.
            sl("a", "10.0.0.1", ("p0", 8080), ("p0", 9090), ("p1", 8081)),
            sl("b", "10.0.0.2", ("p1", 7071), ("p2", 0)),
            sl("c", "10.0.0.3", ("p3", 8083), ("P3", 1), ("p3", 1)),
        ],
        node="n1",
        zone="",
    )
    served = {
        (ep.IPs.V4[0] if ep.IPs else "", po.Name): po.Port
        for ep in resolved.endpoints
        for po in ep.PortOverrides
    }
    assert served == {
        ("10.0.0.1", "p0"): 8080,
        ("10.0.0.1", "p1"): 8081,
        ("10.0.0.2", "p1"): 7071,
        ("10.0.0.3", "p3"): 8083,
    }
    usable = [bool(p.UsableEndpoints and p.UsableEndpoints.V4) for p in resolved.service.Ports]
    assert usable == [True, True, False, True]
