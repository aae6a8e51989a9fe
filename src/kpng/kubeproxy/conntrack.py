"""The conntrack sysctls kube-proxy sets at start: which values (pure), and writing them.

kube-proxy writes a sysctl only when its value differs, and so does kpng: a privileged init
container (``kpng kube-proxy --init-only``) sets them, and the unprivileged proxy that follows
finds nothing left to write.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from kpng.kubeproxy.config import ConntrackConfig

log = logging.getLogger(__name__)

PROC_SYS = Path("/proc/sys")
HASHSIZE = Path("/sys/module/nf_conntrack/parameters/hashsize")


@dataclass(frozen=True)
class Setting:
    path: Path
    value: int


def settings(config: ConntrackConfig, cpus: int, *, root: Path = PROC_SYS) -> list[Setting]:
    """What kube-proxy would write for ``config`` on a machine with ``cpus`` CPUs."""
    netfilter = root / "net" / "netfilter"
    out: list[Setting] = []
    if config.max_per_core > 0:
        out.append(
            Setting(netfilter / "nf_conntrack_max", max(config.max_per_core * cpus, config.min))
        )
    for name, seconds in (
        ("nf_conntrack_tcp_timeout_established", config.tcp_established_timeout_s),
        ("nf_conntrack_tcp_timeout_close_wait", config.tcp_close_wait_timeout_s),
        ("nf_conntrack_udp_timeout", config.udp_timeout_s),
        ("nf_conntrack_udp_timeout_stream", config.udp_stream_timeout_s),
    ):
        if seconds > 0:
            out.append(Setting(netfilter / name, int(seconds)))
    if config.tcp_be_liberal:
        out.append(Setting(netfilter / "nf_conntrack_tcp_be_liberal", 1))
    return out


def apply(wanted: list[Setting], *, hashsize: Path = HASHSIZE) -> list[str]:
    """Write the settings that differ (and conntrack's hash size, to a quarter of its maximum,
    as kube-proxy); the problems, one line each (an unwritable /proc/sys, conntrack not
    loaded)."""
    problems: list[str] = []
    for setting in wanted:
        try:
            current = int(setting.path.read_text().split()[0])
        except FileNotFoundError:
            # The module loads with the first rule that uses it, with the kernel's defaults.
            log.warning("conntrack is not loaded: %s keeps the kernel's default", setting.path)
            continue
        except (OSError, ValueError, IndexError) as exc:
            problems.append(f"cannot read {setting.path}: {exc}")
            continue
        if current == setting.value:
            continue
        try:
            setting.path.write_text(f"{setting.value}\n")
        except OSError as exc:
            problems.append(
                f"cannot set {setting.path} to {setting.value} (it is {current}): {exc}"
            )
            continue
        log.info("set %s to %d (was %d)", setting.path, setting.value, current)
        if setting.path.name == "nf_conntrack_max":
            problems += _grow_hashsize(hashsize, setting.value // 4)
    return problems


def _grow_hashsize(path: Path, wanted: int) -> list[str]:
    try:
        if int(path.read_text()) >= wanted:
            return []
        path.write_text(f"{wanted}\n")
    except (OSError, ValueError) as exc:
        return [f"cannot set {path} to {wanted}: {exc}"]
    log.info("set %s to %d", path, wanted)
    return []
