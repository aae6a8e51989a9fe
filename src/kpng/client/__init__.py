"""kpng's client library: everything a backend author needs, and nothing else.

A backend receives the node-local state either whole (``run``/``watch_state`` with a handler, or
a ``Backend`` object for ``to-local`` and ``kpng local``) or as incremental calls (a ``Sink`` for
``run``/``watch``, or ``SinkBackend`` in process; a ``NodeSink`` also hears of the node's
facts). The same types and the same facts arrive in process and over the network.
``DiffStore`` turns whole states into changes; ``BackendSpec`` and ``register`` make a packaged
backend a ``to-<name>`` command, whose constructor gets a ``SyncReporter`` for what only the
backend knows of its syncs; ``UsageError`` is what a backend raises for flags it cannot use,
``KpngError`` for a failure it can explain (logged as one line, not a traceback), and
``object_name`` names a service in messages as kpng does. See docs/backends/tutorial.md.

Built-in backends use this surface and kpng's wire protos (``kpng.api``, public too), as a third
party's would; an import contract holds them to it. The one exception is to-plugin, which feeds
each plugin through kpng's own ``kpng.feeding.Feeder`` so that health and metrics report each
plugin.
"""

from kpng.backoff import Backoff
from kpng.client._diffstore import Diff, DiffStore
from kpng.client._registering import BackendSpec, ProxyMode, register
from kpng.client._reporting import NoReporting, SyncReporter
from kpng.client._running import run, watch, watch_state
from kpng.client._sinks import SinkBackend
from kpng.client._state import Backend, Handler, NodeState
from kpng.errors import KpngError, UsageError, object_name
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
    "KpngError",
    "NoReporting",
    "NodeAddress",
    "NodeFacts",
    "NodeSink",
    "NodeState",
    "PortMapping",
    "PortName",
    "ProxyMode",
    "Service",
    "ServiceEndpoints",
    "ServiceIPs",
    "ServiceKey",
    "Sink",
    "SinkBackend",
    "SyncReporter",
    "UsageError",
    "object_name",
    "register",
    "run",
    "watch",
    "watch_state",
]
