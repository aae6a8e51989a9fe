"""Connected UDP sockets destroyed once their endpoint is gone (``udp_destroy.bpf.c``).

A UDP iterator walks the sockets of the network namespace its reader was in when the iterator
was created: kpng creates one in each network namespace that has a process in the cgroup the
programs are attached to (every pod's, the node's), from a thread of its own that enters them
one after the other with setns, which moves only the calling thread.

What that takes, beyond loading the programs:

- CAP_SYS_ADMIN: setns into another network namespace (it also stands for CAP_PERFMON, which the
  kernel asks of a tracing program such as an iterator);
- CAP_SYS_PTRACE: opening /proc/PID/ns/net of a process of another user, or one with
  capabilities kpng lacks (the kernel checks ptrace's read access);
- the host's PID namespace (a pod's ``hostPID``): the cgroup's processes are found by their
  PIDs in its ``cgroup.procs`` files, which show 0 for a process kpng's PID namespace does not
  see.

Without any of them, or on a kernel without bpf_sock_destroy, kpng does not load the iterator
and sockets.bpf.c leaves connected UDP sockets to the nftables part (``unavailable``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kpng.backends.ebpf import system
from kpng.backends.ebpf.libbpf import BpfError, BpfIterator, BpfObject

log = logging.getLogger(__name__)

PROGRAM = "kpng_udp_destroy"
_COOKIE_SIZE = 8


def missing_privileges(capabilities: int | None = None) -> str | None:
    """Why this process cannot enter other processes' network namespaces, or None."""
    caps = system.capabilities() if capabilities is None else capabilities
    missing = [
        name
        for name, bit in (
            ("CAP_SYS_ADMIN", system.CAP_SYS_ADMIN),
            ("CAP_SYS_PTRACE", system.CAP_SYS_PTRACE),
        )
        if not caps >> bit & 1
    ]
    if missing:
        return f"kpng lacks {' and '.join(missing)} to enter the pods' network namespaces"
    return None


def pids(cgroup: Path) -> Iterator[int]:
    """The PIDs of the processes in ``cgroup`` and below, as this process's PID namespace
    numbers them (0: a process it does not see)."""
    for directory, _, _ in os.walk(cgroup):
        try:
            text = Path(directory, "cgroup.procs").read_text()
        except OSError:  # a cgroup removed meanwhile
            continue
        for line in text.split():
            yield int(line)


def unseen_processes(cgroup: Path) -> int:
    """How many processes of ``cgroup`` this process's PID namespace does not see."""
    return sum(1 for pid in pids(cgroup) if pid == 0)


def unavailable(cgroup: Path) -> str | None:
    """Why kpng cannot destroy sockets in every network namespace of ``cgroup``, or None (the
    kernel's part is tried by loading the program)."""
    missing = missing_privileges()
    if missing is not None:
        return missing
    unseen = unseen_processes(cgroup)
    if unseen:
        return (
            f"{unseen} processes of cgroup {cgroup} are outside kpng's PID namespace (a pod "
            "needs hostPID)"
        )
    return None


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
        # A thread of its own: setns moves the calling thread, and this one ends with the
        # sweep, never to run anything else in a pod's namespace.
        worker = threading.Thread(target=self._in_each_namespace, args=(done,), name="kpng-udp")
        worker.start()
        worker.join()
        return done

    def _in_each_namespace(self, done: Sweep) -> None:
        try:
            self._enter_each(done)
        except Exception as exc:  # a thread's exception would otherwise go unreported
            done.failures.append(f"the sweep stopped: {exc}")

    def _enter_each(self, done: Sweep) -> None:
        own = os.stat("/proc/thread-self/ns/net").st_ino
        seen = {own}
        self._run(done, "kpng's own")
        for pid in pids(self._cgroup):
            if pid == 0:
                continue
            path = f"/proc/{pid}/ns/net"
            try:
                inode = os.stat(path).st_ino
                if inode in seen:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, ProcessLookupError):
                continue  # the process exited meanwhile
            except OSError as exc:
                done.failures.append(f"{path}: {exc.strerror}")
                continue
            seen.add(inode)
            try:
                system.enter_netns(fd)
            except OSError as exc:
                done.failures.append(f"{path}: {exc.strerror}")
                continue
            finally:
                os.close(fd)
            self._run(done, f"process {pid}'s")

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
