"""Where the API server is and how to authenticate: kubeconfig and in-cluster configuration.

kubernetes_asyncio's configuration loaders read the configuration (kubeconfig merging of
``$KUBECONFIG`` lists, contexts, client certificates and keys as files or data, bearer tokens and
token files, exec credential plugins of any ``client.authentication.k8s.io`` version, including
plugins that return client certificates and expiring tokens, custom CAs, ``tls-server-name``,
the in-cluster service account with its rotated token). kpng uses them for that alone: the HTTP
requests, lists and watches are kpng's own (``client.py``, ``reflector.py``). Tokens are
refreshed as they expire. Client certificates rotate too: their files are checked (stat) before each
list and watch and loaded again when they change (kubelet's ``kubelet-client-current.pem``,
cert-manager); an exec plugin that returns certificates runs again when the server rejects them
(401: the loader sets no expiry for certificates). A certificate and key caught mid-rotation (not
matching, unreadable) leave the previous ones in use, with one warning, and are tried again at the
next request.

lightkube's loader was the other candidate; it accepts exec plugins of ``v1alpha1`` and
``v1beta1`` only (not the GA ``v1``) and no plugin that returns a client certificate.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import ConfigException, load_kube_config
from kubernetes_asyncio.config.incluster_config import (
    SERVICE_CERT_FILENAME,
    SERVICE_HOST_ENV_NAME,
    SERVICE_TOKEN_FILENAME,
    InClusterConfigLoader,
)
from kubernetes_asyncio.config.kube_config import KubeConfigLoader

from kpng.errors import KpngError

log = logging.getLogger(__name__)


class KubeConfigError(KpngError):
    """The configuration names no usable API server or credentials."""


CertFiles = tuple[str, str | None]
"""A client certificate file and its key file (None: the key is in the certificate's file)."""
Stamp = tuple[tuple[int, int, int, int], ...]


def files_stamp(paths: Sequence[str | None]) -> Stamp | None:
    """What tells that files were rewritten or replaced (renamed over, a symlink switched); None
    if one is missing."""
    try:
        stats = [os.stat(path) for path in paths if path is not None]
    except OSError:
        return None
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)


@dataclass
class Connection:
    """An API server and the credentials to use with it."""

    server: str
    ssl_context: ssl.SSLContext | None
    """None for a plain-HTTP server."""
    tls_server_name: str | None
    proxy: str | None
    source: str
    """Where the configuration came from, for messages."""
    _configuration: Configuration
    _loader: KubeConfigLoader | None

    _exec_rejected: bool = False
    _cert_files: CertFiles | None = None
    """Where ssl_context's client certificate came from, and the files' stamp then."""
    _cert_stamp: Stamp | None = None
    _cert_failing: bool = False

    async def authorization(self) -> str | None:
        """The Authorization header value. An exec plugin runs again only when its token has
        expired or the server rejected it; an in-cluster token file is re-read as it rotates."""
        if self._loader is not None and self._has_exec_plugin():
            if self._exec_rejected or self._exec_expired():
                self._loader.__dict__.pop("exec_plugin_expiry", None)
                await self._loader.load_from_exec_plugin()
                self._exec_rejected = False
            token: str | None = getattr(self._loader, "token", None)
            return token
        value: str | None = await self._configuration.get_api_key_with_prefix("BearerToken")
        return value

    def credentials_rejected(self) -> None:
        """The server answered 401: the next request gets a fresh token from an exec plugin."""
        self._exec_rejected = True

    def refresh_client_certificate(self) -> None:
        """Before each request (after ``authorization()``, which may run an exec plugin again):
        a new ``ssl_context`` if the client certificate's files changed or the plugin reported
        new ones. A certificate that cannot be loaded leaves the previous one in use, with one
        warning until a load succeeds; it is tried again each request, as it may be caught
        mid-rotation."""
        files = self._client_cert_files()
        if files is None or self.ssl_context is None:
            return
        stamp = files_stamp(files)
        if not self._cert_failing and files == self._cert_files and stamp == self._cert_stamp:
            return
        try:
            context = _ssl_context(self._configuration, files, self.source)
        except KubeConfigError as exc:
            if not self._cert_failing:
                log.warning("%s; keeping the previous client certificate meanwhile", exc)
            self._cert_failing = True
            return
        self.ssl_context = context
        self._cert_files, self._cert_stamp, self._cert_failing = files, stamp, False
        log.info("new client certificate in use: %s", files[0])

    def _client_cert_files(self) -> CertFiles | None:
        # The loader, not the configuration it filled once: an exec plugin run again puts the
        # new certificate's (temporary) files there.
        holder: object = self._loader if self._loader is not None else self._configuration
        cert: str | None = getattr(holder, "cert_file", None)
        key: str | None = getattr(holder, "key_file", None)
        return (cert, key) if cert else None

    def _exec_expired(self) -> bool:
        expiry = getattr(self._loader, "exec_plugin_expiry", None)
        return isinstance(expiry, datetime.datetime) and expiry <= datetime.datetime.now(
            datetime.UTC
        )

    def _has_exec_plugin(self) -> bool:
        user = getattr(self._loader, "_user", None)
        return user is not None and "exec" in user


