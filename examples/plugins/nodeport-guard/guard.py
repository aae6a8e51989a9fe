"""nodeport-guard: an example kpng plugin in Python — a NodePort source-IP blocklist.

Traffic from the CIDRs of its configuration to this node's NodePorts is dropped, before kpng's
service rules see it (a DDoS guard). It keeps its rules in its own nftables table, ``inet
kpng-guard``, rewritten whole in one atomic ``nft -f`` transaction after each change set, and
removed when it stops.

    sudo python3 guard.py --socket /run/kpng/plugins/guard.sock
    sudo kpng kube to-local --node-name "$NODE" to-nft to-plugin --plugin-dir /run/kpng/plugins

The configuration (``guard.conf`` beside ``guard.sock`` in a plugin directory, or ``--plugin
guard=unix:///PATH,config=FILE``) is one CIDR per line, IPv4 or IPv6; ``#`` starts a comment. A
configuration with a line that is not a CIDR is refused, and kpng logs why.

The plugin wants DIFFS in protobuf: it keeps each service's node ports, by the service's path.
Needs root, ``nft``, and kpng's Python package (for the generated pluginv1 code).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from kpng.api import localv1_pb2, pluginv1_pb2, pluginv1_pb2_grpc

log = logging.getLogger("nodeport-guard")

TABLE = "kpng-guard"
PROTOCOLS = {localv1_pb2.TCP: "tcp", localv1_pb2.UDP: "udp", localv1_pb2.SCTP: "sctp"}
NodePort = tuple[str, int]
Networks = tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Network]]


class ConfigError(ValueError):
    """A configuration the guard cannot use (the message says which line)."""


def parse_config(data: bytes) -> Networks:
    """The blocked networks of a configuration, each family collapsed (overlaps merged)."""
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    for number, raw in enumerate(data.decode(errors="replace").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            network = ipaddress.ip_network(line, strict=False)
        except ValueError:
            raise ConfigError(f"line {number}: {line!r} is not a CIDR") from None
        if isinstance(network, ipaddress.IPv4Network):
            v4.append(network)
        else:
            v6.append(network)
    return list(ipaddress.collapse_addresses(v4)), list(ipaddress.collapse_addresses(v6))


def node_ports(service: localv1_pb2.Service) -> frozenset[NodePort]:
    return frozenset(
        (PROTOCOLS[port.Protocol], port.NodePort)
        for port in service.Ports
        if port.NodePort and port.Protocol in PROTOCOLS
    )


def _elements(items: Iterable[str]) -> str:
    listed = ", ".join(items)
    return f"\t\telements = {{ {listed} }}\n" if listed else ""


def render(blocked: Networks, ports: Iterable[NodePort]) -> str:
    """The guard's whole table, as one nft transaction that replaces the previous one."""
    v4, v6 = blocked
    port_elements = (f"{proto} . {port}" for proto, port in sorted(set(ports)))
    return (
        f"table inet {TABLE}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        "\tset blocked-v4 {\n\t\ttype ipv4_addr\n\t\tflags interval\n"
        + _elements(str(n) for n in v4)
        + "\t}\n"
        "\tset blocked-v6 {\n\t\ttype ipv6_addr\n\t\tflags interval\n"
        + _elements(str(n) for n in v6)
        + "\t}\n"
        "\tset node-ports {\n\t\ttype inet_proto . inet_service\n"
        + _elements(port_elements)
        + "\t}\n"
        # At raw priority: before conntrack and before kpng's DNAT rewrites the node port.
        "\tchain prerouting {\n"
        "\t\ttype filter hook prerouting priority raw; policy accept;\n"
        "\t\tfib daddr type local ip saddr @blocked-v4 meta l4proto . th dport @node-ports "
        "counter drop\n"
        "\t\tfib daddr type local ip6 saddr @blocked-v6 meta l4proto . th dport @node-ports "
        "counter drop\n"
        "\t}\n"
        "}\n"
    )


async def nft(script: str) -> str | None:
    """Run an nft transaction; None on success, else nft's complaint."""
    proc = await asyncio.create_subprocess_exec(
        "nft", "-f", "-", stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate(script.encode())
    return None if proc.returncode == 0 else err.decode(errors="replace").strip()


class Guard(pluginv1_pb2_grpc.PluginServicer):
    def __init__(self) -> None:
        self.blocked: Networks = ([], [])
        self.services: dict[str, frozenset[NodePort]] = {}
        self.error: str | None = None

    async def Describe(self, request: Any, context: Any) -> pluginv1_pb2.DescribeResponse:
        return pluginv1_pb2.DescribeResponse(
            Name="nodeport-guard",
            Version="1.0.0",
            Wants=pluginv1_pb2.DIFFS,
            Encoding=pluginv1_pb2.PROTOBUF,
        )

    async def Configure(self, request: Any, context: Any) -> pluginv1_pb2.ConfigureResponse:
        try:
            self.blocked = parse_config(request.Config)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"configuration: {exc}")
        v4, v6 = self.blocked
        log.info("blocking %s on node %s", [str(n) for n in v4 + v6] or "nothing", request.NodeName)
        return pluginv1_pb2.ConfigureResponse()

    async def Apply(self, request: Any, context: Any) -> pluginv1_pb2.ApplyResponse:
        for op in request.Ops:
            kind = op.WhichOneof("Op")
            if kind == "Reset":
                self.services.clear()
            elif kind == "Set" and op.Set.Ref.Set == localv1_pb2.ServicesSet:
                service = localv1_pb2.Service.FromString(op.Set.Bytes)
                self.services[op.Set.Ref.Path] = node_ports(service)
            elif kind == "Delete" and op.Delete.Set == localv1_pb2.ServicesSet:
                self.services.pop(op.Delete.Path, None)
        ports = [p for service_ports in self.services.values() for p in service_ports]
        self.error = await nft(render(self.blocked, ports))
        if self.error is not None:
            # Refused: kpng logs this and sends the whole state again, with backoff.
            await context.abort(grpc.StatusCode.INTERNAL, f"nft: {self.error}")
        log.info("revision %d: guarding %d node ports", request.Revision, len(set(ports)))
        return pluginv1_pb2.ApplyResponse()

    async def Health(self, request: Any, context: Any) -> pluginv1_pb2.HealthResponse:
        if self.error is not None:
            return pluginv1_pb2.HealthResponse(Ok=False, Message=f"nft: {self.error}")
        return pluginv1_pb2.HealthResponse(Ok=True)


async def serve(socket: Path) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1)])
    pluginv1_pb2_grpc.add_PluginServicer_to_server(Guard(), server)
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    log.info("listening on unix:%s", socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(None)
        with contextlib.suppress(OSError):
            await nft(f"table inet {TABLE}\ndelete table inet {TABLE}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="a NodePort source-IP blocklist for kpng")
    parser.add_argument("--socket", type=Path, required=True, help="the unix socket to serve")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.socket.unlink(missing_ok=True)  # a socket left by a crash
    try:
        asyncio.run(serve(args.socket))
    finally:
        args.socket.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
