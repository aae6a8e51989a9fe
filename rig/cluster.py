"""A real control plane for tests and humans: kube-apiserver and etcd on loopback.

Both are built from the official Go modules with the machine's Go toolchain, in a throwaway
module outside the repository, and cached (``~/.cache/kpng/control-plane/<version>/``), so only
the first run pays for the build:

- ``k8s.io/kubernetes`` publishes a go.mod that requires its staging modules (``k8s.io/api``,
  ``k8s.io/apiserver``, ...) at ``v0.0.0`` and replaces them with ``./staging/...`` paths, which
  mean nothing outside its repository. The build module requires ``k8s.io/kubernetes vX.Y.Z``
  and replaces every staging module named in that go.mod with its published ``v0.Y.Z``.
- etcd is ``go.etcd.io/etcd/server/v3`` at the version kubernetes' own go.mod requires, the one
  that release is tested with.

A started ``ControlPlane`` has etcd (plain HTTP) and kube-apiserver (HTTPS, generated
certificates, a static admin token and an admin client certificate) on free loopback ports, and a
kubeconfig with two contexts: ``kpng`` (token) and ``kpng-cert`` (client certificate).

    python -m rig.cluster build      # build (or find) the binaries, print their paths
    python -m rig.cluster up         # start in the background, print the kubeconfig
    python -m rig.cluster env        # print `export KUBECONFIG=...`
    python -m rig.cluster down       # stop and remove everything `up` made
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import datetime
import fcntl
import importlib.util
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kpng.testing.ports import free_port

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("v1.34.4", "v1.35.4", "v1.36.3", "v1.37.2")
"""The Kubernetes releases kpng supports and is tested against (``make compat``), oldest first:
the newest patch of each minor release the Go module proxy served when this was written. The
window is stated in docs/design/kubernetes-releases.md; docs/design/versioning.md says how it
moves."""

KUBERNETES_VERSION = SUPPORTED_VERSIONS[-1]
"""The default release of the test control plane and of the real-node programs: the newest."""

ADMIN_USER = "kpng-admin"
SERVICE_CIDR = "10.96.0.0/16"
_GO_BUILD_FLAGS = ("-trimpath", "-ldflags=-s -w")
_START_TIMEOUT_S = 90.0
_STOP_TIMEOUT_S = 15.0


class ControlPlaneError(Exception):
    """The control plane could not be built, started or reached."""


# --- building


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    etcd: Path
    kubernetes_version: str
    etcd_version: str


def cache_root() -> Path:
    """Where built binaries live: $KPNG_CONTROL_PLANE_CACHE, else the user's cache directory."""
    override = os.environ.get("KPNG_CONTROL_PLANE_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kpng" / "control-plane"


def _version_from_env(name: str, default: str | None) -> str | None:
    value = os.environ.get(name) or default
    if value is not None and not re.fullmatch(r"v\d+\.\d+\.\d+", value):
        raise ControlPlaneError(f"{name}={value!r}: expected a release such as v1.35.4")
    return value


def kubernetes_release(explicit: str | None = None) -> str:
    """The release to build and run: $KPNG_KUBERNETES_VERSION, else ``explicit``, else
    ``KUBERNETES_VERSION``."""
    version = _version_from_env("KPNG_KUBERNETES_VERSION", explicit or KUBERNETES_VERSION)
    assert version is not None
    return version


def _go_env() -> dict[str, str]:
    # GOTOOLCHAIN=local: the machine's toolchain, never a downloaded one. -p=2: two cores here;
    # more parallel compiles only add memory pressure.
    return {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOFLAGS": "-p=2 -buildvcs=false -mod=mod",
        "CGO_ENABLED": "0",
    }


def _go(args: Sequence[str], cwd: Path) -> str:
    go = shutil.which("go")
    if go is None:
        raise ControlPlaneError(
            "the Go toolchain (`go`) is not on PATH; it builds the control plane"
        )
    proc = subprocess.run(
        [go, *args], cwd=cwd, env=_go_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-30:])
        raise ControlPlaneError(f"go {' '.join(args)} failed ({proc.returncode}):\n{tail}")
    return proc.stdout


