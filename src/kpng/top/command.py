"""``kpng top``: the command, its live terminal view (curses) and its ``--once`` table."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kpng.errors import EXIT_ERROR, EXIT_USAGE
from kpng.http1.client import HttpClient
from kpng.scraping import DEFAULT_URL, TIMEOUT_S, ReadError, Scrape, fetch, metrics_url, parse
from kpng.top.ranking import Sort, View, fresh, kept, table, view

if TYPE_CHECKING:
    import curses

WINDOW_S = 30.0
"""The rates' default window: three of to-nft's reads of the kernel's counters."""

_KEYS = {ord("c"): Sort.CONNS, ord("r"): Sort.REFUSED, ord("n"): Sort.NAME}
_QUIT = {ord("q"), ord("Q"), 27}  # 27: Escape

DESCRIPTION = """\
One node's Service ports by new connections per second, refused connections and the endpoints'
share, read from the node's /metrics (kpng started with to-nft --traffic-counters service).
CONN/S and CONNS count every new connection to the port, refused ones included; REFUSED/S and
REFUSED those refused for want of endpoints; BUSIEST is the endpoint taking the largest share
of the port's connections (when the node exports kpng_endpoint_connections_total).
Live keys: c, r, n sort by connections, refused, name; q quits.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kpng top", description=DESCRIPTION)
    parser.add_argument(
        "--metrics-url",
        default=DEFAULT_URL,
        metavar="URL",
        help="the node's metrics address, as HOST:PORT or an http(s) URL; the path is /metrics "
        f"unless the URL names another (default: {DEFAULT_URL}, kube-proxy's)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="time between two scrapes (default: 2)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=WINDOW_S,
        metavar="SECONDS",
        help="the rates are taken over the scrapes of the last SECONDS, between the first and "
        "last that saw the node read its counters (to-nft reads them every 10 s); with --once, "
        "how long to scrape at most, 0 for one scrape and totals only "
        f"(default: {WINDOW_S:g})",
    )
    parser.add_argument(
        "--sort",
        choices=[s.value for s in Sort],
        default=Sort.CONNS.value,
        help="order of the rows: connections per second, refused per second (each then by "
        "total), or namespace/service/port (default: conns)",
    )
    parser.add_argument(
        "--limit", type=int, metavar="N", help="show the first N rows only (default: all)"
    )
    parser.add_argument("--namespace", metavar="NS", help="only the Services of this namespace")
    parser.add_argument(
        "--once",
        action="store_true",
        help="print a plain table and exit: scrapes every --interval until the node has read "
        "its counters twice (the rates then span whole reads) or --window has passed",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        url = metrics_url(args.metrics_url)
    except ReadError as exc:
        parser.error(str(exc))
    if not (0 < args.interval < math.inf):
        parser.error(f"--interval must be a positive number of seconds, got {args.interval:g}")
    if not (args.window == 0 or args.interval <= args.window < math.inf):
        parser.error(
            f"--window must be 0 (totals only) or at least --interval ({args.interval:g}), "
            f"got {args.window:g}"
        )
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit must be positive, got {args.limit}")
    top = _Top(url, args)
    try:
        if args.once:
            return top.once()
        return top.live()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (``| head -3``): not a failure. Point stdout at /dev/null so
        # the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


class _Top:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.interval: float = args.interval
        self.window: float = args.window
        self.sort = Sort(args.sort)
        self.limit: int | None = args.limit
        self.namespace: str | None = args.namespace
        self.scrapes: list[Scrape] = []

    def view(self, *, fits: int | None = None, window: float | None = None) -> View:
        """The rows, ``--limit`` of them, and no more than ``fits`` (the screen's), rated over
        ``window`` (``--window`` by default)."""
        limit = self.limit if fits is None or self.limit is None else min(self.limit, fits)
        return view(
            self.scrapes,
            window=self.window if window is None else window,
            sort=self.sort,
            limit=fits if limit is None else limit,
            namespace=self.namespace,
        )

    async def scrape(self, client: HttpClient) -> Scrape:
        text = await fetch(client, self.url)
        return parse(text, at=time.monotonic())

    def keep(self, scrape: Scrape) -> None:
        self.scrapes = kept([*self.scrapes, scrape], window=self.window)

    # --- --once

    def once(self) -> int:
        try:
            asyncio.run(self._collect())
        except ReadError as exc:
            print(f"kpng top: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        newest = self.scrapes[-1]
        if not newest.counting:
            print(f"kpng top: error: {_no_counters(self.url)}", file=sys.stderr)
            return EXIT_ERROR
        # Every scrape was taken for these rates, however long the scrapes took.
        shown = self.view(window=math.inf)
        print("\n".join(table(shown.rows)))
        for note in _notes(newest, shown):
            print(f"kpng top: {note}", file=sys.stderr)
        return 0

    async def _collect(self) -> None:
        client = HttpClient(ssl_context=None, connect_timeout=TIMEOUT_S)
        try:
            self.scrapes.append(await self.scrape(client))
            start = self.scrapes[0].at
            if not self.scrapes[0].counting:
                return
            while self.window > 0 and len(fresh(self.scrapes)) < 2:
                left = start + self.window - time.monotonic()
                if left <= 0:
                    break
                await asyncio.sleep(min(self.interval, left))
                self.scrapes.append(await self.scrape(client))
        finally:
            await client.close()

    # --- the live view

    def live(self) -> int:
        import curses

        if not sys.stdout.isatty():
            print(
                "kpng top: error: the live view needs a terminal; --once prints a table",
                file=sys.stderr,
            )
            return EXIT_USAGE
        return curses.wrapper(self._live)

    def _live(self, screen: curses.window) -> int:
        import curses

        with contextlib.suppress(curses.error):  # a terminal that cannot hide its cursor
            curses.curs_set(0)
        with asyncio.Runner() as runner:
            client = HttpClient(ssl_context=None, connect_timeout=TIMEOUT_S)
            error: str | None = None
            while True:
                started = time.monotonic()
                try:
                    self.keep(runner.run(self.scrape(client)))
                    error = None
                except ReadError as exc:
                    error = str(exc)
                # A page slower to read than the interval (its parse takes 0.9 s of CPU at
                # 10,000 Service ports) is read at most half the time: keys are read between.
                now = time.monotonic()
                due = max(started + self.interval, now + (now - started))
                while True:
                    self._draw(screen, error)
                    screen.timeout(max(0, int((due - time.monotonic()) * 1000)))
                    key = screen.getch()
                    if key in _QUIT:
                        runner.run(client.close())
                        return 0
                    if key in _KEYS:
                        self.sort = _KEYS[key]
                    elif key == -1:
                        break  # time for the next scrape
                    elif key == curses.KEY_RESIZE:
                        curses.update_lines_cols()

    def _draw(self, screen: curses.window, error: str | None) -> None:
        import curses

        height, width = screen.getmaxyx()
        screen.erase()
        shown = self.view(fits=max(0, height - 3))
        span = "totals only" if shown.span is None else f"rates over {shown.span:.0f}s"
        title = (
            f"kpng top  {self.url}  every {self.interval:g}s, {span}  "
            f"sort: {self.sort.value} (c conns, r refused, n name, q quit)"
        )
        status = error
        if status is None and self.scrapes and not self.scrapes[-1].counting:
            status = _no_counters(self.url)
        if status is None and self.scrapes:
            status = "; ".join(_notes(self.scrapes[-1], shown)) or (
                f"{shown.matched} Service ports"
            )
        lines = table(shown.rows)
        _put(screen, 0, title, width, curses.A_BOLD)
        _put(screen, 1, status or "reading...", width, curses.A_NORMAL)
        _put(screen, 2, lines[0], width, curses.A_REVERSE)
        for y, line in enumerate(lines[1:], start=3):
            if y >= height:
                break
            _put(screen, y, line, width, curses.A_NORMAL)
        screen.refresh()


def _put(screen: curses.window, y: int, text: str, width: int, attributes: int) -> None:
    import curses

    if y >= screen.getmaxyx()[0] or width <= 1:
        return
    # width - 1: writing the bottom-right cell moves the cursor out of the window, an error;
    # one resized meanwhile is redrawn at the next key or scrape.
    with contextlib.suppress(curses.error):
        screen.addnstr(y, 0, text, width - 1, attributes)


def _no_counters(url: str) -> str:
    return (
        f"{url} has no traffic counters (kpng_service_connections_total): start kpng's "
        "to-nft with --traffic-counters service"
    )


def _notes(newest: Scrape, shown: View) -> list[str]:
    notes = []
    if shown.span is None:
        notes.append("one scrape: totals only, no rates")
    if newest.dropped:
        notes.append(
            f"the node left {newest.dropped:.0f} Service ports out, those with the least "
            "traffic (--traffic-series-limit)"
        )
    if newest.endpoints_dropped:
        notes.append(
            f"the node left {newest.endpoints_dropped:.0f} endpoints out, those with the least "
            "traffic: BUSIEST is of those it exports"
        )
    if len(shown.rows) < shown.matched:
        notes.append(f"{len(shown.rows)} of {shown.matched} Service ports shown")
    return notes
