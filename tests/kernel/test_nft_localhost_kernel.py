"""to-nft's node ports on loopback (``--localhost-nodeports``) with packets: two fresh namespaces,
deleted afterwards, the node (to-nft, run inside it: its relay listens in the node's own
loopback) and a pod behind it running the echo server.

    node 10.99.0.1 ---- 10.99.0.2 pod
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

NODE_PORT = 30080
POD = "10.99.0.2"

LOCALHOST = ("127.0.0.0/8", "::1/128", "10.99.0.0/24")
"""kube-proxy's ``localhost`` keyword, and the node's own network."""

# The node's to-nft, in the node's namespace: nft through the command, the state given here.
_NODE = """
import asyncio, sys
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._nftables.layout import Options
from kpng.backends._nftables.localhost import LocalhostProxy
from kpng.model.messages import ServiceEndpoints
from kpng.testing import states

async def main(flag: bool, cidrs: tuple[str, ...]) -> None:
    options = Options(nodeport_addresses=cidrs, localhost_nodeports=flag)
    backend = NftBackend(nft=KernelNft(), options=options, localhost=LocalhostProxy())
    web = ServiceEndpoints(
        states.service("web", node_port=NODE_PORT), (states.endpoint(POD, 8080),)
    )
    try:
        await backend.apply(states.state(1, {"web": web}))
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await backend.close()
"""


def _in(netns: str, *argv: str) -> str:
    run = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True)
    if run.returncode != 0:
        raise AssertionError(f"{argv}: {run.stderr.strip()}")
    return run.stdout


@pytest.fixture
def node(namespaces: Callable[[], str]) -> Iterator[str]:
    """The node's namespace, its pod's echo server answering on 10.99.0.2:8080."""
    node, pod = namespaces(), namespaces()
    _in(node, "ip", "link", "add", "pod0", "type", "veth", "peer", "name", "eth0", "netns", pod)
    for ns, dev, ip in ((node, "pod0", "10.99.0.1/24"), (pod, "eth0", f"{POD}/24")):
        _in(ns, "ip", "addr", "add", ip, "dev", dev)
        _in(ns, "ip", "link", "set", dev, "up")
    echo = subprocess.Popen(
        ["ip", "netns", "exec", pod, sys.executable, "-m", "kpng.testing.echo", "pod", "8080"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert echo.stdout is not None
    try:
        assert echo.stdout.readline().strip() == b"ready"
        yield node
    finally:
        echo.terminate()
        echo.wait(timeout=5)
        echo.stdout.close()


def _probe(netns: str, host: str) -> str:
    argv = [sys.executable, "-m", "kpng.testing.probe", "tcp", host, str(NODE_PORT)]
    out = _in(netns, *argv, "--count", "1", "--timeout", "2")
    result: str = json.loads(out)["results"][0]
    return result


@pytest.mark.parametrize(
    ("flag", "cidrs", "expected"),
    [
        # Relayed from the node's own address: the pod never sees 127.0.0.1.
        pytest.param(True, LOCALHOST, "pod 10.99.0.1", id="localhost-nodeports"),
        pytest.param(False, LOCALHOST, "refused", id="off"),
        # Asked, but no family names loopback: refused by kpng's rule.
        pytest.param(True, ("0.0.0.0/0",), "refused", id="catch-all"),
    ],
)
def test_a_node_port_answers_on_127_0_0_1_only_with_the_flag_and_loopback_named(
    node: str, flag: bool, cidrs: tuple[str, ...], expected: str
) -> None:
    code = f"{_NODE}\nNODE_PORT, POD = {NODE_PORT}, {POD!r}\nasyncio.run(main({flag}, {cidrs!r}))\n"
    driver = subprocess.Popen(
        ["ip", "netns", "exec", node, sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert driver.stdin is not None
    assert driver.stdout is not None
    try:
        assert driver.stdout.readline().strip() == b"ready"
        assert _probe(node, "127.0.0.1") == expected
        # The node's own address is DNATed as ever, whatever the flag.
        assert _probe(node, "10.99.0.1") == "pod 10.99.0.1"
        rules = _in(node, "nft", "list", "table", "inet", "kpng")
        if flag and cidrs == ("0.0.0.0/0",):
            assert "ip daddr 127.0.0.0/8 meta l4proto . tcp dport @nodeport-v4 reject" in rules
    finally:
        driver.stdin.close()
        driver.wait(timeout=10)
        driver.stdout.close()
