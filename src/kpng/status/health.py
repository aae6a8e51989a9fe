"""Whether kpng keeps the node's rules up to date: the verdicts of ``/healthz`` and ``/livez``
(pure: the caller passes the clock).

The contract is kube-proxy's, which cloud load balancers and kubelet probes already rely on: the
proxy is healthy unless a change has waited longer than a timeout without being programmed. A
backend that keeps failing (a kernel refusing transactions, a plugin down) therefore turns the
node unhealthy once its oldest unapplied state is older than the timeout, and healthy again as
soon as it catches up. So does a kernel that another program changed behind a backend's back
(a flushed ruleset), from when the backend found it until a sync repairs it, if that takes
longer than the timeout.

``/healthz`` also answers 503 until every source has synced and every backend has applied a
first state, so a load balancer sends nothing to a node whose rules were never programmed; and,
as kube-proxy's since KEP-3836, while the node is being deleted or tainted by the cluster
autoscaler for removal, so that load balancers drain it before it goes. ``/livez`` does neither:
a slow first list or a draining node is no reason for a liveness probe to restart kpng.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kpng.feeding import FeederStats

BUSY_SHOWN_S = 3.0
"""A pipeline loop busy this long shows in the verdict's body (a first sync at 100k services
takes some 20 s; past the timeout, kpng is not live)."""


@dataclass(frozen=True)
class Busy:
    """kpng's pipeline loop has not run for ``seconds``, running ``where``."""

    seconds: float
    where: str


@dataclass(frozen=True)
class Verdict:
    live: bool
    """No backend has had a state waiting, or a kernel differing from what it applied, longer
    than the timeout (``/livez``)."""
    healthy: bool
    """Live, sources synced, every backend has applied a state, and the node is not draining
    (``/healthz``)."""
    body: dict[str, Any]
    """The JSON document both endpoints answer with."""


def judge(
    *,
    backends: Mapping[str, FeederStats],
    sources_synced: bool,
    node_eligible: bool,
    timeout: float,
    monotonic: float,
    wall: float,
    blocked: Sequence[str] = (),
    busy: Busy | None = None,
) -> Verdict:
    """The verdict at monotonic time ``monotonic`` (wall time ``wall``). ``blocked`` says why
    sources cannot sync, when they know (a file that never parsed); ``busy``, that the
    pipeline's loop has not run for a while. Past the timeout that is a stuck loop, which no
    backend's figures can show: they are updated on that loop."""
    late = {
        name: monotonic - stats.pending_since
        for name, stats in backends.items()
        if stats.pending_since is not None and monotonic - stats.pending_since > timeout
    }
    diverged = {
        name: (monotonic - stats.diverged_since, stats.diverged_why)
        for name, stats in backends.items()
        if stats.diverged_since is not None and monotonic - stats.diverged_since > timeout
    }
    never_applied = [name for name, stats in backends.items() if stats.last_applied is None]
    stuck = busy is not None and busy.seconds > timeout
    live = not late and not diverged and not stuck
    healthy = live and sources_synced and not never_applied and node_eligible
    applied = [s.last_applied for s in backends.values() if s.last_applied is not None]
    body: dict[str, Any] = {
        # kube-proxy's fields: when the rules were last brought up to date (the oldest of the
        # backends' last applies), and now.
        "lastUpdated": _iso(min(applied)) if applied and not never_applied else None,
        "currentTime": _iso(wall),
        "healthy": healthy,
        "nodeEligible": node_eligible,
        "sourcesSynced": sources_synced,
        "backends": {
            name: {
                "revision": stats.applied_revision,
                "lastUpdated": _iso(stats.last_applied) if stats.last_applied else None,
                "pendingSeconds": (
                    round(monotonic - stats.pending_since, 3)
                    if stats.pending_since is not None
                    else 0.0
                ),
                "failures": stats.failures,
                **(
                    {
                        "divergedSeconds": round(monotonic - stats.diverged_since, 3),
                        "diverged": stats.diverged_why,
                    }
                    if stats.diverged_since is not None
                    else {}
                ),
            }
            for name, stats in backends.items()
        },
    }
    if busy is not None:
        body["busy"] = {"seconds": round(busy.seconds, 3), "in": busy.where}
    if not healthy:
        body["reasons"] = _reasons(
            sources_synced, blocked, node_eligible, never_applied, late, timeout
        ) + [
            f"{name}: the kernel has differed from its applied rules for {seconds:.1f} s "
            f"(timeout {timeout:g} s): {why}"
            for name, (seconds, why) in diverged.items()
        ]
        if busy is not None and stuck:
            body["reasons"].append(
                f"kpng's loop has not run for {busy.seconds:.1f} s (timeout {timeout:g} s), "
                f"busy in {busy.where}"
            )
    return Verdict(live=live, healthy=healthy, body=body)


def _reasons(
    sources_synced: bool,
    blocked: Sequence[str],
    node_eligible: bool,
    never_applied: list[str],
    late: Mapping[str, float],
    timeout: float,
) -> list[str]:
    reasons = [] if sources_synced else ["the sources have not synced yet", *blocked]
    if not node_eligible:
        reasons.append(
            "the node is unknown to the source, being deleted, or tainted "
            "ToBeDeletedByClusterAutoscaler"
        )
    reasons += [f"{name} has not applied a state yet" for name in never_applied if name not in late]
    reasons += [
        f"{name} has had a state waiting {waited:.1f} s (timeout {timeout:g} s)"
        for name, waited in late.items()
    ]
    return reasons


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="milliseconds")
