"""``to-plugin``: feed plugins that serve kpng's plugin API (kpng.pluginv1) on unix sockets.

``--plugin NAME=unix:///PATH[,config=FILE]`` (repeatable) names a plugin; ``--plugin-dir DIR``
feeds every ``NAME.sock`` in DIR, with ``NAME.conf`` beside it as its configuration, and follows
the directory as plugins come and go. Each plugin is fed on its own: one that is missing, crashes,
hangs, refuses a state or speaks another protocol is logged, retried with backoff and sent the
whole state again, while kpng and the other plugins and backends go on. docs/backends/plugins.md
has the guide and the API reference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kpng.backends.plugin.config import check_unique, parse_plugin
from kpng.backends.plugin.connection import PluginBackend, PluginError
from kpng.backends.plugin.feeding import PluginsBackend
from kpng.client import Backend, BackendSpec, SyncReporter, UsageError, register

__all__ = ["PluginBackend", "PluginError", "PluginsBackend"]

DEFAULT_TIMEOUT_S = 30.0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="NAME=unix:///PATH[,config=FILE]",
        help="a plugin and, optionally, the file whose content it is configured with (repeatable)",
    )
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        metavar="DIR",
        help="feed every NAME.sock in DIR, configured by NAME.conf beside it; DIR is read again "
        "every few seconds",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"deadline of every call to a plugin (default {DEFAULT_TIMEOUT_S:g})",
    )


def _create(args: argparse.Namespace, _syncs: SyncReporter) -> Backend:
    plugins = check_unique(parse_plugin(text) for text in args.plugin)
    if not plugins and args.plugin_dir is None:
        raise UsageError("to-plugin needs --plugin NAME=unix:///PATH or --plugin-dir DIR")
    if args.timeout <= 0:
        raise UsageError(f"to-plugin --timeout {args.timeout:g}: must be positive")
    return PluginsBackend(plugins, directory=args.plugin_dir, timeout=args.timeout)


SPEC = register(
    BackendSpec(
        name="plugin",
        help="feed plugins serving kpng's plugin API on unix sockets (docs/backends/plugins.md)",
        add_arguments=_add_arguments,
        create=_create,
    )
)
