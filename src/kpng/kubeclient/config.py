"""Where the API server is and how to authenticate: kubeconfig and in-cluster configuration.

kpng reads the in-cluster service account and kubeconfigs of plain fields itself (below);
kubernetes_asyncio's configuration loaders read the rest (kubeconfig merging of ``$KUBECONFIG``
lists, exec credential plugins of any ``client.authentication.k8s.io`` version, including
plugins that return client certificates and expiring tokens, auth providers). kpng uses the
library for that alone: the HTTP requests, lists and watches are kpng's own (``client.py``,
``reflector.py``). Tokens are refreshed as they expire, and token files read again when they
change. Client certificates rotate too: their files are checked (stat) before each
list and watch and loaded again when they change (kubelet's ``kubelet-client-current.pem``,
cert-manager); an exec plugin that returns certificates runs again when the server rejects them
(401: the loader sets no expiry for certificates). A certificate and key caught mid-rotation (not
matching, unreadable) leave the previous ones in use, with one warning, and are tried again at the
next request.

lightkube's loader was the other candidate; it accepts exec plugins of ``v1alpha1`` and
``v1beta1`` only (not the GA ``v1``) and no plugin that returns a client certificate.

The library is imported only when it is needed. Importing it imports its whole generated API
client, some 0.33 s and 38 MiB for a proxy that uses none of it. The in-cluster service account
and a kubeconfig whose context, cluster and user hold only plain fields (a server, a CA, a
token or token file, client certificate and key files or data) are read by kpng itself; anything
else (merged ``$KUBECONFIG`` lists, exec plugins, auth providers, a field kpng does not read, a
missing entry, whose error message is the library's) goes to the library. Every kubeconfig file
is first decoded into the typed Structs of ``kubeconfig.py``, which refuse a field no kubeconfig
has (a typo kubectl would drop silently), naming it.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import datetime
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
import yaml

from kpng.errors import KpngError
from kpng.kubeclient import kubeconfig
from kpng.kubeclient.proxies import proxy_from_environment

if TYPE_CHECKING:
    from kubernetes_asyncio.config.kube_config import KubeConfigLoader

log = logging.getLogger(__name__)


class KubeConfigError(KpngError):
    """The configuration names no usable API server or credentials."""


SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_PORT_ENV = "KUBERNETES_SERVICE_PORT"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod's service account token and the cluster's CA are mounted."""

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


class Settings(Protocol):
    """What a connection reads of its configuration: the library's ``Configuration``, or
    ``PlainSettings``. (Client certificate files and ``tls_server_name`` are read with getattr:
    the library sets them on some configurations only.)"""

    @property
    def host(self) -> str | None: ...

    @property
    def ssl_ca_cert(self) -> str | None: ...

    @property
    def verify_ssl(self) -> bool: ...

    @property
    def proxy(self) -> str | None: ...

    async def get_api_key_with_prefix(self, identifier: str) -> str | None: ...


@dataclass
class PlainSettings:
    """A configuration kpng read itself (the in-cluster service account, a plain kubeconfig)."""

    host: str
    ssl_ca_cert: str | None = None
    verify_ssl: bool = True
    proxy: str | None = None
    tls_server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    token_file: str | None = None
    """Read again whenever it changes (a service account's token is rotated in place)."""
    _token_stamp: Stamp | None = None

    async def get_api_key_with_prefix(self, identifier: str) -> str | None:
        if self.token_file is not None:
            self._read_token(self.token_file)
        return f"Bearer {self.token}" if self.token else None

    def _read_token(self, path: str) -> None:
        # A stat per request, a read of a few bytes when the file changed.
        stamp = files_stamp([path])
        if stamp is None or stamp == self._token_stamp:
            return
        try:
            self.token = Path(path).read_text().strip() or self.token
            self._token_stamp = stamp
        except OSError as exc:
            log.warning("cannot read the token file %s: %s", path, exc)


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
    _configuration: Settings
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
    configuration: Settings, cert_files: CertFiles | None, source: str
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
    configuration: Settings,
    loader: KubeConfigLoader | None,
    source: str,
    environ: Mapping[str, str],
) -> Connection:
    host = str(configuration.host or "").rstrip("/")
    if not host.startswith(("https://", "http://")):
        raise KubeConfigError(f"{source}: no API server address (cluster.server)")
    if host.startswith("https://") and not configuration.verify_ssl:
        # Once, at start: the setting is the operator's to keep, but never silently.
        log.warning(
            "%s: insecure-skip-tls-verify is set: the API server's certificate is not "
            "verified, so anyone between kpng and %s can pose as it",
            source,
            host,
        )
    proxy = configuration.proxy or None
    where = f"{source}: proxy-url"
    if proxy is None and (found := proxy_from_environment(host, environ)) is not None:
        # As client-go: a kubeconfig's proxy-url wins, else the environment's.
        proxy, where = found[0], f"${found[1]}"
        log.info("reaching the API server %s through %s (%s)", host, proxy, where)
    if proxy is not None and not proxy.startswith(("http://", "https://")):
        # kubectl takes socks5:// proxies too; kpng's client does not speak SOCKS.
        raise KubeConfigError(f"{where} {proxy!r}: only http:// and https:// proxies are supported")
    connection = Connection(
        server=host,
        ssl_context=None,
        tls_server_name=getattr(configuration, "tls_server_name", None) or None,
        proxy=proxy,
        source=source,
        _configuration=configuration,
        _loader=loader,
    )
    files = connection._client_cert_files()
    # Stamped before loading: files rewritten meanwhile are loaded again at the first request.
    connection._cert_files, connection._cert_stamp = files, files_stamp(files or ())
    connection.ssl_context = _ssl_context(configuration, files, source)
    return connection


