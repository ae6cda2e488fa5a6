"""deploy/Dockerfile against pyproject.toml and the helm chart. No Docker engine here to build it,
so the checks read its instructions: the torch pin, the package with its GPU extra, the files the
build needs, and the user and tools the chart's pods rely on."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VALUES = yaml.safe_load((ROOT / "helm" / "splitserve" / "values.yaml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def stages(text: str) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in instructions(text):
        if instruction[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


STAGES = stages((ROOT / "deploy" / "Dockerfile").read_text())
RUNS = " ".join(args for stage in STAGES for kind, args in stage if kind == "RUN")
FINAL = STAGES[-1]


def torch_requirement() -> Requirement:
    found = [Requirement(d) for d in PYPROJECT["project"]["dependencies"] if Requirement(d).name == "torch"]
    assert len(found) == 1, found
    return found[0]


def test_torch_is_in_pyprojects_range_from_pytorchs_cuda_index():
    match = re.search(r"pip install torch==(\S+) --index-url https://download\.pytorch\.org/whl/\S+", RUNS)
    assert match, "no `pip install torch==... --index-url https://download.pytorch.org/whl/...`"
    assert torch_requirement().specifier.contains(match.group(1))
    assert RUNS.index(match.group(0)) < RUNS.index(".[gpu]"), "torch must be in place before the package"


def test_installs_the_package_with_its_gpu_extra():
    assert "gpu" in PYPROJECT["project"]["optional-dependencies"]
    assert re.search(r'pip install [^&]*"\.\[gpu\]"', RUNS)
    copied = " ".join(args for stage in STAGES for kind, args in stage if kind == "COPY" and "--from" not in args)
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = ["pyproject.toml", PYPROJECT["project"]["readme"], *packages]
    for path in needed:
        assert path.rstrip("*") in copied, f"the build needs {path}"


def test_python_version_meets_requires_python():
    minimum = tuple(map(int, re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"]).groups()))
    versions = {tuple(map(int, v)) for v in re.findall(r"python(\d+)\.(\d+)", RUNS)}
    assert versions == {(3, 11)} and (3, 11) >= minimum


def test_runs_as_the_non_root_user_the_chart_expects():
    users = [args.strip() for kind, args in FINAL if kind == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    assert users[-1] not in ("root", "0")
    assert users[-1].split(":")[0] == str(VALUES["containerSecurityContext"]["runAsUser"])
    assert re.search(r"useradd [^&]*--uid 1000", " ".join(a for k, a in FINAL if k == "RUN"))


@pytest.mark.parametrize("tool", ["wget", "python3.11"])
def test_final_image_has_what_kuberay_and_ray_need(tool):
    """KubeRay probes Ray with `wget ... | grep success` (and starts it with bash)."""
    final_runs = " ".join(args for kind, args in FINAL if kind == "RUN")
    assert re.search(rf"apt-get install [^&]*\b{re.escape(tool)}\b", final_runs)


def test_final_image_can_build_tritons_launcher():
    """At its first kernel launch on CUDA, Triton compiles a C launcher (`triton.runtime.build`)
    with gcc or clang, against the headers of the interpreter's base prefix (not the venv's):
    the final image needs a compiler, the C library's headers and Python's."""
    build = inspect.getsource(pytest.importorskip("triton.runtime.build"))
    assert 'shutil.which("gcc")' in build and "sysconfig.get_paths" in build and "py_include_dir" in build
    final_runs = " ".join(args for kind, args in FINAL if kind == "RUN")
    for package in ("gcc", "libc6-dev", "python3.11-dev"):
        assert re.search(rf"apt-get install [^&]*(?<![\w.-]){re.escape(package)}(?![\w.-])", final_runs), package


def test_ray_and_python_on_path_and_no_model_baked_in():
    env = " ".join(args for kind, args in FINAL if kind == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env  # the venv holds ray (pyproject's ray[serve]) and python
    assert any(kind == "COPY" and "--from=build /opt/venv /opt/venv" in args for kind, args in FINAL)
    assert not re.search(r"snapshot_download|hf download|huggingface-cli|\.safetensors", RUNS)