def staging_replaces(kubernetes_go_mod: str, version: str) -> dict[str, str]:
    """The staging modules of kubernetes' go.mod, each mapped to its published v0.Y.Z."""
    published = "v0." + version.removeprefix("v").split(".", 1)[1]
    modules = re.findall(r"^\s*(k8s\.io/\S+)\s+=>\s+\./staging/", kubernetes_go_mod, re.M)
    if not modules:
        raise ControlPlaneError("k8s.io/kubernetes' go.mod names no staging modules")
    return dict.fromkeys(sorted(modules), published)


def _directive(go_mod: str, name: str) -> str | None:
    match = re.search(rf"^{name}\s+(\S+)\s*$", go_mod, re.M)
    return match.group(1) if match else None


def _required_version(go_mod: str, module: str) -> str | None:
    match = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", go_mod, re.M)
    return match.group(1) if match else None


def build_module_go_mod(kubernetes_go_mod: str, version: str) -> str:
    """The go.mod of the throwaway module that builds kube-apiserver."""
    lines = ["module kpng.local/kube-apiserver", ""]
    go = _directive(kubernetes_go_mod, "go")
    if go:
        lines += [f"go {go}", ""]
    godebug = re.search(r"^godebug\s+(.+)$", kubernetes_go_mod, re.M)
    if godebug:  # kubernetes pins GODEBUG defaults; the binary should behave as upstream's
        lines += [f"godebug {godebug.group(1)}", ""]
    lines += [f"require k8s.io/kubernetes {version}", "", "replace ("]
    lines += [f"\t{m} => {m} {v}" for m, v in staging_replaces(kubernetes_go_mod, version).items()]
    lines += [")", ""]
    return "\n".join(lines)


def _download_go_mod(module: str, version: str, workdir: Path) -> str:
    info = json.loads(_go(["mod", "download", "-json", f"{module}@{version}"], workdir))
    if info.get("Error"):
        raise ControlPlaneError(f"{module}@{version}: {info['Error']}")
    return Path(info["GoMod"]).read_text()


def kubernetes_source(kubernetes_version: str | None = None) -> Path:
    """The source tree of k8s.io/kubernetes at a release (the Go module cache's, downloaded first
    if absent): for what a release's code says rather than what kpng assumes of it."""
    version = kubernetes_release(kubernetes_version)
    with tempfile.TemporaryDirectory(prefix="kpng-kubernetes-source-") as tmp:
        info = json.loads(
            _go(["mod", "download", "-json", f"k8s.io/kubernetes@{version}"], Path(tmp))
        )
    if info.get("Error"):
        raise ControlPlaneError(f"k8s.io/kubernetes@{version}: {info['Error']}")
    return Path(info["Dir"])


def _kubernetes_ldflags(version: str) -> str:
    major, minor, _ = version.removeprefix("v").split(".")
    pkg = "k8s.io/component-base/version"
    # What `make` stamps into an official build: the apiserver reports it at /version, kubelets
    # in their Node status, and e2e.test compares the two.
    return (
        f"-s -w -X {pkg}.gitVersion={version} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor}"
        f" -X {pkg}.gitTreeState=clean"
    )


def _kubernetes_module(version: str, packages: Sequence[str], workdir: Path) -> tuple[Path, str]:
    """A throwaway module that can build ``packages`` of k8s.io/kubernetes ``version``; returns
    its directory and kubernetes' own go.mod."""
    kubernetes_go_mod = _download_go_mod("k8s.io/kubernetes", version, workdir)
    module = workdir / "kubernetes"
    module.mkdir()
    (module / "go.mod").write_text(build_module_go_mod(kubernetes_go_mod, version))
    ours = [f"{p}@{version}" for p in packages if p.startswith("k8s.io/kubernetes/")]
    _go(["get", *ours], module)
    return module, kubernetes_go_mod