async def _from_kubeconfig(
    paths: str, context: str | None, environ: Mapping[str, str]
) -> Connection:
    source = f"kubeconfig {paths}"
    if os.pathsep in paths:
        # The library merges the list; a field no kubeconfig has is refused in each file too.
        for path in paths.split(os.pathsep):
            read_kubeconfig(path)
    plain = plain_kubeconfig(paths, context)
    if plain is not None:
        return _connection(plain, None, source, environ)
    from kubernetes_asyncio.client import Configuration
    from kubernetes_asyncio.config import ConfigException, load_kube_config

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
    return _connection(configuration, loader, source, environ)


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
    if environ.get(SERVICE_HOST_ENV) and is_file(SERVICE_ACCOUNT / "token"):
        return IN_CLUSTER
    default = (home or Path(environ.get("HOME", "~")).expanduser()) / ".kube" / "config"
    if is_file(default):
        return str(default)
    raise KubeConfigError(
        "no configuration: pass --kubeconfig, set $KUBECONFIG, run in a pod with a service "
        f"account, or write {default}"
    )


def _in_cluster(environ: Mapping[str, str]) -> Connection:
    host, port = environ.get(SERVICE_HOST_ENV), environ.get(SERVICE_PORT_ENV)
    if not host or not port:
        raise KubeConfigError(
            f"in-cluster configuration: ${SERVICE_HOST_ENV} and ${SERVICE_PORT_ENV} must be set"
        )
    token, ca = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
    for path in (token, ca):
        if not path.is_file() or path.stat().st_size == 0:
            raise KubeConfigError(f"in-cluster configuration: {path} is missing or empty")
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    settings = PlainSettings(host=server, ssl_ca_cert=str(ca), token_file=str(token))
    return _connection(settings, None, "the in-cluster service account", environ)


_PLAIN_CLUSTER = frozenset(
    {
        "extensions",  # tools' metadata (kind, minikube): nothing for a connection
        "server",
        "certificate_authority",
        "certificate_authority_data",
        "insecure_skip_tls_verify",
        "tls_server_name",
        "proxy_url",
    }
)
_PLAIN_USER = frozenset(
    {
        "extensions",
        "token",
        "token_file",
        "client_certificate",
        "client_certificate_data",
        "client_key",
        "client_key_data",
    }
)


def read_kubeconfig(path: str) -> kubeconfig.Config | None:
    """The kubeconfig at ``path``, typed; None if it cannot be read or holds no YAML mapping
    (the library's error then says why). KubeConfigError if a field is unknown or holds a value
    of the wrong type, naming it."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    try:
        return kubeconfig.decode(doc)
    except kubeconfig.KubeconfigFieldError as exc:
        raise KubeConfigError(f"kubeconfig {path}: {exc}") from None


def plain_kubeconfig(path: str, context: str | None) -> PlainSettings | None:
    """``path``'s context as ``PlainSettings``; None when it needs the library: a merged list
    of files, a field kpng does not read (exec, auth-provider, username, ...), or anything
    missing or malformed (the library's error says what). KubeConfigError for a field that no
    kubeconfig has (``read_kubeconfig``)."""
    if os.pathsep in path:
        return None
    doc = read_kubeconfig(path)
    if doc is None:
        return None
    ctx = doc.context(context)
    if ctx is None:
        return None
    cluster, user = doc.cluster(ctx.cluster), doc.user(ctx.user)
    if cluster is None or user is None or _set_beyond(cluster, _PLAIN_CLUSTER):
        return None
    if _set_beyond(user, _PLAIN_USER) or not cluster.server:
        return None
    base = Path(path).parent
    try:
        ca = _file(base, cluster.certificate_authority, cluster.certificate_authority_data)
        cert = _file(base, user.client_certificate, user.client_certificate_data)
        key = _file(base, user.client_key, user.client_key_data)
    except (binascii.Error, ValueError):
        return None
    return PlainSettings(
        host=cluster.server,
        ssl_ca_cert=ca,
        verify_ssl=cluster.insecure_skip_tls_verify is not True,
        proxy=cluster.proxy_url,
        tls_server_name=cluster.tls_server_name,
        cert_file=cert,
        key_file=key,
        token=user.token,
        # A token wins over a token file, as in the library.
        token_file=None if user.token is not None else _path(base, user.token_file),
    )


def _set_beyond(fields: msgspec.Struct, plain: frozenset[str]) -> bool:
    """Whether ``fields`` sets a field that is not in ``plain`` (null is unset, as in Go)."""
    return any(
        getattr(fields, name) is not None for name in fields.__struct_fields__ if name not in plain
    )


def _file(base: Path, path: str | None, data: str | None) -> str | None:
    """The file ``path`` (relative to the kubeconfig's directory), or ``data`` (base64, its
    ``-data`` field) written to a private file removed at exit, as the library does; None if
    neither is set."""
    if data is not None:
        fd, name = tempfile.mkstemp(prefix="kpng-kubeconfig-")
        with os.fdopen(fd, "wb") as out:
            out.write(base64.b64decode(data, validate=True))
        atexit.register(Path(name).unlink, missing_ok=True)
        return name
    return _path(base, path)


def _path(base: Path, value: str | None) -> str | None:
    return str(base / value) if value is not None else None


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
        connection = _in_cluster(environ)
    else:
        connection = await _from_kubeconfig(chosen, context, environ)
    log.info("API server %s (from %s)", connection.server, connection.source)
    return connection
