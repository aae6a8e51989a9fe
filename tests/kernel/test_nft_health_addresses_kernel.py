"""Health check node ports with --nodeport-addresses primary, on a real to-nft in a network
namespace: the check answers on the node's primary IP only (the choice of addresses, as a table:
tests/pure/test_nft_health_addresses.py)."""

from __future__ import annotations

import json
import subprocess
import sys

_BACKEND = """
import asyncio, json
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._healthchecks import HealthServers
from kpng.backends._nftables.layout import FromNode, Options
from kpng.backends.registry import NodeState
from kpng.model.messages import Endpoint, IPSet, Service, ServiceEndpoints

async def get(host):
    try:
        reader, writer = await asyncio.open_connection(host, 32001)
    except OSError:
        return "refused"
    writer.write(b"GET /healthz HTTP/1.1\\r\\nHost: n\\r\\n\\r\\n")
    data = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    return data.split(b"\\r\\n")[0].decode()

async def main():
    backend = NftBackend(
        nft=KernelNft(), options=Options(), from_node=FromNode(primary_nodeports=True),
        health=HealthServers(),
    )
    ep = Endpoint(IPs=IPSet(V4=("10.1.0.2",)), Local=True, Ready=True)
    services = {("ns", "lb"): ServiceEndpoints(Service(Namespace="ns", Name="lb",
                HealthCheckNodePort=32001), (ep,))}
    state = NodeState(node="n", revision=1, services=services, updated=frozenset(services),
                      deleted=frozenset(), node_ips=("10.0.0.5",))
    await backend.apply(state)
    print(json.dumps([await get("10.0.0.5"), await get("192.0.2.7")]))
    await backend.close()

asyncio.run(main())
"""


def test_primary_node_ports_keep_health_checks_on_the_primary_ip(netns: str) -> None:
    for address in ("10.0.0.5/24", "192.0.2.7/24"):
        subprocess.run(
            ["ip", "netns", "exec", netns, "ip", "addr", "add", address, "dev", "lo"], check=True
        )
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", _BACKEND],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["HTTP/1.1 200 OK", "refused"]