def _build_kube_apiserver(version: str, out: Path, workdir: Path) -> str:
    """Builds kube-apiserver into ``out``; returns the etcd version kubernetes requires."""
    package = KUBERNETES_PROGRAMS["kube-apiserver"]
    module, kubernetes_go_mod = _kubernetes_module(version, [package], workdir)
    ldflags = _kubernetes_ldflags(version)
    _go(["build", "-trimpath", f"-ldflags={ldflags}", "-o", str(out), package], module)
    etcd = _required_version(kubernetes_go_mod, "go.etcd.io/etcd/server/v3")
    if etcd is None:
        raise ControlPlaneError(f"k8s.io/kubernetes {version} does not name an etcd server version")
    return etcd


def _build_etcd(version: str, out: Path, workdir: Path) -> None:
    module = workdir / "etcd"
    module.mkdir()
    (module / "go.mod").write_text("module kpng.local/etcd\n")
    _go(["get", f"go.etcd.io/etcd/server/v3@{version}"], module)
    _go(["build", *_GO_BUILD_FLAGS, "-o", str(out), "go.etcd.io/etcd/server/v3"], module)


def _read_manifest(directory: Path) -> Binaries | None:
    try:
        manifest = json.loads((directory / "build.json").read_text())
    except (OSError, ValueError):
        return None
    binaries = Binaries(
        kube_apiserver=directory / "kube-apiserver",
        etcd=directory / "etcd",
        kubernetes_version=manifest["kubernetes_version"],
        etcd_version=manifest["etcd_version"],
    )
    if not (os.access(binaries.kube_apiserver, os.X_OK) and os.access(binaries.etcd, os.X_OK)):
        return None
    return binaries


def _binaries_directory(kube: str, etcd: str | None) -> Path:
    return cache_root() / (kube if etcd is None else f"{kube}-etcd-{etcd}")


def cached_binaries(
    kubernetes_version: str | None = None, etcd_version: str | None = None
) -> Binaries | None:
    """The binaries ``ensure_binaries`` returns without building, or None if they are not built
    yet: whether a control plane can start here without Go."""
    kube = kubernetes_release(kubernetes_version)
    etcd = _version_from_env("KPNG_ETCD_VERSION", etcd_version)
    return _read_manifest(_binaries_directory(kube, etcd))


def ensure_binaries(
    kubernetes_version: str | None = None, etcd_version: str | None = None
) -> Binaries:
    """The cached binaries, built first if absent. Versions default to $KPNG_KUBERNETES_VERSION
    (else ``KUBERNETES_VERSION``) and $KPNG_ETCD_VERSION (else what kubernetes requires)."""
    kube = kubernetes_release(kubernetes_version)
    etcd = _version_from_env("KPNG_ETCD_VERSION", etcd_version)
    directory = _binaries_directory(kube, etcd)
    found = _read_manifest(directory)
    if found is not None:
        return found
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same release
        found = _read_manifest(directory)
        if found is not None:
            return found
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="kpng-control-plane-build-") as tmp:
            work = Path(tmp)
            log.info("building kube-apiserver %s (a few minutes on two cores)", kube)
            required_etcd = _build_kube_apiserver(kube, work / "kube-apiserver.bin", work)
            etcd = etcd or required_etcd
            log.info("building etcd %s", etcd)
            _build_etcd(etcd, work / "etcd.bin", work)
            for name in ("kube-apiserver", "etcd"):
                os.replace(work / f"{name}.bin", directory / name)
        seconds = round(time.monotonic() - started, 1)
        manifest = {"kubernetes_version": kube, "etcd_version": etcd, "build_seconds": seconds}
        (directory / "build.json").write_text(json.dumps(manifest, indent=2) + "\n")
        log.info("built the control plane in %.0f s into %s", seconds, directory)
    found = _read_manifest(directory)
    assert found is not None
    return found


KUBERNETES_PROGRAMS = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "agnhost": "k8s.io/kubernetes/test/images/agnhost",
    "regression-issue-74839": "k8s.io/kubernetes/test/images/regression-issue-74839",
    "e2e.test": "k8s.io/kubernetes/test/e2e",
    # At the version kubernetes requires: the runner that splits e2e.test over processes.
    "ginkgo": "github.com/onsi/ginkgo/v2/ginkgo",
}
"""What ``ensure_programs`` builds, by name: every program of a real cluster and its e2e suite."""


