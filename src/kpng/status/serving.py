"""The HTTP side of ``Status``: ``/healthz`` and ``/livez`` on one address, ``/metrics`` on
another (or the same), as kube-proxy splits them: health is asked by load balancers on a node
address, metrics are scraped on an address operators choose.

The metrics address also answers ``/livez`` and the state view, ``/debug/state``,
``/debug/explain`` and ``/debug/rules``: they show every Service and endpoint of the node, which
is why they are there (loopback by default) and never on the health address, which load
balancers reach.

The addresses are served by a thread of their own, with its own event loop: the health verdict
is read there, so that ``/healthz`` answers while the pipeline's loop is busy (a 100k-service
first sync, one very wide Service) and says so when that loop has not run for longer than the
timeout, naming where it is. What reads the node's state (``/metrics``, the state view) is
handed to the pipeline's loop, where that state changes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

import msgspec

from kpng.addresses import host_port
from kpng.api.lines import node_state_line
from kpng.errors import KpngError, UsageError, object_name
from kpng.http1.server import MAX_CONNECTIONS, REQUEST_S, Handler, Listener, Reply, Request
from kpng.http1.server import serve as serve_http
from kpng.status import metrics
from kpng.status.exposition import CONTENT_TYPE
from kpng.status.gathering import Status
from kpng.status.reports import ShowsRules

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


BEAT_S = 1.0
"""How often the pipeline's loop says it runs: the resolution of a stall it is found in."""


@dataclass(frozen=True)
class HttpLimits:
    """Each listener's bounds (``--http-max-connections``, ``--http-request-timeout``)."""

    max_connections: int = MAX_CONNECTIONS
    request_timeout: float = REQUEST_S


async def serve(
    status: Status,
    *,
    healthz: HttpAddress | None,
    metrics: HttpAddress | None,
    limits: HttpLimits = HttpLimits(),
) -> None:
    """Answer until cancelled. A port already taken is an error at start, not a silent gap."""
    routes: dict[HttpAddress, dict[str, Handler]] = {}
    loop = asyncio.get_running_loop()
    if healthz is not None:
        routes.setdefault(healthz, {}).update(
            {
                "/healthz": _health_handler(status, live_only=False),
                "/livez": _health_handler(status, live_only=True),
            }
        )
    if metrics is not None:
        on_loop = {
            "/metrics": _metrics_handler(status),
            # Where kube-proxy tells its mode; scripts and upstream's e2e tests read it.
            "/proxyMode": _proxy_mode_handler(status),
            **_debug_handlers(status),
        }
        routes.setdefault(metrics, {}).update(
            {path: _on(loop, handler) for path, handler in on_loop.items()}
        )
        if metrics != healthz:
            routes[metrics]["/healthz"] = _ping
            routes[metrics]["/livez"] = _health_handler(status, live_only=True)
    bound: list[tuple[socket.socket, dict[str, Handler]]] = []
    try:
        for address, handlers in routes.items():
            try:
                bound.append((_bind(address), handlers))
            except OSError as exc:
                raise KpngError(f"cannot serve HTTP on {address}: {exc.strerror}") from exc
    except BaseException:
        for sock, _ in bound:
            sock.close()
        raise
    status.watch_loop(threading.get_ident())
    server = _ServerThread(bound, limits)
    try:
        await asyncio.wrap_future(server.started)
        for sock, handlers in bound:
            host, port = sock.getsockname()[:2]
            log.info("serving %s on http://%s", ", ".join(handlers), HttpAddress(host, port))
        while True:
            status.loop_beat = time.monotonic()
            await asyncio.sleep(BEAT_S)
    finally:
        server.stop()


def _on(loop: asyncio.AbstractEventLoop, handler: Handler) -> Handler:
    """``handler``, run on ``loop`` (the pipeline's) for the server's thread."""

    async def run(request: Request) -> Reply:
        return await handler(request)

    async def forward(request: Request) -> Reply:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(request), loop))

    return forward


class _ServerThread:
    """The HTTP listeners, served on a thread and event loop of their own."""

    def __init__(
        self, bound: list[tuple[socket.socket, dict[str, Handler]]], limits: HttpLimits
    ) -> None:
        self.started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._bound = bound
        self._limits = limits
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kpng-http", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        listeners: list[Listener] = []
        try:
            for sock, handlers in self._bound:
                listener = await serve_http(
                    sock,
                    handlers,
                    max_connections=self._limits.max_connections,
                    request_timeout=self._limits.request_timeout,
                )
                listeners.append(listener)
        except BaseException as exc:
            self.started.set_exception(exc)
            for sock, _ in self._bound:
                sock.close()
            return
        self.started.set_result(None)
        try:
            await self._stopping.wait()
        finally:
            for listener in listeners:
                listener.close()
            for listener in listeners:
                await listener.wait_closed()

    def stop(self) -> None:
        """Close the listeners and wait, briefly, for the thread to end (it is a daemon: a
        stop that does not finish cannot keep kpng from exiting)."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
        self._thread.join(timeout=2.0)


def _bind(address: HttpAddress) -> socket.socket:
    if not address.host:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", address.port), family=socket.AF_INET6, dualstack_ipv6=True
            )
        return socket.create_server(("", address.port))
    family = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address.host, address.port), family=family)
