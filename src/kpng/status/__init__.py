"""What kpng tells operators about itself: ``/healthz``, ``/livez``, ``/metrics`` and
``/debug/...``.

``gathering.Status`` gathers what those read (the store, the backends' feeders, the last state
given to them); ``reports`` holds what backends and other parts give it without importing it;
``health`` judges it (pure); ``metrics`` renders it for Prometheus (``exposition`` writes the
text); ``serving`` answers HTTP.
"""

from kpng.status.gathering import FAMILIES, ProxyCounters, Status
from kpng.status.health import Verdict
from kpng.status.reports import (
    FeedsOthers,
    Reconciles,
    ReportsSamples,
    Sample,
    Sampled,
    ShowsRules,
)

__all__ = [
    "FAMILIES",
    "FeedsOthers",
    "ProxyCounters",
    "Reconciles",
    "ReportsSamples",
    "Sample",
    "Sampled",
    "ShowsRules",
    "Status",
    "Verdict",
]