def ensure_programs(names: Sequence[str], kubernetes_version: str | None = None) -> dict[str, Path]:
    """The named Kubernetes programs (``KUBERNETES_PROGRAMS``) of one release, cached beside the
    control plane's and built first if absent: several in one Go module, so that the packages
    they share compile once (the first takes minutes on two cores, each further one less)."""
    version = kubernetes_release(kubernetes_version)
    unknown = sorted(set(names) - set(KUBERNETES_PROGRAMS))
    if unknown:
        raise ControlPlaneError(f"no such Kubernetes program: {', '.join(unknown)}")
    directory = cache_root() / version / "programs"
    paths = {name: directory / name for name in names}

    def missing() -> list[str]:
        return [name for name, path in paths.items() if not os.access(path, os.X_OK)]

    if not missing():
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = missing()
        if not todo:
            return paths
        with tempfile.TemporaryDirectory(prefix="kpng-kubernetes-build-") as tmp:
            work = Path(tmp)
            packages = [KUBERNETES_PROGRAMS[name] for name in todo]
            module, _ = _kubernetes_module(version, packages, work)
            ldflags = _kubernetes_ldflags(version)
            for name, package in zip(todo, packages, strict=True):
                started = time.monotonic()
                log.info("building %s %s", name, version)
                out = work / f"{name}.bin"
                # e2e.test is the test binary of a package, not a command.
                verb = ["test", "-c"] if name == "e2e.test" else ["build"]
                _go([*verb, "-trimpath", f"-ldflags={ldflags}", "-o", str(out), package], module)
                os.replace(out, paths[name])
                log.info("built %s in %.0f s", name, time.monotonic() - started)
    return paths


COREDNS_VERSION = "v1.14.7"
"""The cluster DNS of real-node tests: a recent release; the e2e suite needs only its
``kubernetes`` plugin."""


def ensure_go_program(module: str, version: str, package: str | None = None) -> Path:
    """A static build of ``package`` (default: the module's root) of a Go module outside
    Kubernetes, such as CoreDNS, cached under ``<cache>/go/``."""
    package = package or module
    path = cache_root() / "go" / f"{package.rsplit('/', 1)[-1]}-{version}"
    if os.access(path, os.X_OK):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(path, os.X_OK):
            return path
        with tempfile.TemporaryDirectory(prefix="kpng-go-build-") as tmp:
            work = Path(tmp)
            (work / "go.mod").write_text("module kpng.local/build\n")
            log.info("building %s %s", package, version)
            _go(["get", f"{module}@{version}"], work)
            _go(["build", *_GO_BUILD_FLAGS, "-o", str(work / "out"), package], work)
            os.replace(work / "out", path)
    return path


# --- certificates


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    """Kept so that tests can issue client certificates of their own (``issue_client_cert``)."""
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    service_account_key: Path
    service_account_pub: Path


def _need_cryptography() -> None:
    # A testing extra, not a runtime dependency: say how to get it.
    if importlib.util.find_spec("cryptography") is None:
        raise ControlPlaneError(
            "the test control plane's certificates need cryptography: pip install 'kpng[testing]'"
        )


