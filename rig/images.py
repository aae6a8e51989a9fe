"""Container images without a registry: OCI archives built from Debian's packages and local
binaries, for ``ctr images import``.

No registry is reachable here, and a user without one needs the same: kpng's image
(``deploy/Containerfile`` for those with a registry, ``deploy/build-image`` for the rest), and,
for the real-node tests, the images upstream's e2e suite runs (agnhost, pause, and the re-tags it
knows as nginx, busybox and distroless-iptables), CoreDNS, and kube-proxy as the baseline.

- Base layers are Debian root file systems made by ``mmdebstrap`` from the machine's mirror,
  without documentation, man pages or locales, cached by their package list.
- kpng's layer is a virtualenv at ``/opt/kpng`` for the image's own ``/usr/bin/python3``, filled by
  the machine's pip with kpng's wheel and its runtime dependencies (cp311 manylinux wheels, which
  bookworm's Python 3.11 loads), byte-compiled once since the root file system is read-only.
- Layers are reproducible: entries sorted, owned by root, with a fixed mtime, gzip without a
  timestamp; archives are cached by their layers' digests.

    python -m rig.images kpng --output kpng.oci.tar
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kpng
from rig.cluster import (
    COREDNS_VERSION,
    _go,
    cache_root,
    ensure_go_program,
    ensure_programs,
    kubernetes_release,
    kubernetes_source,
)

log = logging.getLogger(__name__)

LOCAL_REGISTRY = "kpng.local"
SUITE = "bookworm"
_EPOCH = 0
"""Every file's mtime in a layer: images built from the same inputs are the same bytes."""

E2E_REPO_LIST = {
    "promoterE2eRegistry": f"{LOCAL_REGISTRY}/e2e-test-images",
    "gcRegistry": LOCAL_REGISTRY,
    "buildImageRegistry": f"{LOCAL_REGISTRY}/build-image",
}
"""``KUBE_TEST_REPO_LIST`` for e2e.test: the registries its images come from, all local."""

_E2E_IMAGE = re.compile(r'configs\[(\w+)\] = Config\{list\.(\w+), "([^"]+)", "([^"]+)"\}')
_E2E_REGISTRIES = {
    "PromoterE2eRegistry": E2E_REPO_LIST["promoterE2eRegistry"],
    "GcRegistry": E2E_REPO_LIST["gcRegistry"],
    "BuildImageRegistry": E2E_REPO_LIST["buildImageRegistry"],
}


@functools.cache
def e2e_images(kubernetes_version: str | None = None) -> dict[str, str]:
    """The images the release's e2e suite runs, by its name for them (``Agnhost``, ``Pause``...),
    as local references: read from its test/utils/image/manifest.go, since each release moves
    their tags (agnhost 2.59 in 1.35, 2.66.1 in 1.37)."""
    manifest = kubernetes_source(kubernetes_version) / "test/utils/image/manifest.go"
    found = {}
    for name, registry, image, tag in _E2E_IMAGE.findall(manifest.read_text()):
        if registry in _E2E_REGISTRIES:
            found[name] = f"{_E2E_REGISTRIES[registry]}/{image}:{tag}"
    return found


def agnhost_reference() -> str:
    return e2e_images()["Agnhost"]


def pause_reference() -> str:
    return e2e_images()["Pause"]


def _regression_74839_reference() -> str:
    return e2e_images()["RegressionIssue74839"]


AGNHOST_ALIASES = ("Nginx", "NginxNew", "BusyBox", "DistrolessIptables")
"""The e2e suite runs these for tests that only need a shell, sleep and nc, or conntrack: the
agnhost image has all of them, and is tagged with their references too."""
KPNG_REFERENCE = f"{LOCAL_REGISTRY}/kpng:{kpng.__version__}"
COREDNS_REFERENCE = f"{LOCAL_REGISTRY}/coredns:{COREDNS_VERSION}"


def kube_proxy_reference() -> str:
    """Tagged with the release kube-proxy is built from (``KPNG_KUBERNETES_VERSION`` too)."""
    return f"{LOCAL_REGISTRY}/kube-proxy:{kubernetes_release()}"


