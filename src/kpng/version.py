"""``kpng version`` (and ``kpng --version``): what this kpng is made of, for bug reports."""

from __future__ import annotations

import platform

from kpng import __version__

WIRE_API = ("localv1", "globalv1", "kpng.batchv1", "kpng.pluginv1")
"""The proto packages kpng speaks (src/kpng/api); docs/design/versioning.md says how they evolve."""


def report() -> str:
    # Imported here: only this command looks for libnftables.
    from kpng.backends._nftables.executing import libnftables_version

    return "\n".join(
        [
            f"kpng {__version__}",
            f"wire API: {' '.join(WIRE_API)} (localv1 and globalv1 as Go KPNG's, with kpng's "
            "fields from 100 up)",
            f"Python {platform.python_version()} ({platform.python_implementation()})",
            f"libnftables: {libnftables_version()}",
        ]
    )
