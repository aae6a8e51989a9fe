"""The documentation holds together: docs/ builds as a site with no broken link or anchor, the
README stays a short front page whose links into docs/ resolve, and the references name what
kpng has (every metric a scrape shows, every name of ``kpng.client``).

mkdocs checks only docs/ (mkdocs.yml makes every warning fatal: a link to a missing page or
anchor, a page left out of the nav); the README is checked here, with the slugs mkdocs gives
headings.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import kpng.client
from kpng.backends.ebpf import observing
from kpng.sources.kube.reflector import ReflectorStats
from kpng.testing.ports import free_port
from kpng.testing.waiting import until
from tests.conftest import EXAMPLE

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200
"""The README is the front page: what kpng is, how to set it up, a tour, and links. The rest
lives in docs/, by audience."""

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _links(markdown: str) -> Iterator[str]:
    """The targets of the inline links outside code blocks and code spans."""
    prose = _FENCE.sub("", markdown)
    prose = re.sub(r"`[^`\n]*`", "``", prose)
    for match in _LINK.finditer(prose):
        yield match.group(1)


def _slug(heading: str) -> str:
    """The id Python-Markdown's toc extension (mkdocs' default) gives a heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    prose = _FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, re.MULTILINE)}


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_the_readme_is_a_short_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail into"
        " docs/ (by audience) and link to it"
    )
    text = README.read_text()
    # The two set-up commands stay on the front page.
    assert "make example" in text
    assert "make test" in text


def test_the_readmes_links_resolve() -> None:
    targets = list(_links(README.read_text()))
    assert any(t.startswith("docs/") for t in targets), "the README links into docs/"
    broken = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:...
            continue
        path, _, anchor = target.partition("#")
        page = (ROOT / path).resolve() if path else README
        if not page.exists():
            broken.append(f"{target}: no such file")
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert not broken, broken


def test_the_slugs_are_mkdocs_ones() -> None:
    assert _slug("Backends anywhere: `kpng local`") == "backends-anywhere-kpng-local"
    assert _slug("Split shapes: a brain apart from the node's backend") == (
        "split-shapes-a-brain-apart-from-the-nodes-backend"
    )
    assert _slug("7. Test it without a server") == "7-test-it-without-a-server"


def test_the_client_reference_names_every_public_name() -> None:
    reference = (DOCS / "backends" / "client.md").read_text()
    missing = [name for name in kpng.client.__all__ if f"`{name}`" not in reference]
    assert not missing, f"docs/backends/client.md does not name {missing}"


def _scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text: str = response.read().decode()
            return text
    except (urllib.error.URLError, ConnectionError):
        return ""


def _metric_names(
    argv: list[str], ready: str, kpng_command: list[str], env: dict[str, str], log: Path
) -> set[str]:
    """The metric families kpng serves, scraped once ``ready`` is among them."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [*kpng_command, "--metrics-address", f"127.0.0.1:{port}", *argv],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )  # fmt: skip
    try:
        until(
            lambda: f"# TYPE {ready} " in _scrape(url), f"{ready} in /metrics", within=30,
            interval=0.2,
        )  # fmt: skip
        text = _scrape(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def test_the_metrics_reference_names_every_metric(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    example = ["file", "--input", str(EXAMPLE)]
    node = [*example, "to-local", "--node-name", "node-2", "to-json", "--output", "-"]
    server = [*example, "to-api", "--listen", f"unix://{tmp_path / 'api.sock'}"]
    names = _metric_names(
        node, "kpng_backend_applied_revision", kpng_command, subprocess_env, tmp_path / "a.log"
    )
    names |= _metric_names(
        server, "kpng_api_watches", kpng_command, subprocess_env, tmp_path / "b.log"
    )
    # The kube source's counters need an API server: they are named from its stats.
    names |= {f"kpng_source_{f.name}" for f in dataclasses.fields(ReflectorStats)}
    # to-ebpf's need a kernel that loads its programs: they are named from its module.
    names |= set(observing.METRICS)
    assert "kpng_store_revision" in names
    reference = (DOCS / "reference" / "metrics.md").read_text()
    documented = set(re.findall(r"[a-z][a-z0-9_]*", reference))
    # A counter family's samples end in _total; the reference names the samples.
    missing = sorted(n for n in names if n not in documented and f"{n}_total" not in documented)
    assert not missing, f"docs/reference/metrics.md does not name {missing}"


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        ("see [a](docs/a.md) and `[b](c.md)`", ["docs/a.md"]),
        ("```sh\n[x](y.md)\n```\n[z](docs/z.md#h)", ["docs/z.md#h"]),
    ],
)
def test_links_are_found_outside_code(markdown: str, expected: list[str]) -> None:
    assert list(_links(markdown)) == expected
