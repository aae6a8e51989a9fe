"""The architecture doc's table of layers is the import contract's, row for row, and every room
of ``src/kpng`` has a layer: a new module cannot slip past the contract unseen, and the doc
cannot drift from it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "design" / "architecture.md"


def _contract_layers() -> list[set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [
        {name.strip().removeprefix("kpng.") for name in layer.split("|")}
        for layer in contract["layers"]
    ]


def _doc_layers() -> list[set[str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.strip().startswith("|") or len(cells) != 2 or cells[1] in ("rooms", "---"):
            continue
        # A room is a backticked name outside parentheses (which say what the room holds).
        rooms = re.sub(r"\([^)]*\)", "", cells[1])
        rows.append(set(re.findall(r"`([A-Za-z_0-9]+)`", rooms)))
    return rows


def test_the_docs_table_of_layers_is_the_contracts() -> None:
    assert _doc_layers() == _contract_layers()


def test_every_room_of_kpng_has_a_layer() -> None:
    rooms = {
        path.stem
        for path in (ROOT / "src" / "kpng").iterdir()
        if (path.is_dir() and (path / "__init__.py").exists())
        or (path.suffix == ".py" and path.stem != "__init__")
    }
    layered = set().union(*_contract_layers())
    assert rooms - layered == set()
    assert layered - rooms == set()


def test_every_repeated_file_name_has_its_reason_in_the_docs() -> None:
    """``docs/design/architecture.md``'s Words: a file name repeats in ``src/kpng`` only where
    the doc names each of its modules."""
    doc = (ROOT / "docs" / "design" / "architecture.md").read_text()
    reasons = doc[doc.index("A file name repeats") :]
    kpng = ROOT / "src" / "kpng"
    by_name: dict[str, list[str]] = {}
    for path in sorted(kpng.rglob("*.py")):
        if path.name != "__init__.py" and "_pb2" not in path.name:
            by_name.setdefault(path.name, []).append(str(path.relative_to(kpng)))
    unexplained = [
        module
        for modules in by_name.values()
        if len(modules) > 1
        for module in modules
        if f"`{module}`" not in reasons
    ]
    assert unexplained == []
