"""Connected UDP sockets destroyed once their endpoint is gone (``udp_destroy.bpf.c``).

A UDP iterator walks the sockets of the network namespace its reader was in when the iterator
was created: kpng runs one in its own namespace and in each that has a process in the cgroup the
programs are attached to (every pod's), entering them with ``namespaces.visit``.

Only with ``--connected-udp destroy``: by default connected UDP sockets are left to the
nftables part, whose conntrack entry moves when their endpoint goes, and the application's
socket keeps working. Without the privileges the iterator takes (``namespaces``), or on a kernel
without bpf_sock_destroy, kpng does not load it and sockets.bpf.c leaves connected UDP sockets
to the nftables part all the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kpng.backends.ebpf import namespaces
from kpng.backends.ebpf.libbpf import BpfError, BpfIterator, BpfObject

log = logging.getLogger(__name__)

PROGRAM = "kpng_udp_destroy"
_COOKIE_SIZE = 8


@dataclass
class Sweep:
    """What a run of the iterator in every namespace did."""

    namespaces: int = 0
    destroyed: int = 0
    failures: list[str] = field(default_factory=list)


class UdpDestroyer:
    """The iterator of ``udp_destroy.bpf.c``, loaded (with the pinned maps of ``pin_root``) and
    attached, run in every network namespace of ``cgroup`` by ``sweep``."""

    def __init__(self, path: Path, pin_root: Path, cgroup: Path) -> None:
        self._cgroup = cgroup
        self._object = BpfObject(path, pin_root)
        try:
            self._iterator = BpfIterator(self._object.program(PROGRAM), PROGRAM)
        except BpfError:
            self._object.close()
            raise

    def sweep(self) -> Sweep:
        """Destroy, in every network namespace with a process in the cgroup, the connected UDP
        sockets kpng translated whose endpoint no longer serves their frontend."""
        done = Sweep()
        self._run(done, "kpng's own")
        found = namespaces.found(self._cgroup)
        failures = namespaces.visit(found, lambda i: self._run(done, f"process {found[i]}'s"))
        done.failures += failures.values()
        return done

    def _run(self, done: Sweep, whose: str) -> None:
        try:
            written = self._iterator.run()
        except BpfError as exc:
            done.failures.append(f"{whose} network namespace: {exc}")
            return
        done.namespaces += 1
        done.destroyed += len(written) // _COOKIE_SIZE

    def close(self) -> None:
        self._iterator.close()
        self._object.close()
