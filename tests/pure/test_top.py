"""``kpng top``'s pure part: rates from scrapes (resets, stepwise reads), sorting, filtering,
the endpoints' share and the table; the page's parsing; the command's usage errors."""

from __future__ import annotations

import fcntl
import http.server
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import pytest

from kpng.scraping import PortCounts, ReadError, Scrape, metrics_url, parse
from kpng.top.ranking import (
    HEADER,
    Row,
    Sort,
    cells,
    increase,
    kept,
    span,
    table,
    view,
)

WEB = ("shop", "web", "http")
DB = ("shop", "db", "")
API = ("ops", "api", "grpc")


def _scrape(at: float, **ports: tuple[float, float]) -> Scrape:
    keys = {"web": WEB, "db": DB, "api": API}
    return Scrape(at, {keys[n]: PortCounts(c, r) for n, (c, r) in ports.items()})


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], 0),
        ([5], 0),
        ([5, 9, 12], 7),
        # A drop is a restart from zero: what it shows after is what it counted since.
        ([5, 9, 2, 4], 4 + 2 + 2),
        ([10, 0], 0),
        ([10, 10, 10], 0),
    ],
)
def test_increase_takes_a_drop_as_a_restart(values: list[float], expected: float) -> None:
    assert increase(values) == expected


def _steps(times: Sequence[float], values: Sequence[float]) -> list[Scrape]:
    return [_scrape(t, web=(v, 0)) for t, v in zip(times, values, strict=True)]


@pytest.mark.parametrize(
    ("scrapes", "window", "expected"),
    [
        ([], 30, None),
        (_steps([0], [1]), 30, None),
        # Counters that move at every scrape (read when scraped): from the first seen to move.
        (_steps([0, 2, 4, 6], [1, 2, 3, 4]), 30, (1, 3)),
        (_steps([0, 2, 4, 6], [1, 2, 3, 4]), 4, (1, 3)),
        # Read every 10 s, scraped every 2 s: between the first and last scrape that saw a read.
        (_steps([0, 2, 4, 6, 8, 10, 12, 14, 16], [5, 5, 9, 9, 9, 9, 9, 14, 14]), 30, (2, 7)),
        # One read in the window: no whole read to measure, the window's ends.
        (_steps([0, 2, 4, 6], [5, 5, 9, 9]), 30, (0, 3)),
        # Nothing moved: the window's ends (rates of 0).
        (_steps([0, 2, 4], [5, 5, 5]), 30, (0, 2)),
    ],
)
def test_rates_span_whole_reads_of_the_counters_when_the_window_has_two(
    scrapes: list[Scrape], window: float, expected: tuple[int, int] | None
) -> None:
    assert span(scrapes, window=window) == expected


@pytest.mark.parametrize(
    ("times", "window", "expected"),
    [
        ([], 30, []),
        ([0], 30, [0]),
        ([0, 10, 20, 30], 30, [0, 10, 20, 30]),
        ([0, 10, 20, 30, 40], 30, [0, 10, 20, 30, 40]),  # 0: the one before 10, the oldest
        ([0, 10, 20, 30, 40, 50], 30, [10, 20, 30, 40, 50]),
        ([0, 2, 4], 0, [2, 4]),
    ],
)
def test_the_scrapes_kept_are_the_windows_and_the_one_before(
    times: list[float], window: float, expected: list[float]
) -> None:
    assert [s.at for s in kept(_steps(times, [0] * len(times)), window=window)] == expected


def test_a_stepwise_counter_is_rated_over_whole_reads_not_the_scrapes_phase() -> None:
    # 10 connections a second, read every 10 s, scraped every 2 s from a phase of 4 s.
    times = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24]
    values = [0, 0, 0, 100, 100, 100, 100, 100, 200, 200, 200, 200, 200]
    rows = view(_steps(times, values), window=30).rows
    assert rows[0].connections_rate == pytest.approx(10.0)
    # From the read's phase alone: 100 over the 6 s from the first scrape would say 16.7.


def _row(name: str, conns: float | None, refused: float | None, total: float = 0) -> Row:
    return Row("shop", name, "", total, 0, conns, refused, None)


def test_rows_are_rated_sorted_filtered_and_cut() -> None:
    scrapes = [
        _scrape(0, web=(100, 0), db=(50, 10), api=(0, 0)),
        _scrape(10, web=(150, 0), db=(150, 60), api=(30, 30)),
    ]
    by_conns = view(scrapes, window=30)
    assert by_conns.span == 10
    assert [(r.service, r.connections_rate, r.refused_rate) for r in by_conns.rows] == [
        ("db", 10.0, 5.0),
        ("web", 5.0, 0.0),
        ("api", 3.0, 3.0),
    ]
    by_refused = view(scrapes, window=30, sort=Sort.REFUSED)
    assert [r.service for r in by_refused.rows] == ["db", "api", "web"]
    by_name = view(scrapes, window=30, sort=Sort.NAME)
    assert [(r.namespace, r.service) for r in by_name.rows] == [
        ("ops", "api"),
        ("shop", "db"),
        ("shop", "web"),
    ]
    cut = view(scrapes, window=30, limit=1, namespace="shop")
    assert ([r.service for r in cut.rows], cut.matched) == (["db"], 2)