KPNG_PACKAGES = (
    "python3",
    "nftables",
    "libnftables1",
    "iptables",
    "ipset",
    "iproute2",
    "ca-certificates",
    "libbpf1",
)
"""What kpng runs with: Python, libnftables (to-nft, in process) and nft, iptables (to-iptables:
kube-proxy's iptables mode), ipset (``kpng cleanup kube-proxy`` destroys the ipvs mode's sets),
iproute2 for whoever debugs the node from the pod, libbpf (to-ebpf loads the programs kpng's
wheel ships, through ctypes: no clang in the image). No conntrack tool: the UDP clean-up
speaks ctnetlink."""

AGNHOST_PACKAGES = (
    # What upstream's agnhost image adds to Alpine, in Debian's names, and wget: Alpine's is
    # busybox's, whose -T crashes in Debian's build, so GNU wget told to try once, as busybox
    # does (it retries twenty times by default, which the tests' loops of 150 cannot afford).
    "bash",
    "curl",
    "wget",
    "netcat-openbsd",
    "iproute2",
    "bind9-dnsutils",
    "procps",
    "util-linux",
    "conntrack",
    "iputils-ping",
)

KUBE_PROXY_PACKAGES = ("nftables", "conntrack", "iptables", "iproute2", "kmod")
"""kube-proxy's nftables mode runs `nft` (knftables) and `conntrack`; it looks at iptables
to clean up after the other modes."""


class ImageError(Exception):
    """An image could not be built."""


# --- OCI layout, pure


@dataclass(frozen=True)
class Layer:
    """A gzip-compressed layer tar: its digest, and the digest of the tar inside (diff_id)."""

    blob: bytes
    diff_id: str

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.blob).hexdigest()


@dataclass
class ImageConfig:
    entrypoint: list[str]
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(
        default_factory=lambda: [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ]
    )
    workdir: str = "/"
    labels: dict[str, str] = field(default_factory=dict)


def compress(tar: bytes) -> Layer:
    # mtime=0: gzip's header otherwise records when it ran.
    blob = gzip.compress(tar, compresslevel=6, mtime=0)
    return Layer(blob, "sha256:" + hashlib.sha256(tar).hexdigest())


