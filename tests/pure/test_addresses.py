"""The one parser of the addresses kpng's flags take (kpng.addresses), as a table."""

from __future__ import annotations

import pytest

from kpng.addresses import check_grpc_url, host_port
from kpng.errors import UsageError


@pytest.mark.parametrize(
    ("text", "listening", "ok"),
    [
        ("unix:///run/kpng.sock", False, True),
        ("unix:///run/kpng.sock", True, True),
        ("unix://run/kpng.sock", True, False),
        ("tcp://127.0.0.1:12090", False, True),
        ("tcp://[::1]:12090", True, True),
        ("127.0.0.1:12090", False, True),  # a server may be HOST:PORT
        ("127.0.0.1:12090", True, False),  # a listener says its scheme
        ("tcp://127.0.0.1:0", True, True),  # listening on a free port
        ("tcp://127.0.0.1:0", False, False),
        ("tcp://:12090", False, False),
        ("http://127.0.0.1:12090", False, False),
        ("tcp://127.0.0.1:70000", True, False),
    ],
)
def test_grpc_urls(text: str, listening: bool, ok: bool) -> None:
    if ok:
        assert check_grpc_url(text, flag="--x", listening=listening) == text
    else:
        with pytest.raises(UsageError, match=r"--x"):
            check_grpc_url(text, flag="--x", listening=listening)


@pytest.mark.parametrize(
    ("text", "port_zero", "parsed"),
    [
        ("127.0.0.1:10256", False, ("127.0.0.1", 10256)),
        ("[fd00::1]:10249", False, ("fd00::1", 10249)),
        (":10256", False, ("", 10256)),
        ("0.0.0.0:0", True, ("0.0.0.0", 0)),
        ("0.0.0.0:0", False, None),
        ("10256", False, None),
        ("host:http", False, None),
        ("a/b:1", False, None),
    ],
)
def test_host_port(text: str, port_zero: bool, parsed: tuple[str, int] | None) -> None:
    assert host_port(text, port_zero=port_zero) == parsed
