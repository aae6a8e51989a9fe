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
import functools
import os
import re
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
        try:
            _mount("bpf", BPFFS)
        except BpfError as exc:
            # A pod: a bpffs mounted in its own mount namespace would go with it, and the pins
            # with it; the host's must be given to it.
            raise BpfError(
                f"{exc}: in a pod, mount bpffs at {BPFFS} on the host (systemd does) and give "
                "the pod that hostPath"
            ) from exc
        return
    raise BpfError(f"{pin_dir} is not on a bpf file system (mount -t bpf bpf DIR)")


MINIMUM_KERNEL = (5, 8)
"""The oldest Linux to-ebpf runs on: the newest of ``KERNEL_FEATURES``."""

KERNEL_FEATURES = (
    ("cgroup/connect4 and connect6 hooks, bpf_sock's src_port", (4, 17)),
    ("cgroup/sendmsg4 and sendmsg6 hooks", (4, 18)),
    ("cgroup/recvmsg4 and recvmsg6 hooks", (5, 2)),
    ("bpf_sock_addr's sk (the sending socket's bound port)", (5, 3)),
    ("batched map updates, deletes and lookups", (5, 6)),
    ("bpf_get_socket_cookie in sock_addr programs", (4, 19)),
    ("bpf_get_netns_cookie in sock_addr programs", (5, 7)),
    ("BPF links for cgroups, pinned, switched with BPF_LINK_UPDATE", (5, 7)),
    ("cgroup/getpeername4 and getpeername6 hooks", (5, 8)),
    ("CAP_BPF (loading without CAP_SYS_ADMIN)", (5, 8)),
)
"""What the programs and their loading use, and the release that brought each."""

OPTIONAL_FEATURES = (
    (
        "bpf_sock_destroy from iter/udp programs: --connected-udp destroy",
        (6, 5),
    ),
)
"""What to-ebpf uses where the kernel has it, and otherwise does without (saying so at start)."""


def parse_release(release: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a kernel release string (``6.1.0-18-amd64``, ``5.15.0-1051-aws``,
    ``5.8.0-rc1``), or None if it does not start with one."""
    found = re.match(r"(\d+)\.(\d+)(?!\d)", release)
    return (int(found[1]), int(found[2])) if found else None


def running_release() -> str:
    return os.uname().release


def kernel_too_old(release: str | None = None) -> str | None:
    """Why this kernel (``release``, default the running one's) cannot run to-ebpf, or None."""
    release = running_release() if release is None else release
    version = parse_release(release)
    if version is None:
        return f"to-ebpf cannot read the kernel's version from its release {release!r}"
    if version >= MINIMUM_KERNEL:
        return None
    missing = [what for what, since in KERNEL_FEATURES if since > version]
    return (
        f"to-ebpf needs Linux {'.'.join(map(str, MINIMUM_KERNEL))} or later; this kernel is "
        f"{release}, without: {'; '.join(missing)}. Use to-nft on this node."
    )


CLONE_NEWNET = 0x40000000
CAPABILITIES = {"NET_ADMIN": 12, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "SYS_RESOURCE": 24, "BPF": 39}
"""The capabilities to-ebpf's manifests add, by their number in the kernel's sets."""
CAP_SYS_PTRACE = CAPABILITIES["SYS_PTRACE"]
CAP_SYS_ADMIN = CAPABILITIES["SYS_ADMIN"]


def capabilities(kind: str = "CapEff", status: str | None = None) -> int:
    """One of this process's capability sets (``CapEff``, ``CapBnd``...), as a bit set (pure
    over ``status``'s text, that of /proc/self/status)."""
    text = Path("/proc/self/status").read_text() if status is None else status
    for line in text.splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1], 16)
    return 0


def enter_netns(fd: int) -> None:
    """Move the calling thread, and only it, into the network namespace open at ``fd``.
    (Python 3.11 has no os.setns.)"""
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"setns: {os.strerror(number)}")


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, loaded once: a sweep enters one namespace per pod."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