def test_a_restarted_node_and_a_new_service_port_are_rated_from_what_they_have() -> None:
    scrapes = [
        _scrape(0, web=(900, 0)),
        _scrape(10, web=(1000, 0)),
        _scrape(20, web=(40, 0), db=(7, 0)),  # kpng restarted; db is new
        _scrape(30, web=(90, 0), db=(27, 0)),
    ]
    rows = {r.service: r for r in view(scrapes, window=30).rows}
    assert rows["web"].connections_rate == pytest.approx((40 + 50) / 20)
    assert rows["db"].connections_rate == pytest.approx(20 / 10)
    assert (rows["web"].connections, rows["db"].connections) == (90, 27)


def test_one_scrape_gives_totals_sorted_by_them_and_no_rates() -> None:
    shown = view([_scrape(0, web=(5, 0), db=(9, 9))], window=30)
    assert shown.span is None
    assert [(r.service, r.connections_rate, r.connections) for r in shown.rows] == [
        ("db", None, 9),
        ("web", None, 5),
    ]


def test_endpoint_shares_are_of_the_span_when_it_had_traffic_else_of_the_totals() -> None:
    def at(t: float, a: float, b: float) -> Scrape:
        counts = PortCounts(a + b, 0, {"10.244.1.2": a, "10.244.1.3": b})
        return Scrape(t, {WEB: counts})

    moving = view([at(0, 100, 0), at(10, 130, 10)], window=30).rows[0]
    assert moving.endpoints == 2
    assert moving.shares == (("10.244.1.2", 0.75), ("10.244.1.3", 0.25))
    idle = view([at(0, 60, 20), at(10, 60, 20)], window=30).rows[0]
    assert idle.shares == (("10.244.1.2", 0.75), ("10.244.1.3", 0.25))
    assert view([at(0, 0, 0)], window=30).rows[0].shares == ()
    # No endpoint level on the node: nothing said of endpoints.
    assert view([_scrape(0, web=(1, 0))], window=30).rows[0].endpoints is None


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            Row("shop", "web", "http", 1234, 0, 12.345, 0.0, 3, (("10.244.1.2", 0.625),)),
            ("shop", "web", "http", "12.3", "0.0", "1234", "0", "3", "10.244.1.2=62%"),
        ),
        (
            Row("shop", "db", "", 9, 9, None, None, None),
            ("shop", "db", "-", "-", "-", "9", "9", "-", "-"),
        ),
    ],
)
def test_every_cell_is_one_field_for_scripts(row: Row, expected: tuple[str, ...]) -> None:
    assert cells(row) == expected


def test_the_table_aligns_its_columns() -> None:
    lines = table([_row("web", 12.5, 0, 3000), _row("a-long-name", None, None, 1)])
    assert lines == [
        "NAMESPACE  SERVICE      PORT  CONN/S  REFUSED/S  CONNS  REFUSED  ENDPOINTS  BUSIEST",
        "shop       web          -       12.5        0.0   3000        0          -  -",
        "shop       a-long-name  -          -          -      1        0          -  -",
    ]


# --- the page


PAGE = """\
# HELP kpng_service_connections_total new connections
# TYPE kpng_service_connections_total counter
kpng_service_connections_total{namespace="shop",service="web",port="http"} 12
kpng_service_connections_total{namespace="shop",service="db",port=""} 3
kpng_service_connections_total{namespace="shop",service="bad"} 5
# TYPE kpng_service_rejected_total counter
kpng_service_rejected_total{namespace="shop",service="db",port=""} 3
# TYPE kpng_endpoint_connections_total counter
kpng_endpoint_connections_total{namespace="shop",service="web",port="http",endpoint="10.244.1.2"} 12
# TYPE kpng_service_traffic_series_dropped gauge
kpng_service_traffic_series_dropped 4
# TYPE kpng_endpoint_traffic_series_dropped gauge
kpng_endpoint_traffic_series_dropped 2
# TYPE kpng_store_revision gauge
kpng_store_revision 7
"""


def test_a_page_gives_each_port_its_counters_skipping_samples_without_the_labels() -> None:
    scrape = parse(PAGE, at=1.5)
    assert scrape.ports == {
        WEB: PortCounts(12, 0, {"10.244.1.2": 12}),
        DB: PortCounts(3, 3, {}),
    }
    assert (scrape.at, scrape.counting, scrape.dropped, scrape.endpoints_dropped) == (
        1.5,
        True,
        4,
        2,
    )


