"""Sinks: where the global state goes. A module of this package that defines a ``SPEC`` is a
sink, the command word ``SPEC.name``: the CLI finds it here (``registered``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kpng.specs import Runner, find_specs
from kpng.store import Store

if TYPE_CHECKING:
    from kpng.feeding import Fanout
    from kpng.status import Status

__all__ = ["Runner", "SinkSpec", "registered"]


@dataclass(frozen=True)
class SinkSpec:
    name: str
    """The command word, e.g. ``to-local``."""
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    create: Callable[[argparse.Namespace, Store, Callable[[], Fanout] | None, Status], Runner]
    """Returns what runs the sink until it is done or cancelled; a sink that takes backends gets
    what makes the ones named on the command line. ``Status`` takes what the sink reports for
    ``/metrics``."""
    takes_backend: bool = False
    node: Callable[[argparse.Namespace], str | None] = lambda _: None
    """The one node this sink needs, if it needs one only (sources may then fetch no other)."""
    once: Callable[[argparse.Namespace], bool] = lambda _: False
    """Whether these arguments make the sink stop after its first state: kpng then fails when
    a source cannot sync, rather than wait."""


def registered() -> dict[str, SinkSpec]:
    """Every sink, by name: the modules of this package with a ``SPEC``."""
    return find_specs(__name__, SinkSpec)
