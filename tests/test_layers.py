"""The layers contract (pyproject.toml, checked by `lint-imports` in CI) names packages and
the few modules at the top: every module inside a package is checked without being
listed, and the top stays small."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "nbtrain"


def _contract() -> dict:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["type"] == "layers")


def _depths() -> dict:
    layers = [layer.split("#")[0].replace("|", ":").split(":") for layer in _contract()["layers"]]
    return {name.strip(): i for i, layer in enumerate(layers) for name in layer}


def test_every_package_and_top_module_is_in_a_layer_and_the_top_stays_small():
    top = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    listed = set(_depths())
    assert (top | packages) - listed == set(), "add these to a layer in pyproject.toml"
    assert listed - (top | packages) == set(), "the contract names what does not exist"
    assert len(top) + 1 <= 12 and len(listed) <= 21


def test_the_engines_sit_below_the_entry_point_and_above_what_they_share():
    depth = _depths()
    assert depth["ui"] < depth["tools"] < depth["views"] < depth["entry"] \
        < depth["parallel"] == depth["watcher"] < depth["runstore"] < depth["train"] \
        < depth["run"] < depth["auto"] < depth["data"] < depth["machine"] < depth["config"]


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
