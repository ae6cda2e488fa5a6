"""Which way imports go (docs/architecture.md): every layer below the Ray layer imports nothing
from Ray or from `splitserve.cluster`, and each imports only the layers under it. Checked twice:
statically over every import statement (lazy ones included), and by importing each layer's
modules in a fresh interpreter and looking at what got loaded."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "splitserve"
# layer -> the splitserve layers it may import (besides itself); top-level helper modules count as layers
ALLOWED = {
    "engine": set(),
    "transfer": {"engine"},
    "placement": {"engine"},
    "api": {"engine"},
    "batch": {"api", "engine", "command"},
    "config": {"api", "batch", "engine", "placement"},
    "bench": {"data", "command", "jobs", "machine"},
    "sim": {"bench", "command", "config", "engine", "placement"},
    "provision": {"bench", "jobs", "sim"},
    "cluster": {"api", "batch", "config", "engine", "jobs", "placement", "transfer"},
}
RAY_FREE = sorted(set(ALLOWED) - {"cluster"})


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_under_it(layer):
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if layer != "cluster":
                assert top != "ray", f"{path.relative_to(PACKAGE.parent)} imports {name}"
            if top == "splitserve" and "." in name:
                used = name.split(".")[1]
                assert used == layer or used in ALLOWED[layer], \
                    f"{path.relative_to(PACKAGE.parent)} ({layer}) imports {name}"


def test_every_layer_is_known():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - {"data"}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("layer", RAY_FREE)
def test_importing_a_layer_loads_no_ray(layer):
    code = f"""
import importlib, json, pkgutil, sys
import splitserve.{layer} as layer
for module in pkgutil.walk_packages(layer.__path__, "splitserve.{layer}."):
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
print(json.dumps(sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "splitserve.cluster")))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []
