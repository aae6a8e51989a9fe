"""Client certificate rotation without an API server: change detection, reloading, notAfter.
(Against a real one: tests/apiserver/test_kube_apiserver.py,
test_client_certificate_files_rotated.)"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from kpng.kubeclient.config import (
    Connection,
    files_stamp,
    load_connection,
)
from rig.cluster import ClientCert, Pki, issue_client_cert, make_pki
from rig.kubeapi import write_kubeconfig


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _replace(path: Path, content: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def test_a_stamp_changes_when_a_file_is_rewritten_or_replaced(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"one")
    b.write_bytes(b"two")
    stamp = files_stamp([str(a), str(b), None])
    assert stamp is not None
    assert files_stamp([str(a), str(b)]) == stamp
    _replace(b, b"two")  # same content, another inode
    assert files_stamp([str(a), str(b)]) != stamp
    stamp = files_stamp([str(a), str(b)])
    a.write_bytes(b"three")
    assert files_stamp([str(a), str(b)]) != stamp
    assert files_stamp([str(a), str(tmp_path / "missing")]) is None


def _connection(pki: Pki, cert: Path, key: Path, tmp_path: Path) -> Connection:
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig",
        server="https://127.0.0.1:6443",
        ca=pki.ca_cert,
        user={"client-certificate": str(cert), "client-key": str(key)},
    )
    return asyncio.run(load_connection(kubeconfig, environ={}))


def _write(cert: Path, key: Path, issued: ClientCert) -> None:
    _replace(cert, issued.cert_pem)
    _replace(key, issued.key_pem)


def test_certificate_files_are_reloaded_when_they_change(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    _write(cert, key, issue_client_cert(pki))
    connection = _connection(pki, cert, key, tmp_path)
    first = connection.ssl_context
    assert first is not None
    connection.refresh_client_certificate()
    assert connection.ssl_context is first  # unchanged files: nothing loaded

    caplog.set_level(logging.INFO, logger="kpng.kubeclient.config")
    fresh = issue_client_cert(pki)
    _replace(cert, fresh.cert_pem)  # the key not yet: they do not match
    connection.refresh_client_certificate()
    connection.refresh_client_certificate()
    assert connection.ssl_context is first
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings

    _replace(key, fresh.key_pem)
    connection.refresh_client_certificate()
    assert connection.ssl_context is not first
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"new client certificate in use: {cert}"]
    second = connection.ssl_context
    connection.refresh_client_certificate()
    assert connection.ssl_context is second

    key.unlink()  # mid-rotation by delete and write: the loaded certificate stays
    connection.refresh_client_certificate()
    assert connection.ssl_context is second
