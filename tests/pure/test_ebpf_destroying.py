"""When to-ebpf destroys connected UDP sockets, as plain data: which privileges it checks for,
how it finds the cgroup's processes (and those it cannot see), and which map changes make it
look for sockets of gone endpoints. The kernel tests run the destroy itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from kpng.backends.ebpf import namespaces, system
from kpng.backends.ebpf.balancing import _may_take_endpoints
from kpng.backends.ebpf.entries import MapChanges

ADMIN, PTRACE = 1 << system.CAP_SYS_ADMIN, 1 << system.CAP_SYS_PTRACE


@pytest.mark.parametrize(
    ("caps", "missing"),
    [
        (ADMIN | PTRACE, None),
        (PTRACE, "lacks CAP_SYS_ADMIN to"),
        (ADMIN, "lacks CAP_SYS_PTRACE to"),
        (0, "lacks CAP_SYS_ADMIN and CAP_SYS_PTRACE to"),
    ],
)
def test_entering_the_pods_namespaces_takes_sys_admin_and_sys_ptrace(
    caps: int, missing: str | None
) -> None:
    reason = namespaces.missing_privileges(caps)
    assert (reason is None) == (missing is None)
    if missing is not None:
        assert reason is not None
        assert missing in reason


def test_the_effective_capabilities_are_read_from_proc_status() -> None:
    status = "Name:\tkpng\nCapInh:\t0000000000000000\nCapEff:\t0000000000280000\n"
    assert system.capabilities(status=status) == ADMIN | PTRACE


def test_the_cgroups_processes_are_found_below_it_and_unseen_ones_counted(
    tmp_path: Path,
) -> None:
    """cgroup.procs shows 0 for a process outside the reader's PID namespace: a pod without
    hostPID sees the node's processes so."""
    (tmp_path / "pod-a").mkdir()
    (tmp_path / "cgroup.procs").write_text("1\n0\n0\n")
    (tmp_path / "pod-a" / "cgroup.procs").write_text("42\n")
    assert sorted(namespaces.pids(tmp_path)) == [0, 0, 1, 42]
    assert namespaces.unseen_processes(tmp_path) == 2


@pytest.mark.parametrize(
    ("changes", "looks"),
    [
        (MapChanges(full=True), True),
        (MapChanges(deletes=[("kpng_members", [b"k"])]), True),
        (MapChanges(deletes=[("kpng_frontends", [b"k"])]), True),
        # A new endpoint, a new service: no socket can have lost its endpoint.
        (
            MapChanges(updates=[("kpng_slots", [(b"k", b"v")]), ("kpng_sets", [(b"k", b"v")])]),
            False,
        ),
        # A slot freed by an endpoint that goes comes with its member's delete (UDP always has
        # members); a slot alone is a set that shrank without members: TCP, no affinity.
        (MapChanges(deletes=[("kpng_slots", [b"k"])]), False),
    ],
)
def test_only_changes_that_may_take_an_endpoint_look_for_sockets(
    changes: MapChanges, looks: bool
) -> None:
    assert _may_take_endpoints(changes) == looks
