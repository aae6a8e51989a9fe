"""The HTTP side of ``Status``: ``/healthz`` and ``/livez`` on one address, ``/metrics`` on
another (or the same), as kube-proxy splits them: health is asked by load balancers on a node
address, metrics are scraped on an address operators choose.

The metrics address also answers ``/livez`` and the state view, ``/debug/state``,
``/debug/explain`` and ``/debug/rules``: they show every Service and endpoint of the node, which
is why they are there (loopback by default) and never on the health address, which load
balancers reach."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from kpng.addresses import host_port
from kpng.api.lines import node_state_line
from kpng.errors import KpngError, UsageError
from kpng.status import ShowsRules, Status

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.Response]]


@dataclass(frozen=True)
class HttpAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, *, flag: str) -> HttpAddress:
        """``HOST:PORT``, ``[IPV6]:PORT`` or ``:PORT`` (every address)."""
        parsed = host_port(text, port_zero=True)
        if parsed is None:
            raise UsageError(f"{flag} wants HOST:PORT, got {text!r}")
        return cls(*parsed)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _health_handler(status: Status, live_only: bool) -> _Handler:
    answers = status.counters.livez if live_only else status.counters.healthz

    async def handle(_: web.Request) -> web.Response:
        verdict = status.verdict()
        ok = verdict.live if live_only else verdict.healthy
        answers[200 if ok else 503] += 1
        return web.Response(
            status=200 if ok else 503,
            text=json.dumps(verdict.body),
            content_type="application/json",
        )

    return handle


def _metrics_handler(status: Status) -> _Handler:
    # prometheus_client costs some 50 ms to import: only when metrics are asked for.
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from kpng.status.metrics import registry

    reg = registry(status)

    async def handle(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(reg))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return handle


async def _ping(_: web.Request) -> web.Response:
    # kube-proxy's metrics server answers /healthz with its HTTP server's own check, "ok"
    # whenever it answers: whether the rules are current is the health address' question.
    return web.Response(text="ok")


def _proxy_mode_handler(status: Status) -> _Handler:
    async def handle(_: web.Request) -> web.Response:
        # kube-proxy answers its mode ("nftables"); kpng's mode is its backends.
        return web.Response(text=",".join(status.fanout_names()) or "none")

    return handle


def _debug_handlers(status: Status) -> list[web.RouteDef]:
    async def state(_: web.Request) -> web.Response:
        state = status.last_state
        if state is None:
            return web.Response(status=503, text="no state given to the backends yet\n")
        # to-json's line (kpng.backends.json), encoded anew: a request, not every revision.
        services = (msgspec.json.encode(state.services[k]) for k in sorted(state.services))
        line = node_state_line(state.node, state.revision, state.facts, services)
        return web.Response(body=line, content_type="application/json")

    async def explain(request: web.Request) -> web.Response:
        if status.explain is None:
            return web.Response(
                status=404,
                text="this kpng gets node-local states from a brain, which alone knows why: "
                "ask the brain's /debug/explain\n",
            )
        node = request.query.get("node") or status.node
        namespace, slash, name = request.query.get("service", "").partition("/")
        if not node or not slash or not namespace or not name:
            usage = "service=NAMESPACE/NAME" + ("" if status.node else "&node=NODE")
            return web.Response(status=400, text=f"ask /debug/explain?{usage}\n")
        if not status.sources_synced:
            return web.Response(status=503, text="the sources have not synced yet\n")
        # On the loop, not in a thread: the store changes on the loop. One Service costs a pass
        # over the slices, some 20 ms at 100k.
        return web.Response(
            body=status.explain(node, (namespace, name)), content_type="application/json"
        )

    async def rules(_: web.Request) -> web.Response:
        parts = []
        for feeder in status.feeders():
            if isinstance(feeder.backend, ShowsRules):
                try:
                    text = await feeder.backend.applied_rules()
                except KpngError as exc:
                    text = f"# cannot list them: {exc}\n"
                parts.append(f"# {feeder.name}\n{text}")
        if not parts:
            return web.Response(status=404, text="no backend here programs the kernel\n")
        return web.Response(text="".join(parts))

    return [
        web.get("/debug/state", state),
        web.get("/debug/explain", explain),
        web.get("/debug/rules", rules),
    ]


async def serve(
    status: Status, *, healthz: HttpAddress | None, metrics: HttpAddress | None
) -> None:
    """Answer until cancelled. A port already taken is an error at start, not a silent gap."""
    routes: dict[HttpAddress, list[web.RouteDef]] = {}
    if healthz is not None:
        routes.setdefault(healthz, []).extend(
            [
                web.get("/healthz", _health_handler(status, live_only=False)),
                web.get("/livez", _health_handler(status, live_only=True)),
            ]
        )
    if metrics is not None:
        routes.setdefault(metrics, []).extend(
            [
                web.get("/metrics", _metrics_handler(status)),
                # Where kube-proxy tells its mode; scripts and upstream's e2e tests read it.
                web.get("/proxyMode", _proxy_mode_handler(status)),
                *_debug_handlers(status),
            ]
        )
        if metrics != healthz:
            routes[metrics].append(web.get("/healthz", _ping))
            routes[metrics].append(web.get("/livez", _health_handler(status, live_only=True)))
    runners: list[web.AppRunner] = []
    try:
        for address, defs in routes.items():
            try:
                sock = _bind(address)
            except OSError as exc:
                raise KpngError(f"cannot serve HTTP on {address}: {exc.strerror}") from exc
            app = web.Application()
            app.add_routes(defs)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.SockSite(runner, sock).start()
            host, port = sock.getsockname()[:2]
            paths = ", ".join(d.path for d in defs if isinstance(d, web.RouteDef))
            log.info("serving %s on http://%s", paths, HttpAddress(host, port))
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def _bind(address: HttpAddress) -> socket.socket:
    if not address.host:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", address.port), family=socket.AF_INET6, dualstack_ipv6=True
            )
        return socket.create_server(("", address.port))
    family = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address.host, address.port), family=family)
