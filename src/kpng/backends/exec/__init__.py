"""``to-exec``: the node-local state on a program's stdin, in any language.

``to-exec --command CMD [--format full|ops]`` runs CMD (split as a shell would, but run without
one) and writes the state to its stdin: ``full``, one to-json line per state; ``ops``, one JSON
object per incremental op (the exact format is in kpng.backends.exec.formats). The program is
restarted with backoff if it dies and then gets the whole state again; its stderr goes to kpng's
log, prefixed with its name and rate-limited; one that reads slowly gets coalesced states (see
kpng.backends.exec.running).
"""

from __future__ import annotations

import argparse
import shlex

from kpng.backends.exec.formats import FORMATS
from kpng.backends.exec.running import ExecBackend
from kpng.client import Backend, BackendSpec, SyncReporter, UsageError, register

__all__ = ["ExecBackend"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--command",
        required=True,
        metavar="CMD",
        help="the program and its arguments, split as a shell would (no shell runs it)",
    )
    parser.add_argument(
        "--format",
        choices=sorted(FORMATS),
        default="full",
        help="full: one to-json line per state; ops: one JSON line per change (default: full)",
    )


def _create(args: argparse.Namespace, _syncs: SyncReporter) -> Backend:
    try:
        argv = shlex.split(args.command)
    except ValueError as exc:
        raise UsageError(f"to-exec --command {args.command!r}: {exc}") from exc
    if not argv:
        raise UsageError("to-exec --command: no program given")
    return ExecBackend(argv, make_format=FORMATS[args.format])


SPEC = register(
    BackendSpec(
        name="exec",
        help="run a program and write the node-local state to its stdin as JSON lines",
        add_arguments=_add_arguments,
        create=_create,
    )
)
