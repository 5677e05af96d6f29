"""The layers contract (pyproject.toml, checked by `lint-imports` in CI) names every module:
a new module that no layer lists would escape the check."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _contract() -> dict:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["type"] == "layers")


def test_every_module_of_the_package_is_in_a_layer():
    listed = {name.strip() for layer in _contract()["layers"]
              for name in layer.replace("|", ":").split(":")}
    package = ROOT / "src" / "nbtrain"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert modules - listed == set(), "add these modules to a layer in pyproject.toml"
    assert listed - modules == set(), "the contract names modules that do not exist"


def test_the_engines_sit_below_the_entry_point_and_above_what_they_share():
    layers = [layer.replace("|", ":").split(":") for layer in _contract()["layers"]]
    depth = {name.strip(): i for i, layer in enumerate(layers) for name in layer}
    assert depth["entry"] < depth["ray_cluster"] < depth["distributed"] < depth["loop"] \
        < depth["prepare"] < depth["run"] < depth["config"]
    assert depth["magic"] < depth["compare"] < depth["dashboard"] < depth["entry"]
