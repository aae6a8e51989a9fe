"""``kpng check``: drive a plugin or an exec program through scripted states (kpng.check)."""

from __future__ import annotations

from collections.abc import Sequence

from kpng.subcommands import CommandSpec


def _run(argv: Sequence[str]) -> int:
    from kpng.check import main

    return main(argv)


SPEC = CommandSpec(
    name="check",
    help="test a plugin (check plugin unix:///PATH) or an exec program (check exec --command CMD)",
    run=_run,
)