def make_pki(directory: Path, addresses: Sequence[str] = ("127.0.0.1",)) -> Pki:
    """A CA, the apiserver's serving certificate (valid for ``addresses``, for localhost and for
    the names and ClusterIP of the ``kubernetes`` Service), an admin client certificate, a SA key
    pair."""
    _need_cryptography()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    def write_key(path: Path, k: ec.EllipticCurvePrivateKey) -> None:
        path.write_bytes(
            k.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    ca_key = key()
    ca_name = name("kpng-test-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        subject: x509.Name, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        k = key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), k

    serving, serving_key = leaf(
        name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        [
            *(x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys(addresses)),
            # Pods reach the apiserver through the `kubernetes` Service, by name or ClusterIP.
            x509.IPAddress(ipaddress.ip_network(SERVICE_CIDR)[1]),
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
        ],
    )
    admin, admin_key = leaf(
        name(ADMIN_USER + "-cert", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH, []
    )
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        service_account_key=directory / "sa.key",
        service_account_pub=directory / "sa.pub",
    )
    pem = serialization.Encoding.PEM
    pki.ca_cert.write_bytes(ca.public_bytes(pem))
    write_key(pki.ca_key, ca_key)
    pki.serving_cert.write_bytes(serving.public_bytes(pem))
    write_key(pki.serving_key, serving_key)
    pki.admin_cert.write_bytes(admin.public_bytes(pem))
    write_key(pki.admin_key, admin_key)
    sa = key()
    write_key(pki.service_account_key, sa)
    pki.service_account_pub.write_bytes(
        sa.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pki


@dataclass(frozen=True)
class ClientCert:
    cert_pem: bytes
    key_pem: bytes
    not_after: datetime.datetime


def issue_client_cert(
    pki: Pki,
    *,
    common_name: str = ADMIN_USER + "-cert",
    organization: str = "system:masters",
    valid_for: datetime.timedelta = datetime.timedelta(days=1),
) -> ClientCert:
    """A client certificate signed by the PKI's CA, valid from a few minutes ago (clock skew)
    for ``valid_for`` from now; its subject's O is the user's group (system:masters: admin)."""
    _need_cryptography()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    # X.509 times have whole seconds: the certificate's end is rounded down.
    not_after = (now + valid_for).replace(microsecond=0)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ClientCert(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        not_after,
    )


# --- running


def _dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when the process that started it dies, and a test
    run killed hard leaves no etcd or apiserver behind (Linux' PR_SET_PDEATHSIG, which survives
    the exec). util-linux's setpriv sets it, not a ``preexec_fn``: Python code between fork and
    exec in a process with other threads (gRPC's) crashed the child now and then (SIGSEGV)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise ControlPlaneError("setpriv (Debian's util-linux) is needed to start the daemons")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Daemon:
    """A long-running child whose output goes to ``logfile``; with ``detach=False`` it dies with
    the process that started it."""

    def __init__(self, name: str, argv: list[str], logfile: Path, *, detach: bool) -> None:
        self.name = name
        self.logfile = logfile
        with logfile.open("ab") as out:
            self.popen = subprocess.Popen(
                argv if detach else _dying_with_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise ControlPlaneError(
                f"{self.name} exited with {self.popen.returncode}; "
                f"the end of {self.logfile}:\n{_tail(self.logfile)}"
            )

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)
            try:
                self.popen.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _http_get(url: str, *, context: ssl.SSLContext | None, token: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _http_post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


class ControlPlane:
    """etcd and kube-apiserver on loopback; a context manager that removes everything on exit.

    ``watch_cache=False`` starts the apiserver with ``--watch-cache=false``, so that a watch from
    a compacted resourceVersion fails with 410 Gone as it would against etcd directly.
    ``address`` is where the apiserver listens and what it advertises: loopback for tests of
    kpng alone, a bridge address when real nodes (``rig.nodes``) must reach it.
    """

    def __init__(
        self,
        binaries: Binaries,
        *,
        workdir: Path | None = None,
        watch_cache: bool = True,
        detach: bool = False,
        apiserver_args: Sequence[str] = (),
        address: str = "127.0.0.1",
        pki: Pki | None = None,
    ) -> None:
        self.binaries = binaries
        self.address = address
        self.watch_cache = watch_cache
        self.apiserver_args = list(apiserver_args)
        """Extra kube-apiserver flags (``--name=value``); each replaces the default flag of its
        name, since list flags such as ``--authorization-mode`` would add up instead."""
        self._detach = detach
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="kpng-control-plane-"))
        self.token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
        self.etcd_port = 0
        self.apiserver_port = 0
        self._etcd: Daemon | None = None
        self._apiservers: dict[int, Daemon] = {}
        self._pki = pki
        """Made by ``start()`` unless given: a caller that needs certificates the apiserver's
        flags name (its kubelet client certificate) makes it first."""
        self._ssl: ssl.SSLContext | None = None

    # The addresses and credentials a client needs.

    @property
    def server(self) -> str:
        return self.server_at(self.apiserver_port)

    def server_at(self, port: int) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"https://{host}:{port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def pki(self) -> Pki:
        assert self._pki is not None, "start() the control plane first"
        return self._pki

    def ssl_context(self) -> ssl.SSLContext:
        """Trusts the control plane's CA; for clients of the apiserver."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        return self._ssl

    # Lifecycle.

    def start(self) -> ControlPlane:
        try:
            if self._pki is None:
                self._pki = make_pki(self.workdir, (self.address, "127.0.0.1"))
            (self.workdir / "tokens.csv").write_text(
                f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            )
            self._start_etcd()
            self.apiserver_port = self.start_apiserver()
            self._write_kubeconfig()
        except BaseException:
            self.stop()
            raise
        if not self._detach:
            atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stop every process and remove the working directory (if this object made it)."""
        for process in list(self._apiservers.values()):
            process.stop()
        self._apiservers.clear()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def pids(self) -> list[int]:
        processes = [*self._apiservers.values(), *([self._etcd] if self._etcd else [])]
        return [p.pid for p in processes]

    def apiserver_pid(self, port: int | None = None) -> int:
        """The process id of the apiserver on ``port`` (default: the kubeconfig's)."""
        return self._apiservers[port or self.apiserver_port].pid

    def _start_etcd(self) -> None:
        self.etcd_port = free_port()
        peer = free_port()
        data = self.workdir / "etcd-data"
        self._etcd = Daemon(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=kpng",
                f"--data-dir={data}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=kpng=http://127.0.0.1:{peer}",
                # A throwaway test store: durability buys nothing and fsync costs seconds.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            self.workdir / "etcd.log",
            detach=self._detach,
        )
        self._wait(
            self._etcd,
            lambda: _http_get(f"{self.etcd_url}/health", context=None, token=None),
            "etcd",
        )

    def start_apiserver(self, port: int | None = None) -> int:
        """Start a kube-apiserver on ``port`` (default: a free one) against this etcd; several
        may run at once, which lets a test change the cluster behind a client's back."""
        pki = self.pki
        port = port or free_port()
        argv = [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The endpoints reconciler would publish 127.0.0.1 for the `kubernetes` Service,
            # which the API rejects (loopback); tests write every EndpointSlice themselves.
            "--endpoint-reconciler-type=none",
            # Fairness queues only slow the benchmarks' bulk creation on a two-core machine.
            "--enable-priority-and-fairness=false",
            f"--watch-cache={'true' if self.watch_cache else 'false'}",
            "--profiling=false",
            "--v=0",
        ]
        overridden = {arg.split("=", 1)[0] for arg in self.apiserver_args}
        argv = [
            *(arg for arg in argv if arg.split("=", 1)[0] not in overridden),
            *self.apiserver_args,
        ]
        process = Daemon(
            f"kube-apiserver:{port}",
            argv,
            self.workdir / f"apiserver-{port}.log",
            detach=self._detach,
        )
        self._apiservers[port] = process
        self._wait(
            process,
            lambda: _http_get(
                f"{self.server_at(port)}/readyz", context=self.ssl_context(), token=self.token
            ),
            f"kube-apiserver on port {port}",
        )
        return port

    def stop_apiserver(self, port: int | None = None, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop one apiserver (default: the kubeconfig's); SIGKILL unless told otherwise."""
        process = self._apiservers.pop(port or self.apiserver_port, None)
        if process is not None:
            process.stop(sig)

    def _wait(self, process: Daemon, probe: Any, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            process.check_alive()
            try:
                status, body = probe()
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200]!r}"
            except (OSError, ssl.SSLError) as exc:
                last = str(exc)
            time.sleep(0.1)
        process.stop(signal.SIGKILL)
        raise ControlPlaneError(
            f"{what} not ready after {_START_TIMEOUT_S:.0f} s ({last}); "
            f"the end of {process.logfile}:\n{_tail(process.logfile)}"
        )

    def _write_kubeconfig(self) -> None:
        pki = self.pki
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kpng",
            "clusters": [
                {
                    "name": "kpng",
                    "cluster": {"server": self.server, "certificate-authority": str(pki.ca_cert)},
                }
            ],
            "users": [
                {"name": ADMIN_USER, "user": {"token": self.token}},
                {
                    "name": ADMIN_USER + "-cert",
                    "user": {
                        "client-certificate-data": base64.b64encode(
                            pki.admin_cert.read_bytes()
                        ).decode(),
                        "client-key-data": base64.b64encode(pki.admin_key.read_bytes()).decode(),
                    },
                },
            ],
            "contexts": [
                {"name": "kpng", "context": {"cluster": "kpng", "user": ADMIN_USER}},
                {"name": "kpng-cert", "context": {"cluster": "kpng", "user": ADMIN_USER + "-cert"}},
            ],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    # etcd maintenance, for tests that need the store's history gone.

    def etcd_revision(self) -> int:
        status = _http_post_json(f"{self.etcd_url}/v3/maintenance/status", {})
        return int(status["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision; returns that revision. Watches
        from an older resourceVersion then fail with 410 Gone (with the watch cache disabled)."""
        revision = self.etcd_revision()
        _http_post_json(
            f"{self.etcd_url}/v3/kv/compaction", {"revision": revision, "physical": True}
        )
        return revision


# --- the command


def _state_dir(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "kpng-cluster" if runtime else Path(f"/tmp/kpng-cluster-{os.getuid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _down(directory: Path) -> bool:
    state_file = directory / "state.json"
    if not state_file.exists():
        return False
    state = json.loads(state_file.read_text())
    for pid in state["pids"]:  # apiservers first, etcd last
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rig.cluster",
        description="build, start and stop a loopback kube-apiserver + etcd for kpng's tests",
    )
    parser.add_argument("command", choices=["build", "up", "env", "down"])
    parser.add_argument(
        "--dir", type=Path, help="where `up` keeps its state (default: $XDG_RUNTIME_DIR or /tmp)"
    )
    parser.add_argument(
        "--no-watch-cache",
        action="store_true",
        help="start kube-apiserver with --watch-cache=false",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    directory = _state_dir(args.dir)
    try:
        if args.command == "build":
            started = time.monotonic()
            binaries = ensure_binaries()
            print(f"kube-apiserver {binaries.kubernetes_version}: {binaries.kube_apiserver}")
            print(f"etcd {binaries.etcd_version}: {binaries.etcd}")
            print(f"ready in {time.monotonic() - started:.1f} s")
        elif args.command == "up":
            if (directory / "state.json").exists():
                print(f"already up (state in {directory}); `down` first", file=sys.stderr)
                return 1
            binaries = ensure_binaries()
            directory.mkdir(parents=True, exist_ok=True)
            plane = ControlPlane(
                binaries, workdir=directory, watch_cache=not args.no_watch_cache, detach=True
            )
            plane.start()
            # Apiservers first: `down` stops them before the etcd they write to.
            state = {"pids": plane.pids(), "server": plane.server, "etcd": plane.etcd_url}
            (directory / "state.json").write_text(json.dumps(state) + "\n")
            print(f"kube-apiserver {binaries.kubernetes_version} at {plane.server}")
            print(f"etcd {binaries.etcd_version} at {plane.etcd_url}")
            print(f"export KUBECONFIG={plane.kubeconfig}")
        elif args.command == "env":
            if not (directory / "state.json").exists():
                print(f"not up (no state in {directory})", file=sys.stderr)
                return 1
            print(f"export KUBECONFIG={directory / 'kubeconfig'}")
        elif not _down(directory):
            print(f"not up (no state in {directory})", file=sys.stderr)
            return 1
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def running(*, watch_cache: bool = True) -> Iterator[ControlPlane]:
    """A started control plane for a ``with`` block; everything is removed on exit."""
    with ControlPlane(ensure_binaries(), watch_cache=watch_cache) as plane:
        yield plane


if __name__ == "__main__":
    sys.exit(main())
