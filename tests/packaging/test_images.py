"""OCI archives (rig.images): what ctr imports, checked byte for byte, and imported
into a real containerd and run."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from rig import images
from rig.images import ImageConfig, compress, tar_directory, write_archive


def _tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    (root / "bin" / "tool").chmod(0o755)
    (root / "etc").mkdir()
    (root / "etc" / "config").write_text("key = value\n")
    (root / "etc" / "config").chmod(0o600)
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    os.link(root / "etc" / "config", root / "etc" / "config.hard")
    return root


def _read(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_a_layer_keeps_modes_links_and_order_and_nothing_of_the_machine(tmp_path: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(tar_directory(_tree(tmp_path / "root")))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert list(members) == sorted(members, key=lambda n: n.split("/"))
    assert members["bin/tool"].mode & 0o777 == 0o755
    assert members["etc/config"].mode & 0o777 == 0o600
    assert members["lib"].issym()
    assert members["lib"].linkname == "usr/lib"
    assert members["etc/config.hard"].islnk()
    assert members["etc/config.hard"].linkname == "etc/config"
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in members.values()} == {
        (0, 0, "", "", 0)
    }


def test_an_archive_is_an_oci_layout_whose_digests_and_sizes_hold(tmp_path: Path) -> None:
    layer = compress(tar_directory(_tree(tmp_path / "root")))
    refs = ["kpng.local/tool:1", "kpng.local/alias:2"]
    archive = write_archive(
        tmp_path / "image.tar", [layer], ImageConfig(entrypoint=["/bin/tool"]), refs
    )
    files = _read(archive)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert _sha(data) == "sha256:" + name.rsplit("/", 1)[1]
    index = json.loads(files["index.json"])
    descriptors = index["manifests"]
    assert [d["annotations"]["io.containerd.image.name"] for d in descriptors] == refs
    assert [d["annotations"]["org.opencontainers.image.ref.name"] for d in descriptors] == refs
    assert len({d["digest"] for d in descriptors}) == 1  # one image, two names
    manifest_bytes = files[f"blobs/sha256/{descriptors[0]['digest'][7:]}"]
    assert len(manifest_bytes) == descriptors[0]["size"]
    manifest: dict[str, Any] = json.loads(manifest_bytes)
    config_bytes = files[f"blobs/sha256/{manifest['config']['digest'][7:]}"]
    assert len(config_bytes) == manifest["config"]["size"]
    config = json.loads(config_bytes)
    assert config["config"]["Entrypoint"] == ["/bin/tool"]
    (described,) = manifest["layers"]
    blob = files[f"blobs/sha256/{described['digest'][7:]}"]
    assert described["size"] == len(blob)
    assert described["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    # The config names the uncompressed layer.
    assert config["rootfs"]["diff_ids"] == [_sha(gzip.decompress(blob))]


def test_archives_of_the_same_inputs_are_the_same_bytes(tmp_path: Path) -> None:
    first = compress(tar_directory(_tree(tmp_path / "a")))
    time.sleep(1.1)  # a later mtime on every file
    second = compress(tar_directory(_tree(tmp_path / "b")))
    assert first == second
    config = ImageConfig(entrypoint=["/bin/tool"])
    one = write_archive(tmp_path / "1.tar", [first], config, ["kpng.local/x:1"])
    two = write_archive(tmp_path / "2.tar", [second], config, ["kpng.local/x:1"])
    assert one.read_bytes() == two.read_bytes()


_RUNTIME = ("containerd", "ctr", "runc")


@pytest.mark.skipif(os.geteuid() != 0, reason="containerd needs root")
@pytest.mark.skipif(
    any(shutil.which(t) is None for t in _RUNTIME), reason=f"needs {', '.join(_RUNTIME)}"
)
@pytest.mark.skipif(shutil.which("go") is None, reason="the pause program is built with Go")
def test_containerd_imports_the_pause_image_and_runs_it() -> None:
    """A throwaway containerd of its own (root, state, socket): the archive imports under its
    name, runs, and stops at once on SIGTERM, as a pod sandbox must."""
    # Short and on a real file system: unix socket paths are limited, overlay needs ext4/xfs.
    work = Path(tempfile.mkdtemp(prefix="kpng-ctr-", dir="/var/tmp"))
    socket = work / "c.sock"
    (work / "config.toml").write_text(
        f'version = 2\nroot = "{work}/root"\nstate = "{work}/state"\n'
        f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{socket}"\n[ttrpc]\n  address = "{socket}.ttrpc"\n'
    )
    daemon = subprocess.Popen(
        ["containerd", "--config", str(work / "config.toml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def ctr(*args: str, check: bool = True) -> str:
        argv = ["ctr", "--address", str(socket), "-n", "kpng-test", *args]
        return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60).stdout

    try:
        deadline = time.monotonic() + 20
        while subprocess.run(
            ["ctr", "--address", str(socket), "version"], capture_output=True
        ).returncode:
            assert daemon.poll() is None, "containerd exited"
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.2)
        pause = images.pause_image()
        ctr("images", "import", str(pause.path))
        assert pause.reference in ctr("images", "ls", "-q").split()
        ctr("run", "-d", pause.reference, "sandbox")
        assert "RUNNING" in ctr("tasks", "ls")
        started = time.monotonic()
        ctr("tasks", "kill", "-s", "SIGTERM", "sandbox")
        while "STOPPED" not in ctr("tasks", "ls"):
            assert time.monotonic() - started < 5, "pause ignored SIGTERM"
            time.sleep(0.1)
    finally:
        ctr("tasks", "kill", "-s", "SIGKILL", "sandbox", check=False)
        ctr("tasks", "delete", "sandbox", check=False)
        ctr("containers", "delete", "sandbox", check=False)
        daemon.terminate()
        daemon.wait(15)
        subprocess.run(["umount", "-R", str(work)], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
