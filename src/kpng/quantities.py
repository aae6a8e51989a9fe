"""Sizes as Kubernetes writes them (``256Mi``), also accepted as plain bytes. Only the binary
suffixes: a limit of memory is a power of two, and a decimal ``M`` read as ``Mi`` would be a
silent 5 % off."""

from __future__ import annotations

import re

_SUFFIXES = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
_QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi)?")


def parse_bytes(text: str) -> int:
    """Bytes in ``text``, digits alone or followed by Ki, Mi or Gi; ValueError otherwise."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 1048576, 512Ki, 16Mi, 1Gi)")
    return int(match[1]) * _SUFFIXES[match[2] or ""]
