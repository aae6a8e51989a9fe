"""Where the API server is and how to authenticate: kubeconfig and in-cluster configuration.

kubernetes_asyncio's configuration loaders read the configuration (kubeconfig merging of
``$KUBECONFIG`` lists, contexts, client certificates and keys as files or data, bearer tokens and
token files, exec credential plugins of any ``client.authentication.k8s.io`` version, including
plugins that return client certificates and expiring tokens, custom CAs, ``tls-server-name``,
the in-cluster service account with its rotated token). kpng uses them for that alone: the HTTP
requests, lists and watches are kpng's own (``client.py``, ``reflector.py``). Tokens are
refreshed as they expire; client certificates (from files, data or an exec plugin) are loaded once,
when kpng starts.

lightkube's loader was the other candidate; it accepts exec plugins of ``v1alpha1`` and
``v1beta1`` only (not the GA ``v1``) and no plugin that returns a client certificate.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
from collections.abc import Callable, Mapping
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

    def _exec_expired(self) -> bool:
        expiry = getattr(self._loader, "exec_plugin_expiry", None)
        return isinstance(expiry, datetime.datetime) and expiry <= datetime.datetime.now(
            datetime.UTC
        )

    def _has_exec_plugin(self) -> bool:
        user = getattr(self._loader, "_user", None)
        return user is not None and "exec" in user


def _ssl_context(configuration: Configuration, source: str) -> ssl.SSLContext | None:
    if not str(configuration.host).startswith("https://"):
        return None
    try:
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if not configuration.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise KubeConfigError(f"{source}: cannot load its certificates: {exc}") from None
    return context


def _connection(
    configuration: Configuration, loader: KubeConfigLoader | None, source: str
) -> Connection:
    host = str(configuration.host or "").rstrip("/")
    if not host.startswith(("https://", "http://")):
        raise KubeConfigError(f"{source}: no API server address (cluster.server)")
    return Connection(
        server=host,
        ssl_context=_ssl_context(configuration, source),
        tls_server_name=getattr(configuration, "tls_server_name", None) or None,
        proxy=configuration.proxy or None,
        source=source,
        _configuration=configuration,
        _loader=loader,
    )


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
