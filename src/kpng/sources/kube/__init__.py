"""``kpng kube``: Services, EndpointSlices, Nodes and ServiceCIDRs followed from a Kubernetes API
server.

Four reflectors (``reflector.py``) list and watch the four resources, each through its own store
handle, marked synced after its first complete list: no revision reaches a sink before all four
have listed. Filtering is done by the server, so filtered objects never cost kpng anything:

- Services and EndpointSlices: the label selector ``!service.kubernetes.io/service-proxy-name,
  !service.kubernetes.io/headless`` (with ``--service-proxy-name NAME``:
  ``service.kubernetes.io/service-proxy-name=NAME,!service.kubernetes.io/headless``); kube-proxy
  watches both through one selector, so the headless label hides a Service as well as a slice;
- Services also: the field selector ``spec.clusterIP!=None``;
- Nodes: all of them (``to-local`` needs its node's labels, the global state every node);
- ServiceCIDRs (networking.k8s.io/v1, as kube-proxy since 1.33): all of them; to-nft drops
  traffic to their unallocated IPs.

Adding a label to a live object turns into a DELETED event, removing it into an ADDED one. The
converters apply the same rules again, and an object they reject is logged by kind, namespace and
name and skipped. While the API server is away the last state stays served; the reflectors
reconnect on their own.

Start-up: a configuration that cannot be used (a missing file, an unknown context, a failing
credential plugin) ends kpng with an error. An API server that cannot be reached is retried with
backoff, each attempt logged as an error: a proxy started before its API server (a node booting
with the control plane) should come up when the server does. ``--initial-sync-timeout`` bounds
that wait for callers that prefer to fail.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kpng.errors import UsageError
from kpng.quantities import parse_bytes
from kpng.sources import Runner, SourceSpec
from kpng.store import Store


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="PATH",
        help="kubeconfig file (default: $KUBECONFIG, then the in-cluster service account, "
        "then ~/.kube/config)",
    )
    parser.add_argument("--context", metavar="NAME", help="kubeconfig context to use")
    parser.add_argument(
        "--service-proxy-name",
        metavar="NAME",
        help="serve only objects labelled service.kubernetes.io/service-proxy-name=NAME "
        "(default: only objects without that label)",
    )
    parser.add_argument(
        "--initial-sync-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="exit with an error if the first complete lists take longer "
        "(default: 0, retry until the API server answers)",
    )
    # kpng.kubeclient.client's MAX_BODY and MAX_LINE, not imported: that module loads the HTTP
    # client, which commands other than kube do not need. A test holds them equal.
    parser.add_argument(
        "--max-list-bytes",
        default="256Mi",
        metavar="SIZE",
        help="the largest page of a list read, decoded; a larger one fails the list, which is "
        "retried (bytes, or 512Ki, 64Mi, 1Gi; default: 256Mi)",
    )
    parser.add_argument(
        "--max-event-bytes",
        default="16Mi",
        metavar="SIZE",
        help="the longest watch event read; a longer one ends the watch, which resumes "
        "(bytes, or 512Ki, 16Mi; default: 16Mi)",
    )


def _size(text: str, flag: str) -> int:
    try:
        size = parse_bytes(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if size <= 0:
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return size


def _create(args: argparse.Namespace, store: Store, node: str | None) -> Runner:
    max_list_bytes = _size(args.max_list_bytes, "--max-list-bytes")
    max_event_bytes = _size(args.max_event_bytes, "--max-event-bytes")
    # Imported here: the HTTP and configuration libraries cost other commands 0.2 s to import.
    from kpng.sources.kube.source import KubeOptions, KubeSource

    source = KubeSource(
        store,
        KubeOptions(
            kubeconfig=args.kubeconfig,
            context=args.context,
            proxy_name=args.service_proxy_name,
            initial_sync_timeout=args.initial_sync_timeout,
            node_name=node,
            max_list_bytes=max_list_bytes,
            max_event_bytes=max_event_bytes,
        ),
    )
    return source.run


SPEC = SourceSpec(
    name="kube",
    help="list and watch Services, EndpointSlices, Nodes and ServiceCIDRs on a Kubernetes API "
    "server",
    add_arguments=_add_arguments,
    create=_create,
    lists_nodes=True,
)
