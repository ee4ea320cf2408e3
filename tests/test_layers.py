"""No module imports from a layer above its own (the table in docs/architecture.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlscale"
# (importing file, imported unit): the upward imports docs/architecture.md names and explains
DOCUMENTED_EXCEPTIONS = {("ckpt/faults.py", "cluster"), ("ckpt/faults.py", "preemption")}


def layer_table() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers: begin -->")[1].split("<!-- layers: end -->")[0]
    layers = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].isdigit():
            for unit in re.findall(r"`([a-z_]+)`", cells[1]):
                layers[unit] = int(cells[0])
    return layers


def unit_of(path: Path) -> str:
    """The top-level module or package a file belongs to (`workers` for workers/policy.py)."""
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def imported_units(path: Path) -> set[str]:
    """Every rlscale unit the file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "rlscale" else [f"rlscale.{a.name}" for a in node.names]
        else:
            continue
        out.update(name.split(".")[1] for name in names if name.startswith("rlscale."))
    return out


def test_every_unit_has_a_layer():
    units = {unit_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert sorted(units - set(layer_table())) == [], "add these to the layer table in docs/architecture.md"
    assert sorted(set(layer_table()) - units) == [], "the layer table names modules that do not exist"


def test_no_import_goes_up_a_layer():
    layers = layer_table()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(path)
        if unit == "__init__":
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for target in imported_units(path) - {unit}:
            if layers[target] > layers[unit] and (rel, target) not in DOCUMENTED_EXCEPTIONS:
                upward.append(f"{rel} (layer {layers[unit]}) imports {target} (layer {layers[target]})")
    assert upward == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: an import from a higher layer, inside a function, is found."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from rlscale.controller import train\n    import rlscale.workers.policy\n")
    assert imported_units(source) == {"controller", "workers"}
    layers = layer_table()
    assert layers["controller"] > layers["workers"] > layers["config"] == 0
