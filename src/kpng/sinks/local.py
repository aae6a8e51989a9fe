"""Feeding backends one node's state: from the store (``to-local``) or from a remote kpng
(``kpng local``). Several backends are fed independently (kpng.client.Fanout)."""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kpng.backends.registry import Backend, NodeState
from kpng.feeding import Fanout, until_done
from kpng.gcpause import collector_paused
from kpng.model.cluster import unknown_node
from kpng.model.messages import NO_TRIGGERS, NodeFacts, Service
from kpng.sinks import Runner, SinkSpec
from kpng.status import Status
from kpng.store import Delta, Store

if TYPE_CHECKING:
    from kpng.resolver.resolving import NodeResolver

log = logging.getLogger(__name__)


def apply_delta(
    resolver: NodeResolver, store: Store, delta: Delta, *, external_ips: bool = True
) -> None:
    """Hand the objects a delta names to the resolver (absent ones are deletions); without
    ``external_ips``, Services' externalIPs are left out."""
    for name in delta.nodes:
        if name == resolver.node_name:
            resolver.set_node(store.nodes.get(name))
    for key in delta.services:
        service = store.services.get(key)
        if not external_ips and service is not None:
            service = _without_external_ips(service)
        resolver.set_service(key, service)
    for key in delta.slices:
        resolver.set_slice(key, store.slices.get(key))


def _without_external_ips(service: Service) -> Service:
    """The service as kube-proxy sees it with AllowServiceExternalIPs=false (1.36+): no
    externalIPs, so none is programmed, nor counts to make it externally accessible."""
    ips = service.IPs
    if ips is None or not ips.ExternalIPs:
        return service
    return msgspec.structs.replace(service, IPs=msgspec.structs.replace(ips, ExternalIPs=None))


async def run_local(
    store: Store,
    *,
    node_name: str,
    backend: Backend,
    nodes_listed: bool = False,
    external_ips: bool = True,
) -> None:
    """Feed ``backend`` every revision that changes this node's state, until it says it is done.
    ``nodes_listed``: the source lists every node, so a node it does not list does not exist.
    Without ``external_ips``, Services' externalIPs are ignored."""
    # Imported here: every command finds this sink, and a node agent behind a brain
    # (``kpng local``) resolves nothing.
    from kpng.resolver.resolving import NodeResolver

    resolver = NodeResolver(node_name)
    subscription = store.subscribe()
    sent_facts: NodeFacts | None = None
    triggers = NO_TRIGGERS  # of the revisions that changed nothing here, for the next state
    try:
        async for delta in subscription:
            # The first delta resolves every service: at 10k services the collector's passes
            # over the growing heap were a fifth of it.
            with collector_paused():
                apply_delta(resolver, store, delta, external_ips=external_ips)
                changes = resolver.resolve()
            facts = store.node_facts(node_name)
            triggers = triggers.followed_by(delta.triggers)
            if not (changes or facts != sent_facts):
                continue
            if sent_facts is None and (
                warning := unknown_node(node_name, store.nodes, all_listed=nodes_listed)
            ):
                log.warning("%s", warning)
            if sent_facts is None:
                # As over the API: a first state is not timed, its triggers predate the backends.
                triggers = NO_TRIGGERS
            sent_facts = facts
            state = NodeState.of(
                node=node_name,
                revision=delta.revision,
                services=resolver.state,
                updated=frozenset(changes.updated),
                deleted=changes.deleted,
                facts=facts,
                triggers=triggers,
            )
            triggers = NO_TRIGGERS
            log.debug(
                "revision %d: %d services updated, %d deleted",
                delta.revision,
                len(state.updated),
                len(state.deleted),
            )
            if await backend.apply(state):
                return
    finally:
        subscription.close()


def _add_local_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hostname-override",
        "--node-name",
        dest="node_name",
        type=lambda name: name.strip().lower(),
        default=socket.gethostname().strip().lower(),
        metavar="NAME",
        help="the node whose state to compute (kube-proxy's default: the host name, lowercased)",
    )
    parser.add_argument(
        "--no-external-ips",
        dest="external_ips",
        action="store_false",
        help="ignore Services' externalIPs: program none (kube-proxy 1.36+ with the feature "
        "gate AllowServiceExternalIPs=false, a mitigation of CVE-2020-8554)",
    )


def _create(
    args: argparse.Namespace, store: Store, backends: Callable[[], Fanout] | None, status: Status
) -> Runner:
    assert backends is not None

    async def run() -> None:
        fanout = backends()
        try:
            local = run_local(
                store,
                node_name=args.node_name,
                backend=fanout,
                nodes_listed=status.nodes_listed,
                external_ips=args.external_ips,
            )
            await until_done(fanout, local)
        finally:
            await fanout.close()

    return run


SPEC = SinkSpec(
    name="to-local",
    help="resolve the state of one node and feed one or more backends",
    add_arguments=_add_local_arguments,
    create=_create,
    takes_backend=True,
    node=lambda args: str(args.node_name),
)
