"""A plugin for tests, as a third party would write one: serves kpng.pluginv1 on a unix socket
and records every change set it gets, with behaviours to choose from.

    python -m tests.plugin_server --socket PATH --record FILE [--wants full|diffs]
        [--encoding protobuf|json] [--refuse N] [--hang] [--delay SECONDS] [--unhealthy MESSAGE]

Each Apply appends one JSON line to FILE: ``{"revision", "full", "config", "ops": [[kind, set,
path], ...], "at"}`` (Configure's bytes are kept for the next Apply; ``at``: the wall time it
came). ``--refuse N`` refuses the first N Applies; ``--hang`` never answers Apply; ``--delay``
takes that long to answer each (a slow data plane).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any, TextIO

import grpc

from kpng.api import localv1_pb2, pluginv1_pb2, pluginv1_pb2_grpc

SERVER_OPTIONS = [("grpc.max_receive_message_length", -1)]


class Recorder(pluginv1_pb2_grpc.PluginServicer):
    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.config = b""
        self.refusals = args.refuse

    async def Describe(self, request: Any, context: Any) -> pluginv1_pb2.DescribeResponse:
        return pluginv1_pb2.DescribeResponse(
            Name="recorder",
            Version="1.0",
            Wants=pluginv1_pb2.DIFFS if self.args.wants == "diffs" else pluginv1_pb2.FULL,
            Encoding=pluginv1_pb2.JSON if self.args.encoding == "json" else pluginv1_pb2.PROTOBUF,
        )

    async def Configure(self, request: Any, context: Any) -> pluginv1_pb2.ConfigureResponse:
        self.config = request.Config
        return pluginv1_pb2.ConfigureResponse()

    async def Apply(self, request: Any, context: Any) -> pluginv1_pb2.ApplyResponse:
        at = time.time()
        if self.args.hang:
            await asyncio.sleep(3600)
        if self.refusals > 0:
            self.refusals -= 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not ready for states yet")
        ops = []
        for op in request.Ops:
            kind = op.WhichOneof("Op")
            if kind == "Set":
                ops.append([kind, op.Set.Ref.Set, op.Set.Ref.Path, _payload(self.args, op)])
            elif kind == "Delete":
                ops.append([kind, op.Delete.Set, op.Delete.Path])
            else:
                ops.append([kind])
        record = {
            "revision": request.Revision,
            "full": request.Full,
            "config": self.config.decode(),
            "ops": ops,
            "at": at,
        }
        self.out.write(json.dumps(record) + "\n")
        await asyncio.sleep(self.args.delay)
        return pluginv1_pb2.ApplyResponse()

    async def Health(self, request: Any, context: Any) -> pluginv1_pb2.HealthResponse:
        if self.args.unhealthy:
            return pluginv1_pb2.HealthResponse(Ok=False, Message=self.args.unhealthy)
        return pluginv1_pb2.HealthResponse(Ok=True)


def _payload(args: argparse.Namespace, op: Any) -> str:
    """The payload's Name or Hostname/IPs, decoded as the plugin asked for it."""
    data = op.Set.Bytes
    if args.encoding == "json":
        value = json.loads(data)
        return str(value.get("Name") or value.get("IPs"))
    if op.Set.Ref.Set == localv1_pb2.ServicesSet:
        return localv1_pb2.Service.FromString(data).Name
    return str(list(localv1_pb2.Endpoint.FromString(data).IPs.V4))


async def serve(args: argparse.Namespace, out: TextIO) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pluginv1_pb2_grpc.add_PluginServicer_to_server(Recorder(args, out), server)
    server.add_insecure_port(f"unix:{args.socket}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--wants", choices=["full", "diffs"], default="full")
    parser.add_argument("--encoding", choices=["protobuf", "json"], default="protobuf")
    parser.add_argument("--refuse", type=int, default=0)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--unhealthy", default="")
    args = parser.parse_args()
    with Path(args.record).open("a", buffering=1) as out:  # a line each, for readers
        asyncio.run(serve(args, out))


if __name__ == "__main__":
    main()
