"""The network namespaces of a cgroup's processes (every pod's, the node's), and a thread that
enters them one after the other: what to-ebpf does in each pod's namespace (``destroying``,
``locality``) has to run there, since a socket iterator walks, and rtnetlink answers for, the
namespace of the thread that asks. setns moves only the calling thread, and that thread ends
with the visit, never to run anything else in a pod's namespace.

What entering takes:

- CAP_SYS_ADMIN: setns into another network namespace (it also stands for CAP_PERFMON, which the
  kernel asks of a tracing program such as an iterator);
- CAP_SYS_PTRACE: opening /proc/PID/ns/net of a process of another user, or one with
  capabilities kpng lacks (the kernel checks ptrace's read access);
- the host's PID namespace (a pod's ``hostPID``): the cgroup's processes are found by their
  PIDs in its ``cgroup.procs`` files, which show 0 for a process kpng's PID namespace does not
  see.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from kpng.backends.ebpf import system


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
    """Why kpng cannot enter every network namespace of ``cgroup``, or None."""
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


def own() -> int:
    """The inode number of kpng's own network namespace (the node's)."""
    return os.stat("/proc/self/ns/net").st_ino


def found(cgroup: Path) -> dict[int, int]:
    """The network namespaces with a process in ``cgroup``, but kpng's own: a PID in each, by
    the namespace's inode number. Only stats: nothing is entered."""
    mine = own()
    namespaces: dict[int, int] = {}
    for pid in pids(cgroup):
        if pid == 0:
            continue
        try:
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:  # the process exited meanwhile, or is not ours to look at
            continue
        if inode != mine:
            namespaces.setdefault(inode, pid)
    return namespaces


def visit(namespaces: Mapping[int, int], each: Callable[[int], None]) -> dict[int, str]:
    """``each(inode)`` run in every namespace of ``namespaces`` (``found``'s), from a thread of
    its own; why each that could not be entered or failed there did, by inode."""
    failures: dict[int, str] = {}

    def enter_each() -> None:
        for inode, pid in namespaces.items():
            path = f"/proc/{pid}/ns/net"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, ProcessLookupError):
                continue  # the process exited meanwhile
            except OSError as exc:
                failures[inode] = f"{path}: {exc.strerror}"
                continue
            try:
                if os.fstat(fd).st_ino != inode:
                    continue  # the PID is another process's now
                system.enter_netns(fd)
            except OSError as exc:
                failures[inode] = f"{path}: {exc.strerror}"
                continue
            finally:
                os.close(fd)
            try:
                each(inode)
            except Exception as exc:  # a thread's exception would otherwise go unreported
                failures[inode] = f"process {pid}'s network namespace: {exc}"

    worker = threading.Thread(target=enter_each, name="kpng-netns")
    worker.start()
    worker.join()
    return failures
