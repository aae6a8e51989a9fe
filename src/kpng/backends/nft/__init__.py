"""``to-nft``: the node-local state as nftables rules in kpng's own table (``inet kpng``).

The engine is kpng.backends._nftables, which to-ebpf runs too; this is its command: flags,
creation and registration.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kpng.backends._conntrack import Conntrack
from kpng.backends._healthchecks import HealthServers
from kpng.backends._nftables import NftBackend, cleanup, has_nft, kube_proxy_leftovers
from kpng.backends._nftables.executing import KernelNft, LibNft, NetlinkBatches, default_nft
from kpng.backends._nftables.layout import loopback_served
from kpng.backends._nftables.localhost import LocalhostProxy
from kpng.backends._nftables.nftables import Nft
from kpng.backends._node import FAMILIES, add_arguments, add_sync_period, options_from_args
from kpng.backends._traffic import add_arguments as add_traffic_arguments
from kpng.client import Backend, BackendSpec, SyncReporter, UsageError, register

log = logging.getLogger(__name__)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument(
        "--localhost-nodeports",
        action="store_true",
        help="serve TCP node ports on 127.0.0.1 and ::1 too, through a proxy in kpng's "
        "process, as kube-proxy's nftables mode with its alpha gate "
        "KubeProxyNFTablesLocalhostNodePorts: in each family whose --nodeport-addresses name "
        "loopback (localhost, 127.0.0.0/8, ::1/128); node ports on loopback that are not "
        "served so (UDP, SCTP; TCP in the other families) are refused",
    )
    add_sync_period(parser, checks="that kpng's table holds what kpng applied")
    add_traffic_arguments(
        parser,
        where="from the counters of the elements kpng writes (endpoints: not those of "
        "ClientIP-affinity Service ports)",
    )


def _create(args: argparse.Namespace, syncs: SyncReporter) -> Backend:
    options, from_node = options_from_args(args)
    options = dataclasses.replace(
        options,
        localhost_nodeports=args.localhost_nodeports,
        traffic_counters=args.traffic_counters != "off",
        endpoint_counters=args.traffic_counters == "endpoint",
    )
    served = [fam for fam in FAMILIES if loopback_served(options, fam)]
    if args.localhost_nodeports and not served:
        log.warning(
            "--localhost-nodeports: --nodeport-addresses name no loopback (localhost, "
            "127.0.0.0/8, ::1/128); node ports on loopback are refused, none is served"
        )
    if args.dry_run and args.once is False and sys.stdout.isatty():
        log.info("dry run: transactions are printed, nothing is applied")
    nft: Nft = KernelNft()  # a dry run never calls it
    if not args.dry_run:
        nft = default_nft()
        if not isinstance(nft, LibNft) and not has_nft():
            raise UsageError(
                "to-nft needs libnftables or the nft command (Debian: apt-get install nftables)"
            )
    return NftBackend(
        nft=nft,
        options=options,
        from_node=from_node,
        min_sync_period=args.min_sync_period,
        conntrack=None if args.no_conntrack or args.dry_run else Conntrack(),
        health=None if args.no_health_check or args.dry_run else HealthServers(),
        once=args.once,
        dry_run=args.dry_run,
        syncs=syncs,
        kube_proxy=None if args.dry_run else kube_proxy_leftovers(nft),
        netlink=None if args.dry_run else NetlinkBatches(),
        sync_period=0.0 if args.once or args.dry_run else args.sync_period,
        localhost=LocalhostProxy() if served and not args.dry_run else None,
        traffic_series_limit=args.traffic_series_limit,
    )


SPEC = register(
    BackendSpec(
        name="nft",
        help="program the node-local state as nftables rules in the inet kpng table",
        add_arguments=_add_arguments,
        create=_create,
        reports_syncs=True,
        cleanup=cleanup,
        once=lambda args: bool(args.once),
    )
)
