"""The objects to-ebpf ships: each is the compile of today's source (regenerated and committed
with it), the same bytes wherever it is compiled with the same clang; the cgroup programs load
on any kernel from the minimum on (no CO-RE relocation, so no kernel BTF needed), the socket
destroy iterator only where the kernel has BTF; to-ebpf refuses to start, saying why, on an
older kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kpng.backends.ebpf import system, toolchain
from kpng.cli import main
from kpng.errors import EXIT_ERROR
from tests.conftest import EXAMPLE

needs_clang = pytest.mark.skipif(
    toolchain.compiler_unavailable() is not None, reason=str(toolchain.compiler_unavailable())
)
UNITS = pytest.mark.parametrize("unit", toolchain.UNITS, ids=lambda u: u.object.name)


@UNITS
def test_the_shipped_object_is_the_compile_of_the_source(unit: toolchain.Unit) -> None:
    made = toolchain.manifest()
    assert made is not None, f"{toolchain.MANIFEST} is missing: run `make bpf-object`"
    for path in unit.inputs:
        assert made[f"{path.name} sha256"] == toolchain.digest(path), (
            f"{path.name} changed after {unit.object.name} was made: run `make bpf-object` "
            "and commit the objects and their manifest"
        )
    assert made[f"{unit.object.name} sha256"] == toolchain.digest(unit.object)
    assert made["flags"] == " ".join(toolchain.FLAGS)
    assert toolchain.shipped_object(unit) == unit.object
    assert toolchain.ensure_object(unit=unit) == unit.object


@needs_clang
@UNITS
def test_compiling_again_gives_the_same_bytes_anywhere(
    tmp_path: Path, unit: toolchain.Unit
) -> None:
    """Compiled from a copy in another directory: no path of the checkout in the object. With
    the clang that made the shipped object, the very same bytes."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for path in unit.inputs:
        (elsewhere / path.name).write_bytes(path.read_bytes())
    copy = elsewhere / unit.source.name
    here = toolchain.compile_object(tmp_path / "here.o", unit.source)
    there = toolchain.compile_object(tmp_path / "there.o", copy)
    assert here.read_bytes() == there.read_bytes()
    assert str(unit.source.parent).encode() not in here.read_bytes()
    made = toolchain.manifest()
    assert made is not None
    if made["compiler"] != toolchain.compiler_version():
        pytest.skip(f"the shipped object was made by {made['compiler']}")
    assert here.read_bytes() == unit.object.read_bytes()


def test_the_cgroup_programs_have_no_co_re_relocation_so_need_no_kernel_btf() -> None:
    """The programs read only their UAPI context, which the verifier maps to each kernel's
    layout itself: nothing for libbpf to relocate against /sys/kernel/btf/vmlinux."""
    found = toolchain.sections(toolchain.SOCKETS.object)
    programs = sorted(name for name in found if name.startswith("cgroup/"))
    assert programs == [
        f"cgroup/{hook}{family}"
        for hook in ("connect", "getpeername", "recvmsg", "sendmsg")
        for family in "46"
    ]
    assert ".BTF" in found  # the maps' definitions
    assert toolchain.core_relocations(toolchain.SOCKETS.object) == 0


def test_the_co_re_relocations_are_the_destroy_iterators_alone() -> None:
    """udp_destroy.bpf.o reads struct sock, relocated against the kernel's BTF: a separate
    object, one program, so that sockets.bpf.o loads where that BTF is missing."""
    found = toolchain.sections(toolchain.UDP_DESTROY.object)
    assert [name for name in found if "/" in name and not name.startswith(".")] == ["iter/udp"]
    assert toolchain.core_relocations(toolchain.UDP_DESTROY.object) > 0


def _definitions(source: str) -> set[str]:
    """The names of the structs and maps a BPF source defines."""
    found = {m[1] for m in re.finditer(r"^struct (\w+) \{", source, re.M)}
    return found | {m[1] for m in re.finditer(r'^\} (\w+) SEC\("\.maps"\);', source, re.M)}


def test_the_destroy_iterator_reads_the_maps_as_the_cgroup_programs_write_them() -> None:
    """Both sources take the maps they share, and the structs of their keys and values, from
    maps.bpf.h, and define none of them again: a drift of a key's layout would have the
    iterator look up keys that are never there."""
    shared = _definitions(toolchain.MAPS_HEADER.read_text())
    assert {"kpng_frontends", "kpng_members", "kpng_revnat", "revnat_key", "endpoint"} <= shared
    for unit in toolchain.UNITS:
        source = unit.source.read_text()
        assert '#include "maps.bpf.h"' in source
        assert toolchain.MAPS_HEADER in unit.headers
        assert not _definitions(source) & shared
    kernel = _definitions(toolchain.UDP_DESTROY.source.read_text())
    assert kernel == {"sock_common", "sock", "bpf_iter_meta", "bpf_iter__udp"}