def test_a_page_without_the_traffic_metrics_says_the_node_counts_nothing() -> None:
    assert parse("# TYPE kpng_store_revision gauge\nkpng_store_revision 7\n", at=0) == Scrape(
        0, {}, counting=False
    )


@pytest.mark.parametrize(
    "text",
    [
        'kpng_service_connections_total{namespace="a" 1\n',
        "kpng_service_connections_total{} abc\n",
        "<html>not metrics</html>\n",
        "aE#{,\t=ToT #\\I\\#LNrPr.}cbr}n#\n_",  # prometheus_client: an IndexError
    ],
)
def test_a_page_that_is_not_prometheus_text_is_an_error(text: str) -> None:
    with pytest.raises(ReadError, match="not Prometheus text"):
        parse(text, at=0)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:10249", "http://127.0.0.1:10249/metrics"),
        ("http://[::1]:10249/", "http://[::1]:10249/metrics"),
        ("https://node-1:10249/other", "https://node-1:10249/other"),
    ],
)
def test_a_metrics_address_becomes_a_url(address: str, expected: str) -> None:
    assert metrics_url(address) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metrics-url", "ftp://x/"], "--metrics-url: not HOST:PORT or an http(s) URL"),
        (["--metrics-url", "127.0.0.1:99999"], "--metrics-url: Port out of range"),
        (["--interval", "0"], "--interval must be a positive number of seconds, got 0"),
        (["--window", "1"], "--window must be 0 (totals only) or at least --interval (2), got 1"),
        (["--limit", "0"], "--limit must be positive, got 0"),
        (["--sort", "bytes"], "invalid choice: 'bytes'"),
    ],
)
def test_usage_errors_name_the_flag(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kpng", "top", "--once", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr


# --- the command against a served page


class _Pages:
    """What the local server answers: a status and a body, changed by the test."""

    status = 200
    body = PAGE.encode()


@pytest.fixture
def served() -> Iterator[tuple[str, type[_Pages]]]:
    class Pages(_Pages):
        pass

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(Pages.status)
            self.send_header("Content-Length", str(len(Pages.body)))
            self.end_headers()
            self.wfile.write(Pages.body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", Pages
    finally:
        server.shutdown()
        server.server_close()


def _top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpng", "top", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.slow
def test_once_with_no_window_prints_the_totals_and_says_so(
    served: tuple[str, type[_Pages]],
) -> None:
    address, _ = served
    done = _top("--metrics-url", address, "--once", "--window", "0", "--sort", "name")
    assert done.returncode == 0, done.stderr
    assert [line.split() for line in done.stdout.splitlines()] == [
        list(HEADER),
        ["shop", "db", "-", "-", "-", "3", "3", "-", "-"],
        ["shop", "web", "http", "-", "-", "12", "0", "1", "10.244.1.2=100%"],
    ]
    assert done.stderr.splitlines() == [
        "kpng top: one scrape: totals only, no rates",
        "kpng top: the node left 4 Service ports out, those with the least traffic "
        "(--traffic-series-limit)",
        "kpng top: the node left 2 endpoints out, those with the least traffic: BUSIEST is of "
        "those it exports",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (200, b"kpng_store_revision 7\n", "has no traffic counters"),
        (404, b"not found", "answered HTTP 404"),
        (200, b"<html>\n", "not Prometheus text"),
        (200, b"\xff\xfe\n", "not UTF-8 text"),
    ],
)
def test_once_says_what_is_wrong_with_the_page(
    served: tuple[str, type[_Pages]], status: int, body: bytes, message: str
) -> None:
    address, pages = served
    pages.status, pages.body = status, body
    done = _top("--metrics-url", address, "--once", "--window", "0")
    assert done.returncode == 1
    assert done.stdout == ""
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def _without(env: Mapping[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.slow
def test_the_live_view_shows_the_rows_changes_its_sort_by_key_and_quits(
    served: tuple[str, type[_Pages]],
) -> None:
    address, _ = served
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kpng", "top", "--metrics-url", address, "--interval", "0.2"],
        stdin=child,
        stdout=child,
        stderr=child,
        # curses takes LINES and COLUMNS over the terminal's size, and pytest-xdist's workers
        # have them set (24 x 80, too narrow for the BUSIEST column).
        env={**_without(os.environ, "LINES", "COLUMNS"), "TERM": "xterm"},
    )
    os.close(child)
    screen = b""

    def until_shown(text: bytes, since: int = 0) -> None:
        nonlocal screen
        deadline = time.monotonic() + 20
        while text not in screen[since:]:
            assert time.monotonic() < deadline, screen
            if select.select([main], [], [], 0.5)[0]:
                screen += os.read(main, 65536)

    try:
        until_shown(b"sort: conns")
        until_shown(b"10.244.1.2=100%")
        # curses sends the cells that changed only: the sort's name, once the key is read.
        since = len(screen)
        os.write(main, b"n")
        until_shown(b"name", since)
        os.write(main, b"q")
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
