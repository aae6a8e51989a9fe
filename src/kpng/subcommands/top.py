"""``kpng top``: one node's Services by new connections per second (kpng.top)."""

from __future__ import annotations

from collections.abc import Sequence

from kpng.subcommands import CommandSpec


def _run(argv: Sequence[str]) -> int:
    from kpng.top.command import main

    return main(argv)


SPEC = CommandSpec(
    name="top",
    help="a node's Services by new and refused connections per second, from its /metrics "
    "(top --once for a table)",
    run=_run,
)