def tar_directory(root: Path) -> bytes:
    """A layer's tar of everything under ``root``, reproducibly: sorted, owned by root, one
    mtime; symlinks and hard links kept as links."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(root):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = _EPOCH
            info.pax_headers = {}
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return out.getvalue()


def _walk(root: Path) -> Iterator[Path]:
    """Every path under ``root`` in sorted order, parents first; links are not followed."""
    for path in sorted(root.iterdir()):
        yield path
        if path.is_dir() and not path.is_symlink():
            yield from _walk(path)


def _blob(data: bytes) -> tuple[str, int]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), len(data)


def write_archive(
    out: Path, layers: Sequence[Layer], config: ImageConfig, references: Sequence[str]
) -> Path:
    """An OCI image layout in a tar file, one image known by every name in ``references``."""
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": config.entrypoint,
            "Cmd": config.cmd or None,
            "Env": config.env,
            "WorkingDir": config.workdir,
            "Labels": config.labels or None,
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created_by": "rig.images"} for _ in layers],
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    config_digest, config_size = _blob(config_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": layer.digest,
                "size": len(layer.blob),
            }
            for layer in layers
        ],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest, manifest_size = _blob(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                # ctr names an imported image after io.containerd.image.name; other tools
                # read the OCI annotation.
                "annotations": {
                    "io.containerd.image.name": reference,
                    "org.opencontainers.image.ref.name": reference,
                },
            }
            for reference in references
        ],
    }
    files: dict[str, bytes] = {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": json.dumps(index, sort_keys=True).encode(),
        f"blobs/sha256/{config_digest[7:]}": config_bytes,
        f"blobs/sha256/{manifest_digest[7:]}": manifest_bytes,
        **{f"blobs/sha256/{layer.digest[7:]}": layer.blob for layer in layers},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, _EPOCH
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, _EPOCH
            tar.addfile(info, io.BytesIO(data))
    partial.replace(out)
    return out


# --- building


def images_cache() -> Path:
    return cache_root().parent / "images"


def _digest_of(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def debian_layer(packages: Sequence[str]) -> Layer:
    """A Debian root file system with ``packages`` (minbase), as a layer; cached by the list."""
    key = _digest_of(SUITE, *sorted(packages))
    return _cached_layer("debian", key, lambda: _build_debian_layer(packages))


def _build_debian_layer(packages: Sequence[str]) -> Layer:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("`mmdebstrap` (Debian's package) builds the images' root file systems")
    log.info("making a Debian %s root file system with %s", SUITE, ", ".join(packages))
    with tempfile.TemporaryDirectory(prefix="kpng-rootfs-", dir="/var/tmp") as tmp:
        out = Path(tmp) / "rootfs.tar"
        argv = [
            "mmdebstrap",
            "--variant=minbase",
            "--format=tar",
            "--skip=output/dev",
            f"--include={','.join(packages)}",
            # Nothing in a container reads them; keep the copyright files.
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-include=/usr/share/locale/locale.alias",
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/info/*",
            "--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/* $1/var/log/*",
            SUITE,
            str(out),
        ]
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "SOURCE_DATE_EPOCH": str(_EPOCH)},
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise ImageError(f"mmdebstrap failed ({proc.returncode}):\n{tail}")
        return compress(out.read_bytes())


def _cached_layer(name: str, key: str, build: Callable[[], Layer]) -> Layer:
    """A layer built once for its inputs' digest ``key``: compressing a few hundred MB takes
    seconds that a test run should not pay again."""
    stem = images_cache() / "layers" / f"{name}-{key}"
    blob, diff_id = stem.with_suffix(".tar.gz"), stem.with_suffix(".diff_id")
    if blob.exists() and diff_id.exists():
        return Layer(blob.read_bytes(), diff_id.read_text())
    layer = build()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(layer.blob)
    diff_id.write_text(layer.diff_id)
    return layer


def _files_layer(files: dict[str, Path | str | bytes], *, mode: int = 0o755) -> Layer:
    """A layer of single files: path in the image → a file to copy, a symlink target, or the
    content of a file (mode 0644)."""
    parts: list[bytes | str] = [oct(mode)]
    for name, source in sorted(files.items()):
        parts += [name, source.read_bytes() if isinstance(source, Path) else source]
    return _cached_layer("files", _digest_of(*parts), lambda: _build_files_layer(files, mode))


def _build_files_layer(files: dict[str, Path | str | bytes], mode: int) -> Layer:
    with tempfile.TemporaryDirectory(prefix="kpng-layer-") as tmp:
        root = Path(tmp)
        for name, source in files.items():
            target = root / name.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(source, str):
                target.symlink_to(source)
            elif isinstance(source, bytes):
                target.write_bytes(source)
                target.chmod(0o644)
            else:
                shutil.copyfile(source, target)
                target.chmod(mode)
        return compress(tar_directory(root))


def _cached_archive(
    name: str, layers: Sequence[Layer], config: ImageConfig, refs: Sequence[str]
) -> Path:
    key = _digest_of(*(layer.digest for layer in layers), json.dumps(config.__dict__), *refs)
    out = images_cache() / f"{name}-{key}.oci.tar"
    if not out.exists():
        write_archive(out, layers, config, refs)
    return out


def _source_digest(project: Path) -> str:
    """What kpng's layer is made from: the package's files and its project metadata."""
    files = [project / "pyproject.toml", project / "README.md"]
    files += sorted(
        f
        for f in (project / "src" / "kpng").rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    )
    parts: list[bytes | str] = []
    for f in files:
        parts += [str(f.relative_to(project)), f.read_bytes()]
    return _digest_of(*parts)


def kpng_layer(project: Path | None = None) -> Layer:
    """kpng and its runtime dependencies in a virtualenv at /opt/kpng, for the image's
    /usr/bin/python3, with `kpng` on PATH; cached by the source tree's digest."""
    project = project or Path(__file__).resolve().parents[1]
    if not (project / "pyproject.toml").exists():
        raise ImageError(f"{project} is not kpng's source tree")
    return _cached_layer("kpng", _source_digest(project), lambda: _build_kpng_layer(project))