def _ssl_context(
    configuration: Configuration, cert_files: CertFiles | None, source: str
) -> ssl.SSLContext | None:
    if not str(configuration.host).startswith("https://"):
        return None
    try:
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if not configuration.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cert_files is not None:
            context.load_cert_chain(*cert_files)
    except (OSError, ssl.SSLError) as exc:
        raise KubeConfigError(f"{source}: cannot load its certificates: {exc}") from None
    return context


def _connection(
    configuration: Configuration, loader: KubeConfigLoader | None, source: str
) -> Connection:
    host = str(configuration.host or "").rstrip("/")
    if not host.startswith(("https://", "http://")):
        raise KubeConfigError(f"{source}: no API server address (cluster.server)")
    connection = Connection(
        server=host,
        ssl_context=None,
        tls_server_name=getattr(configuration, "tls_server_name", None) or None,
        proxy=configuration.proxy or None,
        source=source,
        _configuration=configuration,
        _loader=loader,
    )
    files = connection._client_cert_files()
    # Stamped before loading: files rewritten meanwhile are loaded again at the first request.
    connection._cert_files, connection._cert_stamp = files, files_stamp(files or ())
    connection.ssl_context = _ssl_context(configuration, files, source)
    return connection


async def _from_kubeconfig(paths: str, context: str | None) -> Connection:
    source = f"kubeconfig {paths}"
    configuration = Configuration()
    try:
        loader = await load_kube_config(
            config_file=paths,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except ConfigException as exc:
        raise KubeConfigError(f"{source}: {exc}") from None
    except (AssertionError, KeyError, TypeError, AttributeError, ValueError) as exc:
        # The loader asserts and indexes its way through the document: a missing context,
        # cluster or user ends here, often without a message of its own.
        what = f"context {context!r}" if context else "its current context"
        detail = f": {exc}" if str(exc) else ""
        raise KubeConfigError(
            f"{source}: {what} is missing or incomplete (a context needs a cluster with a "
            f"server, and a user){detail}"
        ) from None
    except OSError as exc:
        raise KubeConfigError(f"{source}: {exc.strerror or exc}") from None
    except Exception as exc:  # YAML errors and the like: the library wraps nothing
        raise KubeConfigError(f"{source}: cannot be read: {exc}") from None
    return _connection(configuration, loader, source)


IN_CLUSTER = "in-cluster"


def choose_config(
    kubeconfig: Path | None,
    environ: Mapping[str, str],
    *,
    is_file: Callable[[Path], bool] = Path.is_file,
    home: Path | None = None,
) -> str:
    """Which configuration to load: kubeconfig paths (``$KUBECONFIG`` may list several, which
    are merged), or ``IN_CLUSTER``. Raises KubeConfigError if there is none."""
    if kubeconfig is not None:
        if not is_file(kubeconfig):
            raise KubeConfigError(f"kubeconfig {kubeconfig}: no such file")
        return str(kubeconfig)
    if environ.get("KUBECONFIG"):
        paths = [p for p in environ["KUBECONFIG"].split(os.pathsep) if p and is_file(Path(p))]
        if not paths:
            raise KubeConfigError(f"$KUBECONFIG={environ['KUBECONFIG']}: no such file")
        return os.pathsep.join(paths)
    if environ.get(SERVICE_HOST_ENV_NAME) and is_file(Path(SERVICE_TOKEN_FILENAME)):
        return IN_CLUSTER
    default = (home or Path(environ.get("HOME", "~")).expanduser()) / ".kube" / "config"
    if is_file(default):
        return str(default)
    raise KubeConfigError(
        "no configuration: pass --kubeconfig, set $KUBECONFIG, run in a pod with a service "
        f"account, or write {default}"
    )


def _in_cluster() -> Connection:
    configuration = Configuration()
    try:
        InClusterConfigLoader(SERVICE_TOKEN_FILENAME, SERVICE_CERT_FILENAME).load_and_set(
            configuration
        )
    except ConfigException as exc:
        raise KubeConfigError(f"in-cluster configuration: {exc}") from None
    return _connection(configuration, None, "the in-cluster service account")


async def load_connection(
    kubeconfig: Path | None = None,
    context: str | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
) -> Connection:
    """The API server to use: ``kubeconfig`` if given; else ``$KUBECONFIG``; else the in-cluster
    service account when running in a pod; else ``~/.kube/config``."""
    chosen = choose_config(kubeconfig, environ)
    if chosen == IN_CLUSTER:
        if context:
            raise KubeConfigError("--context names a kubeconfig context, but none is in use")
        connection = _in_cluster()
    else:
        connection = await _from_kubeconfig(chosen, context)
    log.info("API server %s (from %s)", connection.server, connection.source)
    return connection
