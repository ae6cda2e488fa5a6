"""Data shipped with the package (see each folder's README for source and license)."""
from pathlib import Path

TRACES_DIR = Path(__file__).parent / "traces"
