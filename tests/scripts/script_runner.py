"""A script under scripts/ loaded as a module (to test its pieces) or run as a subprocess (end to end)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/`name`.py as a module (scripts are no package: they import their folder's others)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """scripts/`name`.py run with `args` in a subprocess of this interpreter, its output captured."""
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout)


def run_ray_script(name: str, folder: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    """scripts/`name`.py end to end on its own local Ray (skipped without Ray), writing its --json
    into `folder`: the finished process (it must have succeeded) and that JSON."""
    pytest.importorskip("ray")
    out = folder / f"{name}.json"
    done = run_script(name, *args, "--json", str(out), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())
