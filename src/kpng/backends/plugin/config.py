"""Which plugins to feed: ``--plugin NAME=unix:///PATH[,config=FILE]`` and plugin directories.
Pure: the directory is given as the names it holds."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kpng.client import UsageError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SOCKET_SUFFIX = ".sock"
CONFIG_SUFFIX = ".conf"


@dataclass(frozen=True)
class PluginSpec:
    name: str
    socket: Path
    config: Path | None = None
    """The plugin's configuration file, handed to it as bytes by Configure."""
    config_optional: bool = False
    """A missing config file means an empty configuration (plugin directories), rather than an
    error (a file named with ``config=``)."""

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"


def parse_plugin(text: str) -> PluginSpec:
    """``NAME=unix:///PATH[,config=FILE]``; ``UsageError`` with the reason otherwise."""
    name, sep, rest = text.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise UsageError(f"--plugin {text}: expected NAME=unix:///PATH[,config=FILE]")
    url, *options = rest.split(",")
    if not url.startswith("unix:///"):
        raise UsageError(f"--plugin {text}: a plugin is a unix socket, unix:///PATH")
    config: Path | None = None
    for option in options:
        key, sep, value = option.partition("=")
        if key != "config" or not sep or not value or config is not None:
            raise UsageError(f"--plugin {text}: unknown option {option!r} (only config=FILE)")
        config = Path(value)
    return PluginSpec(name=name, socket=Path(url.removeprefix("unix://")), config=config)


def check_unique(specs: Iterable[PluginSpec]) -> list[PluginSpec]:
    seen: set[str] = set()
    out = []
    for spec in specs:
        if spec.name in seen:
            raise UsageError(f"--plugin {spec.name}: named twice")
        seen.add(spec.name)
        out.append(spec)
    return out


def plugins_in_directory(directory: Path, entries: Iterable[str]) -> dict[str, PluginSpec]:
    """The plugins a directory holding ``entries`` offers: each ``NAME.sock``, with
    ``NAME.conf`` beside it as its (optional) configuration."""
    plugins = {}
    for entry in entries:
        name = entry.removesuffix(SOCKET_SUFFIX)
        if entry.endswith(SOCKET_SUFFIX) and _NAME.fullmatch(name):
            plugins[name] = PluginSpec(
                name=name,
                socket=directory / entry,
                config=directory / f"{name}{CONFIG_SUFFIX}",
                config_optional=True,
            )
    return plugins