def test_a_change_to_the_header_asks_for_a_new_compile(tmp_path: Path) -> None:
    """The cache of a compile is named by the source's and the header's hashes: a header
    changed after the shipped object is a different compile."""
    header = tmp_path / "maps.bpf.h"
    header.write_bytes(toolchain.MAPS_HEADER.read_bytes())
    unit = toolchain.Unit(toolchain.SOCKETS.source, toolchain.SOCKETS.object, (header,))
    before = toolchain.object_path(tmp_path, unit)
    header.write_text(header.read_text() + "/* changed */\n")
    assert toolchain.object_path(tmp_path, unit) != before
    assert toolchain.shipped_object(unit) is None


@needs_clang
def test_a_kernel_struct_read_would_show_as_co_re_relocations(tmp_path: Path) -> None:
    """The check above can fail: a read of a kernel struct is a CO-RE relocation."""
    source = tmp_path / "core.bpf.c"
    source.write_text(
        "#include <linux/bpf.h>\n#include <bpf/bpf_helpers.h>\n"
        "struct task_struct { int pid; } __attribute__((preserve_access_index));\n"
        'SEC("kprobe/x") int f(void *ctx) {\n'
        "  struct task_struct *t = (void *)bpf_get_current_task(); return t->pid; }\n"
        'char LICENSE[] SEC("license") = "GPL";\n'
    )
    assert toolchain.core_relocations(toolchain.compile_object(tmp_path / "core.o", source)) > 0


@pytest.mark.parametrize(
    ("release", "version"),
    [
        ("6.1.0-18-amd64", (6, 1)),
        ("5.15.0-1051-aws", (5, 15)),
        ("5.8.0-rc1", (5, 8)),
        ("5.10.209+", (5, 10)),
        ("4.18.0-513.el8.x86_64", (4, 18)),
        ("6.18.44-fc-v669", (6, 18)),
        ("5.80", (5, 80)),
        ("linux", None),
        ("6", None),
    ],
)
def test_a_kernel_release_reads_as_major_and_minor(
    release: str, version: tuple[int, int] | None
) -> None:
    assert system.parse_release(release) == version


@pytest.mark.parametrize(
    ("release", "refused", "missing"),
    [
        ("6.1.0-18-amd64", False, None),
        ("5.8.0-63-generic", False, None),
        ("5.10.0-28-cloud-amd64", False, None),
        ("5.7.19", True, "getpeername"),
        ("5.4.0-150-generic", True, "BPF links for cgroups"),
        ("4.18.0-513.el8.x86_64", True, "recvmsg"),
        ("4.19.0-26-amd64", True, "bpf_sock_addr's sk"),
        ("unknown", True, None),
    ],
)
def test_to_ebpf_runs_from_linux_5_8_and_says_what_an_older_kernel_lacks(
    release: str, refused: bool, missing: str | None
) -> None:
    reason = system.kernel_too_old(release)
    assert (reason is not None) == refused
    if reason is not None:
        assert release in reason
    if missing is not None:
        assert reason is not None
        assert "needs Linux 5.8 or later" in reason
        assert missing in reason
    if release.startswith("5.7"):
        assert reason is not None
        assert "bpf_get_netns_cookie" not in reason  # 5.7 has it


def test_the_minimum_is_the_newest_feature_used() -> None:
    assert max(since for _, since in system.KERNEL_FEATURES) == system.MINIMUM_KERNEL
    # What to-ebpf does without where the kernel lacks it is newer than the minimum.
    assert min(since for _, since in system.OPTIONAL_FEATURES) > system.MINIMUM_KERNEL


def test_to_ebpf_refuses_to_start_on_an_older_kernel(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before it touches the node: one line that says why, not the verifier's refusals."""
    monkeypatch.setattr(system, "running_release", lambda: "5.4.0-150-generic")
    argv = ["file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-1", "to-ebpf"]
    assert main(argv) == EXIT_ERROR
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage().startswith(
        "to-ebpf needs Linux 5.8 or later; this kernel is 5.4.0-150-generic, without:"
    )
