"""Subcommands: ``kpng cleanup``, ``kpng version``, ``kpng check``, ``kpng kube-proxy``,
``kpng top``. A module of this package that defines a ``SPEC`` is one, the command word
``SPEC.name``: the CLI finds it here (``registered``), as it finds sources and sinks
(kpng.specs). Modules stay light: what a subcommand needs is imported when it runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kpng.specs import find_specs


@dataclass(frozen=True)
class CommandSpec:
    name: str
    """The command word, e.g. ``cleanup``."""
    help: str
    run: Callable[[Sequence[str]], int | list[str]]
    """Runs the subcommand on the arguments after its word: its exit status, or the kpng command
    line to run in its place (``kpng kube-proxy`` translates kube-proxy's flags into one)."""


def registered() -> dict[str, CommandSpec]:
    """Every subcommand, by name."""
    return find_specs(__name__, CommandSpec)


__all__ = ["CommandSpec", "registered"]
