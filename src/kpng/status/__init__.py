"""What kpng tells operators about itself: ``/healthz``, ``/livez`` and ``/metrics``.

``Status`` gathers what those read (the store, the backends' feeders); ``health`` judges it
(pure); ``metrics`` renders it for Prometheus; ``serving`` answers HTTP.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kpng.client import Fanout, Feeder, FeederStats
from kpng.status.health import Verdict, judge
from kpng.store import Store


@dataclass(frozen=True)
class Sample:
    """One value a part of kpng reports for ``/metrics``, in plain types: Prometheus' own are
    imported only by the commands that serve metrics."""

    name: str
    help: str
    value: float
    counter: bool = False
    labels: tuple[tuple[str, str], ...] = ()


@dataclass
class Status:
    timeout: float
    """How long a state may wait unapplied before kpng is unhealthy."""
    store: Store | None = None
    """The brain's store; ``None`` for ``kpng local``, whose source is a remote kpng."""
    node: str | None = None
    """The node whose rules this kpng programs (``to-local``): its draining drains kpng too."""
    nodes_listed: bool = False
    """The source lists every node (``kpng kube``): one it does not list does not exist."""
    fanouts: list[Fanout] = field(default_factory=list)
    samplers: list[Callable[[], Iterable[Sample]]] = field(default_factory=list)
    """What other parts (the to-api server) report, read at each scrape."""

    def track(self, fanout: Fanout) -> Fanout:
        self.fanouts.append(fanout)
        return fanout

    def fanout_names(self) -> list[str]:
        """The backends fed directly, in command-line order (``to-nft``, ``to-plugin``...)."""
        return [feeder.name for fanout in self.fanouts for feeder in fanout.feeders]

    @property
    def backends(self) -> Mapping[str, FeederStats]:
        """Every feeder's stats by name, those of composite backends' own feeders included."""
        found: dict[str, FeederStats] = {}
        pending = [f for fanout in self.fanouts for f in fanout.feeders]
        while pending:
            feeder = pending.pop(0)
            found[feeder.name] = _with_backend_pending(feeder)
            # A backend feeding others (to-plugin, one Feeder per plugin) lists them as
            # ``feeders``: a plugin that keeps failing must show, not hide behind its parent.
            inner = getattr(feeder.backend, "feeders", None)
            if isinstance(inner, list):
                pending.extend(f for f in inner if isinstance(f, Feeder))
        return found

    @property
    def sources_synced(self) -> bool:
        return self.store is None or self.store.synced

    @property
    def node_eligible(self) -> bool:
        """False while this node is being deleted or about to be (``Node.Draining``), or does
        not exist (as kube-proxy's). Manifests need not list nodes: with none listed, an unknown
        node is eligible."""
        if self.store is None or self.node is None:
            return True
        node = self.store.nodes.get(self.node)
        if node is None:
            return not (self.nodes_listed or self.store.nodes)
        return not node.Draining

    def verdict(self, backends: Mapping[str, FeederStats] | None = None) -> Verdict:
        """The verdict now; ``backends``, when the caller has just read them, spares a second
        walk over the feeders."""
        return judge(
            backends=self.backends if backends is None else backends,
            sources_synced=self.sources_synced,
            node_eligible=self.node_eligible,
            timeout=self.timeout,
            monotonic=time.monotonic(),
            wall=time.time(),
        )


def _with_backend_pending(feeder: Feeder) -> FeederStats:
    """The feeder's stats, pending since the earlier of the feeder and its backend: a backend
    that retries on its own (to-nft, after the kernel refused a transaction) has ``apply``
    return and says in ``pending_since`` that its rules are behind."""
    own = getattr(feeder.backend, "pending_since", None)
    stats = feeder.stats
    if not isinstance(own, float) or (
        stats.pending_since is not None and stats.pending_since <= own
    ):
        return stats
    return dataclasses.replace(stats, pending_since=own)


__all__ = ["Sample", "Status", "Verdict"]
