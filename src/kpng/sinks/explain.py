"""``explain``: why a node uses or skips each endpoint, once every source has synced.

``kpng <source> ... explain --node-name NODE [--service NS/NAME] [--output json]`` prints, for
each Service port, every endpoint kpng knows, whether cluster-wide and node-local traffic use it,
and why (kpng.resolver.explaining). It reads the global state as any sink does, so it works on
every source: the API server, manifests, or another kpng's ``to-api``. With ``--metrics-url``,
the connections the node's traffic counters counted stand beside the decisions, read from its
``/metrics`` (``/debug/explain`` reads its own backends' in process).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from kpng.errors import UsageError
from kpng.feeding import Fanout
from kpng.model.cluster import ServiceKey, node_zone
from kpng.scraping import PortCounts, PortKey, counts_of, metrics_url
from kpng.sinks import Runner, SinkSpec
from kpng.status import Sampled, Status
from kpng.store import Store

if TYPE_CHECKING:
    from kpng.resolver.explaining import ServiceExplanation

Traffic = Mapping[PortKey, PortCounts]


def traffic_of(samples: Iterable[Sampled]) -> dict[PortKey, PortCounts]:
    """The traffic counters among a node's samples (its backends' ``/metrics``)."""
    return counts_of((s.name, dict(s.labels), s.value) for s in samples)


def with_traffic(explanation: ServiceExplanation, traffic: Traffic) -> ServiceExplanation:
    """The explanation with each port's counted connections, and each endpoint's where the
    endpoints are counted; unchanged for a port not counted."""
    import msgspec

    from kpng.resolver.explaining import endpoint_name

    ports = []
    for port in explanation.ports:
        counted = traffic.get((explanation.namespace, explanation.name, port.name))
        if counted is None:
            ports.append(port)
            continue
        endpoints = port.endpoints
        if counted.endpoints:
            endpoints = [
                msgspec.structs.replace(
                    ep,
                    connections=int(counted.endpoints.get(endpoint_name(ep.address, ep.port), 0)),
                )
                for ep in port.endpoints
            ]
        ports.append(
            msgspec.structs.replace(
                port,
                connections=int(counted.connections),
                refused=int(counted.refused),
                endpoints=endpoints,
            )
        )
    return msgspec.structs.replace(explanation, ports=ports)


def parse_service(text: str) -> ServiceKey:
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise UsageError(f"a Service is NAMESPACE/NAME, got {text!r}")
    return namespace, name


def explain(
    store: Store,
    *,
    node: str,
    service: ServiceKey | None,
    output: str,
    traffic: Traffic | None = None,
) -> str:
    """The explanation of ``service`` (every Service when None) on ``node``, from the store,
    with the connections ``traffic`` counted for its ports."""
    # The resolver is imported by the sinks that resolve only (kpng.sinks.local says why).
    import msgspec

    from kpng.resolver.explaining import explain_service, render_text

    zone = node_zone(store.nodes.get(node))
    keys = [service] if service is not None else sorted(store.services)
    explanations = [
        explain_service(
            key,
            store.services.get(key),
            store.slices_of(key),
            node=node,
            zone=zone,
            ignored=store.ignored_services.get(key),
        )
        for key in keys
    ]
    if traffic:
        explanations = [with_traffic(ex, traffic) for ex in explanations]
    if output == "json":
        return msgspec.json.format(msgspec.json.encode(explanations)).decode() + "\n"
    return render_text(explanations)


def explain_json(
    store: Store,
    node: str,
    service: ServiceKey,
    *,
    traffic: Callable[[str], Traffic] | None = None,
) -> bytes:
    """``/debug/explain``'s answer: what ``kpng explain -o json --service`` prints, with the
    connections ``traffic(node)`` counted (a node's own backends' counters)."""
    counted = traffic(node) if traffic is not None else None
    return explain(store, node=node, service=service, output="json", traffic=counted).encode()


async def run_explain(
    store: Store,
    *,
    node: str,
    service: ServiceKey | None,
    output: str,
    metrics_url: str | None = None,
) -> None:
    subscription = store.subscribe()
    try:
        async for _ in subscription:  # the first revision comes once every source has synced
            traffic = await scraped_traffic(metrics_url) if metrics_url is not None else None
            text = explain(store, node=node, service=service, output=output, traffic=traffic)
            sys.stdout.write(text)
            sys.stdout.flush()
            return
    finally:
        subscription.close()


async def scraped_traffic(url: str) -> Traffic:
    """The traffic counters on the node's ``/metrics`` page at ``url``."""
    import time

    from kpng.http1.client import HttpClient
    from kpng.scraping import TIMEOUT_S, ReadError, fetch, parse

    client = HttpClient(ssl_context=None, connect_timeout=TIMEOUT_S)
    try:
        scrape = parse(await fetch(client, url), at=time.monotonic())
    finally:
        await client.close()
    if not scrape.counting:
        raise ReadError(
            f"{url} has no traffic counters (kpng_service_connections_total): the node's "
            "backend counts with --traffic-counters"
        )
    return scrape.ports


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-name", required=True, metavar="NODE", help="the node asking")
    parser.add_argument(
        "--service", metavar="NAMESPACE/NAME", help="explain this Service only (default: all)"
    )
    parser.add_argument(
        "--output", "-o", choices=("table", "json"), default="table", help="default: table"
    )
    parser.add_argument(
        "--metrics-url",
        metavar="URL",
        help="NODE's metrics address (HOST:PORT or an http(s) URL, as kpng top takes it): show "
        "each port's and endpoint's connections its traffic counters counted beside the "
        "decisions (the node runs its backend with --traffic-counters)",
    )


def _create(
    args: argparse.Namespace, store: Store, _: Callable[[], Fanout] | None, __: Status
) -> Runner:
    service = parse_service(args.service) if args.service is not None else None
    url = metrics_url(args.metrics_url) if args.metrics_url is not None else None
    return lambda: run_explain(
        store, node=args.node_name, service=service, output=args.output, metrics_url=url
    )


SPEC = SinkSpec(
    name="explain",
    help="say why NODE uses or skips each endpoint of each Service, then exit",
    add_arguments=_add_arguments,
    create=_create,
    node=lambda args: args.node_name,
    # One answer, then exit: a source that cannot sync is an error, not a wait.
    once=lambda _: True,
)
