"""to-iptables' traffic counters (``--traffic-counters service`` and ``endpoint``): the packet
counters iptables keeps on every rule, read from ``iptables-save -c`` (pure: the parsing).

Only a connection's first packet passes the nat table, so a nat rule's packets are new
connections. Every connection a Service port serves ends in exactly one ``KUBE-SEP-*`` chain's
DNAT rule, whichever way it came (ClusterIP, external or LB IP, node port, the eTP=Local
short-circuit, ClientIP affinity): those rules count a port's served connections and, per
endpoint (``--to-destination``), its endpoints'. Counting there rather than on the jumps of
``KUBE-SERVICES`` matters: a shared chain is rewritten whenever a line of it changes (any
Service added or gone), which restarts all its counters, where a ``KUBE-SEP-*`` chain is
rewritten only with its own service. The refused connections are the packets of the filter
table's REJECT and DROP rules for ports without endpoints, in ``KUBE-SERVICES`` and
``KUBE-EXTERNAL-SERVICES`` (each names its service port in a comment): shared chains, which the
backend reads (those two chains alone: ``saved_from_listing``) just before a restore rewrites
them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from kpng.backends._traffic import REFUSED, SERVED, Series
from kpng.backends.iptables.rules import FILTER, NAT, ChainKey

Key = tuple[str, str, str, str, str]
"""(family, table, chain, rule as saved without its counters, series part): one counted rule
(a DNAT rule counts twice, for its port and its endpoint)."""

REFUSING_CHAINS = frozenset({(FILTER, "KUBE-SERVICES"), (FILTER, "KUBE-EXTERNAL-SERVICES")})
_SEP = "KUBE-SEP-"
_SAVED = re.compile(r"\[(\d+):\d+\] -A (\S+) (.*)")
_TO = re.compile(r" --to-destination (\S+)")
_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')
_REFUSING = re.compile(r" -j (?:REJECT|DROP)\b")


_LISTED = re.compile(r"(-A \S+ .*?) -c (\d+) (\d+)(.*)")


def saved_from_listing(listing: str) -> str:
    """``iptables -S CHAIN -v``'s rules (``-c PACKETS BYTES`` among the matches) as
    ``iptables-save -c`` prints them (``[PACKETS:BYTES]`` first), for ``counted_rules``."""
    lines = []
    for line in listing.splitlines():
        found = _LISTED.fullmatch(line)
        if found is not None:
            lines.append(f"[{found[2]}:{found[3]}] {found[1]}{found[4]}")
    return "\n".join(lines)


def counted_chain(chain: ChainKey) -> bool:
    """Whether the rules of ``chain`` (table, name) count for a Service."""
    table, name = chain
    return (table == NAT and name.startswith(_SEP)) or chain in REFUSING_CHAINS


def counted_rules(
    fam: str,
    table: str,
    saved: str,
    endpoint_chains: Mapping[str, str],
    *,
    endpoints: bool,
) -> Iterator[tuple[Key, Series, int]]:
    """The counted rules of one ``iptables-save -c -t TABLE`` of ``fam``: each with what it
    counts for and its packets. ``endpoint_chains``: kpng's KUBE-SEP chains' service ports;
    ``endpoints``: the DNAT rules count for their endpoint too."""
    for line in saved.splitlines():
        if not line.startswith("["):
            continue
        found = _SAVED.fullmatch(line)
        if found is None:
            continue
        packets, chain, rule = int(found[1]), found[2], found[3]
        if table == NAT:
            port = endpoint_chains.get(chain) if chain.startswith(_SEP) else None
            to = _TO.search(rule) if port is not None and " -j DNAT" in rule else None
            if port is None or to is None:
                continue
            yield (fam, table, chain, rule, SERVED), (port, SERVED), packets
            if endpoints:
                yield (fam, table, chain, rule, "endpoint"), (port, to[1]), packets
        elif (table, chain) in REFUSING_CHAINS and _REFUSING.search(rule):
            comment = _COMMENT.search(rule)
            if comment is not None:
                port = comment[1] if comment[1] is not None else comment[2]
                yield (fam, table, chain, rule, REFUSED), (port, REFUSED), packets
