"""A script under scripts/ loaded as a module (to test its pieces) or run as a subprocess (end to end)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/`name`.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """scripts/`name`.py run with `args` in a subprocess of this interpreter, its output captured."""
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout)