def _build_kpng_layer(project: Path) -> Layer:
    with tempfile.TemporaryDirectory(prefix="kpng-image-") as tmp:
        work = Path(tmp)
        wheels = work / "wheels"
        _pip(["wheel", "--no-deps", "--wheel-dir", str(wheels), str(project)])
        (wheel,) = wheels.glob("kpng-*.whl")
        root = work / "root"
        venv = root / "opt" / "kpng"
        site = venv / "lib" / "python3.11" / "site-packages"
        # The machine's pip installs for the image's interpreter: both are CPython 3.11 on
        # glibc, so the same binary wheels fit, and the image needs no pip or network.
        _pip(["install", "--no-compile", "--only-binary=:all:", "--target", str(site), str(wheel)])
        shutil.rmtree(site / "bin", ignore_errors=True)
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python3").symlink_to("/usr/bin/python3")
        (venv / "bin" / "python").symlink_to("python3")
        (venv / "pyvenv.cfg").write_text(
            "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11\n"
        )
        script = venv / "bin" / "kpng"
        script.write_text(
            "#!/opt/kpng/bin/python3\nimport sys\nfrom kpng.cli import main\nsys.exit(main())\n"
        )
        script.chmod(0o755)
        (root / "usr" / "local" / "bin").mkdir(parents=True)
        (root / "usr" / "local" / "bin" / "kpng").symlink_to("/opt/kpng/bin/kpng")
        # The root file system is read-only in the DaemonSet: byte-code compiled now, and used
        # without checking sources (they never change in an image).
        subprocess.run(
            [
                sys.executable,
                "-m",
                "compileall",
                "-q",
                "-j0",
                "--invalidation-mode=unchecked-hash",
                "-d",
                "/opt/kpng/lib/python3.11/site-packages",
                str(site),
            ],
            check=True,
        )
        return compress(tar_directory(root))


