"""``kpng cleanup [BACKEND...]``: remove what backends, or kube-proxy, leave on the node."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from kpng.errors import EXIT_ERROR, KpngError
from kpng.subcommands import CommandSpec

KUBE_PROXY = "kube-proxy"


def cleanup(argv: Sequence[str]) -> int:
    """``kpng cleanup [BACKEND...]``: remove what backends leave on the node (all by default);
    ``kpng cleanup kube-proxy`` removes what kube-proxy leaves, of every mode (nftables tables,
    iptables chains, IPVS servers, interface and ip sets), as ``kube-proxy --cleanup``, after a
    migration. Each line says what one of them removed."""
    from kpng.backends import registry

    parser = argparse.ArgumentParser(prog="kpng cleanup", description=cleanup.__doc__)
    parser.add_argument(
        "backends", nargs="*", metavar="BACKEND", help="e.g. nft or to-nft, or kube-proxy"
    )
    args = parser.parse_args(argv)
    try:
        if KUBE_PROXY in args.backends:
            from kpng.backends._nftables import kube_proxy_leftovers

            removed = asyncio.run(kube_proxy_leftovers().remove())
            for leftovers in removed:
                print(f"{KUBE_PROXY}: removed {leftovers}")
            if not removed:
                print(f"{KUBE_PROXY}: nothing to remove")
            args.backends.remove(KUBE_PROXY)
            if not args.backends:
                return 0
        wanted = [b.removeprefix("to-") for b in args.backends] or registry.names()
        specs = [registry.lookup(name) for name in wanted]
        for spec in specs:
            if spec.cleanup is not None:
                found = asyncio.run(spec.cleanup())
                print(f"to-{spec.name}: {'removed' if found else 'nothing to remove'}")
    except KpngError as exc:
        print(f"kpng: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return 0


SPEC = CommandSpec(
    name="cleanup",
    help="remove what backends (all, or those named) or kube-proxy leave on the node",
    run=cleanup,
)
