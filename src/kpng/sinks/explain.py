"""``explain``: why a node uses or skips each endpoint, once every source has synced.

``kpng <source> ... explain --node-name NODE [--service NS/NAME] [--output json]`` prints, for
each Service port, every endpoint kpng knows, whether cluster-wide and node-local traffic use it,
and why (kpng.resolver.explaining). It reads the global state as any sink does, so it works on
every source: the API server, manifests, or another kpng's ``to-api``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kpng.errors import UsageError
from kpng.feeding import Fanout
from kpng.model.cluster import ServiceKey, node_zone
from kpng.sinks import Runner, SinkSpec
from kpng.status import Status
from kpng.store import Store


def parse_service(text: str) -> ServiceKey:
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise UsageError(f"a Service is NAMESPACE/NAME, got {text!r}")
    return namespace, name


def explain(store: Store, *, node: str, service: ServiceKey | None, output: str) -> str:
    """The explanation of ``service`` (every Service when None) on ``node``, from the store."""
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
    if output == "json":
        return msgspec.json.format(msgspec.json.encode(explanations)).decode() + "\n"
    return render_text(explanations)


def explain_json(store: Store, node: str, service: ServiceKey) -> bytes:
    """``/debug/explain``'s answer: what ``kpng explain -o json --service`` prints."""
    return explain(store, node=node, service=service, output="json").encode()


async def run_explain(store: Store, *, node: str, service: ServiceKey | None, output: str) -> None:
    subscription = store.subscribe()
    try:
        async for _ in subscription:  # the first revision comes once every source has synced
            sys.stdout.write(explain(store, node=node, service=service, output=output))
            sys.stdout.flush()
            return
    finally:
        subscription.close()


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-name", required=True, metavar="NODE", help="the node asking")
    parser.add_argument(
        "--service", metavar="NAMESPACE/NAME", help="explain this Service only (default: all)"
    )
    parser.add_argument(
        "--output", "-o", choices=("table", "json"), default="table", help="default: table"
    )


def _create(
    args: argparse.Namespace, store: Store, _: Callable[[], Fanout] | None, __: Status
) -> Runner:
    service = parse_service(args.service) if args.service is not None else None
    return lambda: run_explain(store, node=args.node_name, service=service, output=args.output)


SPEC = SinkSpec(
    name="explain",
    help="say why NODE uses or skips each endpoint of each Service, then exit",
    add_arguments=_add_arguments,
    create=_create,
    node=lambda args: args.node_name,
    # One answer, then exit: a source that cannot sync is an error, not a wait.
    once=lambda _: True,
)