def _pip(args: Sequence[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ImageError(f"pip {' '.join(args)} failed:\n{proc.stderr[-2000:]}")


@dataclass(frozen=True)
class ImageArchive:
    """An OCI archive to import into every node, and the reference it is known by."""

    reference: str
    path: Path


def kpng_image(reference: str = KPNG_REFERENCE) -> ImageArchive:
    layers = [debian_layer(KPNG_PACKAGES), kpng_layer()]
    config = ImageConfig(
        entrypoint=["kpng"],
        labels={
            "org.opencontainers.image.title": "kpng",
            "org.opencontainers.image.version": kpng.__version__,
        },
    )
    return ImageArchive(reference, _cached_archive("kpng", layers, config, [reference]))


def agnhost_image() -> ImageArchive:
    agnhost = ensure_programs(["agnhost"])["agnhost"]
    layers = [
        debian_layer(AGNHOST_PACKAGES),
        _files_layer({"/agnhost": agnhost, "/agnhost-2": "agnhost", "/etc/wgetrc": b"tries = 1\n"}),
    ]
    config = ImageConfig(entrypoint=["/agnhost"], cmd=["pause"])
    images = e2e_images()
    refs = [agnhost_reference(), *(images[name] for name in AGNHOST_ALIASES if name in images)]
    return ImageArchive(refs[0], _cached_archive("agnhost", layers, config, refs))


_PAUSE_SOURCE = """\
// pause: the sandbox process of every pod. It holds the pod's namespaces, reaps orphans
// (it is PID 1 when the pod shares its PID namespace) and exits on SIGINT or SIGTERM.
package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

func main() {
\tstop := make(chan os.Signal, 1)
\tsignal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
\tchildren := make(chan os.Signal, 1)
\tsignal.Notify(children, syscall.SIGCHLD)
\tfor {
\t\tselect {
\t\tcase <-stop:
\t\t\treturn
\t\tcase <-children:
\t\t\tfor {
\t\t\t\tvar status syscall.WaitStatus
\t\t\t\tif pid, _ := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 {
\t\t\t\t\tbreak
\t\t\t\t}
\t\t\t}
\t\t}
\t}
}
"""


def pause_binary() -> Path:
    out = images_cache() / "bin" / f"pause-{_digest_of(_PAUSE_SOURCE)}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="kpng-pause-") as tmp:
            work = Path(tmp)
            (work / "go.mod").write_text("module kpng.local/pause\n\ngo 1.21\n")
            (work / "main.go").write_text(_PAUSE_SOURCE)
            _go(["build", "-trimpath", "-ldflags=-s -w", "-o", str(work / "pause"), "."], work)
            shutil.move(work / "pause", out)
    return out


def pause_image() -> ImageArchive:
    layers = [_files_layer({"/pause": pause_binary()})]
    config = ImageConfig(entrypoint=["/pause"], env=[])
    return ImageArchive(
        pause_reference(), _cached_archive("pause", layers, config, [pause_reference()])
    )


def coredns_image() -> ImageArchive:
    binary = ensure_go_program("github.com/coredns/coredns", COREDNS_VERSION)
    layers = [_files_layer({"/coredns": binary})]
    config = ImageConfig(entrypoint=["/coredns"], env=[])
    return ImageArchive(
        COREDNS_REFERENCE, _cached_archive("coredns", layers, config, [COREDNS_REFERENCE])
    )


def regression_74839_image() -> ImageArchive:
    """The e2e suite's server for "proxy implementation should not be vulnerable to the
    invalid conntrack state bug": it sends out-of-window TCP packets a proxy must drop."""
    binary = ensure_programs(["regression-issue-74839"])["regression-issue-74839"]
    layers = [_files_layer({"/regression-issue-74839": binary})]
    config = ImageConfig(entrypoint=["/regression-issue-74839"], env=[])
    refs = [_regression_74839_reference()]
    return ImageArchive(refs[0], _cached_archive("regression-74839", layers, config, refs))


def kube_proxy_image() -> ImageArchive:
    binary = ensure_programs(["kube-proxy"])["kube-proxy"]
    reference = kube_proxy_reference()
    layers = [
        debian_layer(KUBE_PROXY_PACKAGES),
        _files_layer({"/usr/local/bin/kube-proxy": binary}),
    ]
    config = ImageConfig(entrypoint=["/usr/local/bin/kube-proxy"])
    return ImageArchive(reference, _cached_archive("kube-proxy", layers, config, [reference]))


def node_images(*, with_kube_proxy: bool = False) -> list[ImageArchive]:
    """What a real-node cluster imports into every node: the sandbox image, the e2e suite's,
    CoreDNS, kpng, and kube-proxy when it is the proxy under test."""
    archives = [
        pause_image(),
        agnhost_image(),
        regression_74839_image(),
        coredns_image(),
        kpng_image(),
    ]
    if with_kube_proxy:
        archives.append(kube_proxy_image())
    return archives


def unpacked_size(archive: Path) -> int:
    """The bytes of an archive's layers once uncompressed: roughly the image on a node."""
    total = 0
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.name.startswith("blobs/") and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                data = f.read()
                if data[:2] == b"\x1f\x8b":
                    total += len(gzip.decompress(data))
    return total


def main(argv: Sequence[str] | None = None) -> int:
    builders = {
        "kpng": kpng_image,
        "agnhost": agnhost_image,
        "pause": pause_image,
        "coredns": coredns_image,
        "kube-proxy": kube_proxy_image,
    }
    parser = argparse.ArgumentParser(
        prog="python -m rig.images",
        description="build an image as an OCI archive for `ctr images import`, pulling nothing",
    )
    parser.add_argument("image", choices=sorted(builders))
    parser.add_argument("--output", type=Path, help="copy the archive here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        image = builders[args.image]()
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    path = image.path
    if args.output:
        shutil.copyfile(path, args.output)
        path = args.output
    size = path.stat().st_size
    print(
        f"{image.reference}: {path} ({size / 2**20:.1f} MiB compressed, "
        f"{unpacked_size(path) / 2**20:.1f} MiB unpacked)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
