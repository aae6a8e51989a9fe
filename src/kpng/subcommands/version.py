"""``kpng version``: what this kpng is made of, for bug reports (as ``kpng --version``)."""

from __future__ import annotations

from collections.abc import Sequence

from kpng.subcommands import CommandSpec


def _run(_: Sequence[str]) -> int:
    from kpng.version import report

    print(report())
    return 0


SPEC = CommandSpec(
    name="version",
    help="print the versions of kpng, its wire API, Python and libnftables",
    run=_run,
)
