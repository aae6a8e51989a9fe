"""``to-file``: the global state written to a file (or stdout) at each revision, as a globalv1 dump.

The file is replaced atomically (written aside, then renamed), so a reader never sees half a
dump; ``kpng file --input`` reads it back.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kpng.model import dumping
from kpng.store import Store


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def run_file(store: Store, *, output: Path, once: bool = False) -> None:
    subscription = store.subscribe()
    try:
        async for delta in subscription:
            data = dumping.dump(
                revision=delta.revision,
                services=store.services,
                slices=store.slices,
                nodes=store.nodes,
            )
            if str(output) == "-":
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            else:
                write_atomically(output, data)
            if once:
                return
    finally:
        subscription.close()
