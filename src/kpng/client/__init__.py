"""kpng's client library: everything a backend author needs, and nothing else.

A backend receives the node-local state either whole (``run``/``watch_state`` with a handler, or
a ``Backend`` object for ``to-local`` and ``kpng local``) or as incremental calls (a ``Sink`` for
``run``/``watch``, or ``SinkBackend`` in process; a ``NodeSink`` also hears of the node's
facts). The same types and the same facts arrive in process and over the network.
``DiffStore`` turns whole states into changes; ``BackendSpec`` and ``register`` make a packaged
backend a ``to-<name>`` command, whose constructor gets a ``SyncReporter`` for what only the
backend knows of its syncs. See docs/backends/tutorial.md. Built-in backends use exactly this
surface; kpng's own feeding machinery is ``kpng.feeding``.
"""

from kpng.backoff import Backoff
from kpng.client._diffstore import Diff, DiffStore
from kpng.client._registering import BackendSpec, register
from kpng.client._reporting import NoReporting, SyncReporter
from kpng.client._running import run, watch, watch_state
from kpng.client._sinks import SinkBackend
from kpng.client._state import Backend, Handler, NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    ChangeTriggers,
    ClientIPAffinity,
    Endpoint,
    EndpointAddress,
    EndpointScopes,
    IPFamilies,
    IPFilter,
    IPSet,
    NodeAddress,
    NodeFacts,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)
from kpng.remote.address import Api, ClientTls
from kpng.remote.sinks import NodeSink, Sink

__all__ = [
    "Api",
    "Backend",
    "BackendSpec",
    "Backoff",
    "ChangeTriggers",
    "ClientIPAffinity",
    "ClientTls",
    "Diff",
    "DiffStore",
    "Endpoint",
    "EndpointAddress",
    "EndpointScopes",
    "Handler",
    "IPFamilies",
    "IPFilter",
    "IPSet",
    "NoReporting",
    "NodeAddress",
    "NodeFacts",
    "NodeSink",
    "NodeState",
    "PortMapping",
    "PortName",
    "Service",
    "ServiceEndpoints",
    "ServiceIPs",
    "ServiceKey",
    "Sink",
    "SinkBackend",
    "SyncReporter",
    "register",
    "run",
    "watch",
    "watch_state",
]
