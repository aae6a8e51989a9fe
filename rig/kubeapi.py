"""A small synchronous client to write objects into a test control plane, and object builders.

Tests and benchmarks create, change and delete objects with it; it is not kpng's client (the kube
source has its own) so that a fault in one cannot hide a fault in the other. One keep-alive
connection per thread: the benchmarks create objects from a few threads.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# The objects' builders are the test library's; tests reach them here beside the client.
from kpng.testing.objects import Obj as Obj
from kpng.testing.objects import endpoint as endpoint
from kpng.testing.objects import endpoint_slice as endpoint_slice
from kpng.testing.objects import node as node
from kpng.testing.objects import service as service
from rig.cluster import ControlPlane

_COLLECTIONS = {
    "Service": ("/api/v1", "services", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "Node": ("/api/v1", "nodes", False),
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceCIDR": ("/apis/networking.k8s.io/v1", "servicecidrs", False),
}


def write_kubeconfig(path: Path, *, server: str, ca: Path, user: Obj) -> Path:
    """A kubeconfig of one context: ``server`` verified with ``ca``, credentials ``user`` (e.g.
    ``{"token": T}`` or ``{"client-certificate": F, "client-key": K}``)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "clusters": [
            {"name": "c", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }
    path.write_text(json.dumps(config))
    return path


class ApiError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        super().__init__(f"HTTP {status}: {body[:500].decode(errors='replace')}")


def collection_path(kind: str, namespace: str = "") -> str:
    prefix, resource, namespaced = _COLLECTIONS[kind]
    if namespaced:
        return f"{prefix}/namespaces/{namespace or 'default'}/{resource}"
    return f"{prefix}/{resource}"


def object_path(kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(kind, namespace)}/{name}"


class KubeApi:
    def __init__(self, server: str, token: str, context: ssl.SSLContext) -> None:
        url = urlsplit(server)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 443
        self._token = token
        self._context = context
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPSConnection] = []

    @classmethod
    def of(cls, plane: ControlPlane, port: int | None = None) -> KubeApi:
        """A client of ``plane``'s apiserver (or of the one it started on ``port``)."""
        return cls(plane.server_at(port or plane.apiserver_port), plane.token, plane.ssl_context())

    def _connection(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, context=self._context, timeout=60
            )
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    def request(
        self, method: str, path: str, body: Obj | None = None, content_type: str = ""
    ) -> Obj:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type or "application/json"
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
            except (ConnectionError, http.client.HTTPException):
                # A kept-alive connection the server closed (e.g. it was restarted): retry once
                # on a new one.
                self._drop_connection()
                if attempt == 2:
                    raise
                continue
            if response.status >= 300:
                raise ApiError(response.status, payload)
            result: Obj = json.loads(payload) if payload else {}
            return result
        raise AssertionError("unreachable")

    def create(self, obj: Obj) -> Obj:
        meta = obj.get("metadata", {})
        return self.request("POST", collection_path(obj["kind"], meta.get("namespace", "")), obj)

    def get(self, kind: str, namespace: str, name: str) -> Obj:
        return self.request("GET", object_path(kind, namespace, name))

    def list(self, kind: str, namespace: str = "", **params: str) -> Obj:
        path = collection_path(kind, namespace) if namespace else _cluster_path(kind)
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return self.request("GET", f"{path}?{query}" if query else path)

    def patch(self, kind: str, namespace: str, name: str, patch: Obj) -> Obj:
        """A JSON merge patch (``null`` removes a key, e.g. a label)."""
        return self.request(
            "PATCH", object_path(kind, namespace, name), patch, "application/merge-patch+json"
        )

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.request("DELETE", object_path(kind, namespace, name))

    def ensure_namespace(self, name: str) -> None:
        try:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        except ApiError as exc:
            if exc.status != 409:
                raise


def _cluster_path(kind: str) -> str:
    prefix, resource, _ = _COLLECTIONS[kind]
    return f"{prefix}/{resource}"


# --- builders


def pod(
    name: str,
    namespace: str,
    image: str,
    args: list[str],
    *,
    node: str | None = None,
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> Obj:
    """A pod of one container, ``agnhost`` as upstream's tests name it; ``node`` pins it."""
    body: Obj = {"containers": [{"name": "agnhost", "image": image, "args": args}], **spec}
    if node is not None:
        body["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": body,
    }


def deployment(
    name: str, namespace: str, image: str, args: list[str], *, replicas: int, **spec: Any
) -> Obj:
    """``replicas`` pods as ``pod`` makes them, labelled ``app: name``."""
    labels = {"app": name}
    template = pod(name, namespace, image, args, labels=labels, **spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": template["spec"]},
        },
    }
