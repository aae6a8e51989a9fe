"""``kpng kube-proxy [kube-proxy's flags]``: a drop-in for kube-proxy (kpng.kubeproxy)."""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Sequence

from kpng.errors import EXIT_USAGE, KpngError
from kpng.logs import configure_logging
from kpng.subcommands import CommandSpec

log = logging.getLogger("kpng.kube-proxy")


def _run(argv: Sequence[str]) -> int | list[str]:
    """kube-proxy's flags and config file become a kpng command line, run as any other: this
    only translates, and sets up the node's conntrack as kube-proxy does before it proxies."""
    from kpng.kubeproxy import command
    from kpng.kubeproxy.config import kpng_argv
    from kpng.subcommands.cleanup import cleanup

    try:
        invocation = command.build(argv)
    except KpngError as exc:
        print(f"kpng kube-proxy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = invocation.config
    configure_logging("debug" if config.verbosity >= 4 else "info", config.log_format)
    for warning in invocation.warnings:
        log.warning("%s", warning)
    if config.defaults:
        mode = config.mode or "iptables"
        log.info("kube-proxy's defaults of %s mode applied: %s", mode, "; ".join(config.defaults))
    if invocation.cleanup:
        return cleanup([])
    done = command.prepare_node(invocation)
    if done is not None:
        return done
    pipeline = kpng_argv(config)
    log.info("running: kpng %s", shlex.join(pipeline))
    return pipeline


SPEC = CommandSpec(
    name="kube-proxy", help="a drop-in for kube-proxy: takes its flags and config file", run=_run
)
