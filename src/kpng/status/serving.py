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
from dataclasses import dataclass

import msgspec

from kpng.addresses import host_port
from kpng.api.lines import node_state_line
from kpng.errors import KpngError, UsageError, object_name
from kpng.http1.server import Handler, Listener, Reply, Request
from kpng.http1.server import serve as serve_http
from kpng.status import ShowsRules, Status, metrics
from kpng.status.exposition import CONTENT_TYPE

log = logging.getLogger(__name__)

_JSON = "application/json"


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


def _health_handler(status: Status, live_only: bool) -> Handler:
    answers = status.counters.livez if live_only else status.counters.healthz

    async def handle(_: Request) -> Reply:
        verdict = status.verdict()
        ok = verdict.live if live_only else verdict.healthy
        answers[200 if ok else 503] += 1
        return Reply(200 if ok else 503, json.dumps(verdict.body), _JSON)

    return handle


def _metrics_handler(status: Status) -> Handler:
    async def handle(_: Request) -> Reply:
        return Reply(body=metrics.scrape(status), content_type=CONTENT_TYPE)

    return handle


async def _ping(_: Request) -> Reply:
    # kube-proxy's metrics server answers /healthz with its HTTP server's own check, "ok"
    # whenever it answers: whether the rules are current is the health address' question.
    return Reply(body="ok")


def _proxy_mode_handler(status: Status) -> Handler:
    async def handle(_: Request) -> Reply:
        # kube-proxy answers its mode ("nftables"); kpng's mode is its backends.
        return Reply(body=",".join(status.fanout_names()) or "none")

    return handle


def _debug_handlers(status: Status) -> dict[str, Handler]:
    async def state(_: Request) -> Reply:
        state = status.last_state
        if state is None:
            return Reply(503, "no state given to the backends yet\n")
        # to-json's line (kpng.backends.json), encoded anew: a request, not every revision.
        services = (msgspec.json.encode(state.services[k]) for k in sorted(state.services))
        line = node_state_line(state.node, state.revision, state.facts, services)
        # What the backends could not program, beside the state they were given: the line is
        # to-json's, with one more key.
        refused = {
            feeder.name: {object_name(*key): why for key, why in sorted(refusals.items())}
            for feeder in status.feeders()
            if (refusals := feeder.sync.refused_services)
        }
        if refused:
            line = b'%s,"refused":%s}\n' % (line[:-2], msgspec.json.encode(refused))
        return Reply(body=line, content_type=_JSON)

    async def explain(request: Request) -> Reply:
        if status.explain is None:
            return Reply(
                404,
                "this kpng gets node-local states from a brain, which alone knows why: "
                "ask the brain's /debug/explain\n",
            )
        node = request.query.get("node") or status.node
        namespace, slash, name = request.query.get("service", "").partition("/")
        if not node or not slash or not namespace or not name:
            usage = "service=NAMESPACE/NAME" + ("" if status.node else "&node=NODE")
            return Reply(400, f"ask /debug/explain?{usage}\n")
        if not status.sources_synced:
            return Reply(503, "the sources have not synced yet\n")
        # On the loop, not in a thread: the store changes on the loop. One Service costs a pass
        # over the slices, some 20 ms at 100k.
        return Reply(body=status.explain(node, (namespace, name)), content_type=_JSON)

    async def rules(_: Request) -> Reply:
        parts = []
        for feeder in status.feeders():
            if isinstance(feeder.backend, ShowsRules):
                try:
                    text = await feeder.backend.applied_rules()
                except KpngError as exc:
                    text = f"# cannot list them: {exc}\n"
                parts.append(f"# {feeder.name}\n{text}")
        if not parts:
            return Reply(404, "no backend here programs the kernel\n")
        return Reply(body="".join(parts))

    return {"/debug/state": state, "/debug/explain": explain, "/debug/rules": rules}


async def serve(
    status: Status, *, healthz: HttpAddress | None, metrics: HttpAddress | None
) -> None:
    """Answer until cancelled. A port already taken is an error at start, not a silent gap."""
    routes: dict[HttpAddress, dict[str, Handler]] = {}
    if healthz is not None:
        routes.setdefault(healthz, {}).update(
            {
                "/healthz": _health_handler(status, live_only=False),
                "/livez": _health_handler(status, live_only=True),
            }
        )
    if metrics is not None:
        routes.setdefault(metrics, {}).update(
            {
                "/metrics": _metrics_handler(status),
                # Where kube-proxy tells its mode; scripts and upstream's e2e tests read it.
                "/proxyMode": _proxy_mode_handler(status),
                **_debug_handlers(status),
            }
        )
        if metrics != healthz:
            routes[metrics]["/healthz"] = _ping
            routes[metrics]["/livez"] = _health_handler(status, live_only=True)
    listeners: list[Listener] = []
    try:
        for address, handlers in routes.items():
            try:
                sock = _bind(address)
            except OSError as exc:
                raise KpngError(f"cannot serve HTTP on {address}: {exc.strerror}") from exc
            listeners.append(await serve_http(sock, handlers))
            host, port = sock.getsockname()[:2]
            log.info("serving %s on http://%s", ", ".join(handlers), HttpAddress(host, port))
        await asyncio.Event().wait()
    finally:
        for listener in listeners:
            listener.close()
        for listener in listeners:
            await listener.wait_closed()


def _bind(address: HttpAddress) -> socket.socket:
    if not address.host:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", address.port), family=socket.AF_INET6, dualstack_ipv6=True
            )
        return socket.create_server(("", address.port))
    family = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address.host, address.port), family=family)
