"""The file systems to-ebpf needs: a cgroup2 hierarchy to attach to, and bpffs to pin in.

cgroup BPF programs attach to cgroup2 directories only. A host on cgroup v1 (this project's CI
machine, older distributions) still has a cgroup2 hierarchy in the kernel, holding every
process at its root; when nothing mounts it, kpng mounts it at ``/run/kpng/cgroup2`` (under
/run: it lives as long as the boot, as the links pinned to it). bpffs is mounted at
``/sys/fs/bpf`` when it is not, as systemd and Cilium do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from kpng.backends.ebpf.libbpf import BpfError

MOUNTINFO = Path("/proc/self/mountinfo")
KPNG_CGROUP2 = Path("/run/kpng/cgroup2")
BPFFS = Path("/sys/fs/bpf")


def mounts(fstype: str, mountinfo: str | None = None) -> list[Path]:
    """The mount points of file systems of ``fstype`` (pure over ``mountinfo``'s text)."""
    text = MOUNTINFO.read_text() if mountinfo is None else mountinfo
    found = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if fields[sep + 1] == fstype:
            found.append(Path(fields[4].replace("\\040", " ")))
    return found


def _mount(fstype: str, target: Path) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    target.mkdir(parents=True, exist_ok=True)
    if libc.mount(fstype.encode(), str(target).encode(), fstype.encode(), 0, None) != 0:
        number = ctypes.get_errno()
        raise BpfError(f"cannot mount {fstype} at {target}: {os.strerror(number)}")


def cgroup2_root() -> Path:
    """A mount point of the cgroup2 hierarchy, mounting one if there is none."""
    found = mounts("cgroup2")
    if found:
        return found[0]
    _mount("cgroup2", KPNG_CGROUP2)
    return KPNG_CGROUP2


def ensure_bpffs(pin_dir: Path) -> None:
    """Make sure ``pin_dir`` is on bpffs, mounting it at /sys/fs/bpf if that is what it needs."""
    points = mounts("bpf")
    if any(pin_dir == p or p in pin_dir.parents for p in points):
        return
    if pin_dir == BPFFS or BPFFS in pin_dir.parents:
        _mount("bpf", BPFFS)
        return
    raise BpfError(f"{pin_dir} is not on a bpf file system (mount -t bpf bpf DIR)")
