"""kpng's client library: everything a backend author needs, and nothing else.

A backend receives the node-local state either whole (``run``/``watch_state`` with a handler, or
a ``Backend`` object for ``to-local`` and ``kpng local``) or as incremental calls (a ``Sink`` for
``watch``). The same types arrive in process and over the network. ``Fanout`` and ``Feeder``
feed several backends, each at its own pace and failing on its own. See
docs/backend-tutorial.md.
"""

from kpng.client._address import Api, ClientTls
from kpng.client._backoff import Backoff
from kpng.client._diffstore import Diff, DiffStore
from kpng.client._feeding import Fanout, Feeder, FeederStats, Histogram, SyncStats
from kpng.client._registering import BackendSpec, register
from kpng.client._running import add_arguments, api_from_args, run, watch, watch_state
from kpng.client._sinks import FullState, Sink, SinkBackend
from kpng.client._state import Backend, Handler, NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    ClientIPAffinity,
    Endpoint,
    EndpointAddress,
    EndpointScopes,
    IPFamilies,
    IPFilter,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)

__all__ = [
    "Api",
    "Backend",
    "BackendSpec",
    "Backoff",
    "ClientIPAffinity",
    "ClientTls",
    "Diff",
    "DiffStore",
    "Endpoint",
    "EndpointAddress",
    "EndpointScopes",
    "Fanout",
    "Feeder",
    "FeederStats",
    "FullState",
    "Handler",
    "Histogram",
    "IPFamilies",
    "IPFilter",
    "IPSet",
    "NodeState",
    "PortMapping",
    "PortName",
    "Service",
    "ServiceEndpoints",
    "ServiceIPs",
    "ServiceKey",
    "Sink",
    "SinkBackend",
    "SyncStats",
    "add_arguments",
    "api_from_args",
    "register",
    "run",
    "watch",
    "watch_state",
]
