"""pyproject.toml says what is used: every third-party import of the package, its tests and its
scripts is declared (the package's in its core dependencies or the extra that uses it, the tests'
in `dev`), a module-level import of the package is a core dependency (so a core install imports
every module), and every declared dependency is imported somewhere or named below with why not."""
import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# import name -> distribution, for distributions not installed here (the GPU extra)
NOT_INSTALLED = {"flash_attn": "flash-attn"}
# modules loaded only where their extra is installed (attention backends chosen at run time): they
# may import it at module level, and no other module imports them at module level
EXTRA_MODULES = {"splitserve/engine/attention/triton_kernels.py": "gpu",
                 "splitserve/engine/attention/triton_paged.py": "gpu",
                 "splitserve/engine/attention/cuda.py": "gpu",
                 "splitserve/engine/kernel_warm_up.py": "gpu",
                 "splitserve/engine/model/triton_ops.py": "gpu",
                 "splitserve/engine/model/triton_lora.py": "gpu",
                 "splitserve/engine/model/fused_moe.py": "gpu",
                 "splitserve/engine/model/fused_moe_kernels.py": "gpu",
                 "splitserve/engine/model/split_k.py": "gpu",
                 "splitserve/engine/model/expert_dequantize.py": "gpu",
                 "splitserve/engine/model/moe_align.py": "gpu",
                 "splitserve/engine/model/moe_routing.py": "gpu",
                 "splitserve/engine/model/fp8_linear.py": "gpu",
                 "splitserve/engine/model/fp8_w8a8.py": "gpu",
                 "splitserve/engine/model/int_linear.py": "gpu",
                 "splitserve/engine/model/w8a8_tiles.py": "gpu",
                 "splitserve/engine/triton_e4m3.py": "gpu",
                 "splitserve/engine/triton_token_filters.py": "gpu",
                 "splitserve/engine/triton_sampling.py": "gpu",
                 "splitserve/engine/model/triton_tiles.py": "gpu"}
USED_WITHOUT_IMPORT = {
    "python-multipart": "FastAPI parses the multipart forms of /v1/files with it",
    "pytest-timeout": "a pytest plugin (the timeout in pyproject's pytest options)",
    "pytest-xdist": "a pytest plugin (-n 2 in the README's test command; --dist in pyproject's pytest options)",
    "accelerate": "transformers loads an FP8 checkpoint (test_fp8.py's reference) only where it is installed",
    "compressed-tensors": "transformers decompresses a compressed-tensors checkpoint (test_compressed_tensors.py's "
                          "reference) with it",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _extra(name: str) -> set[str]:
    """The distributions an extra brings, following extras of this project itself."""
    names = set()
    for requirement in PROJECT["optional-dependencies"][name]:
        if _name(requirement) == "splitserve":
            for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):
                names |= _extra(inner.strip())
        else:
            names.add(_name(requirement))
    return names


CORE = {_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {name: _extra(name) for name in PROJECT["optional-dependencies"]}
DISTRIBUTIONS = {k: [d.lower().replace("_", "-") for d in v] for k, v in importlib.metadata.packages_distributions().items()}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module name, imported at module level and unguarded) of each import."""
    tree = ast.parse(path.read_text())
    guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
               if any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                      for h in t.handlers) for n in ast.walk(t)}
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    type_only = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.unparse(t.test)
                 for n in ast.walk(t)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            if id(node) not in type_only:
                found.append((name, id(node) not in guarded | in_function))
    return found


def _third_party_imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level name, eager) of each third-party import; a script's import of another script in
    its folder (run as `python scripts/x.py`, the folder is on the path) is local."""
    tops = [(name.split(".")[0], eager) for name, eager in _imports(path)]
    local = {"splitserve", "tests", "__future__"} | {p.stem for p in path.parent.glob("*.py")}
    return [(top, eager) for top, eager in tops if top not in sys.stdlib_module_names and top not in local]


def _distribution(module: str) -> str:
    if module in NOT_INSTALLED:
        return NOT_INSTALLED[module]
    assert module in DISTRIBUTIONS, f"{module} is imported but no installed distribution provides it"
    return DISTRIBUTIONS[module][0]


def _used(root: str):
    for path in sorted((ROOT / root).rglob("*.py")):
        for module, eager in _third_party_imports(path):
            yield str(path.relative_to(ROOT)), _distribution(module), eager


def test_the_package_declares_what_it_imports():
    everything = CORE.union(*EXTRAS.values())
    for path, dist, eager in _used("splitserve"):
        assert dist in everything, f"{path} imports {dist}, which pyproject.toml does not declare"
        if eager and path in EXTRA_MODULES:
            assert dist in CORE | EXTRAS[EXTRA_MODULES[path]], f"{path} imports {dist}: not in core or its extra"
        elif eager:
            assert dist in CORE, f"{path} imports {dist} at module level, but it is only in an extra: import it " \
                                 "where it is used, or make it a core dependency"


def test_modules_of_an_extra_are_imported_only_where_they_are_used():
    names = {path.removesuffix(".py").replace("/", ".") for path in EXTRA_MODULES}
    for path in sorted((ROOT / "splitserve").rglob("*.py")):
        if str(path.relative_to(ROOT)) in EXTRA_MODULES:
            continue
        for name, eager in _imports(path):
            assert not (eager and name in names), f"{path.relative_to(ROOT)} imports {name} at module level"


def test_tests_and_scripts_declare_what_they_import():
    available = CORE | EXTRAS["dev"]
    for root in ("tests", "scripts"):
        for path, dist, _ in _used(root):
            assert dist in available, f"{path} imports {dist}: add it to the dev extra"


def test_every_declared_dependency_is_used():
    used = {dist for root in ("splitserve", "tests", "scripts") for _, dist, _ in _used(root)}
    declared = CORE.union(*EXTRAS.values()) - {"splitserve"}
    assert declared - used - set(USED_WITHOUT_IMPORT) == set()


def test_plots_are_an_extra_the_server_does_not_need():
    assert "matplotlib" not in CORE and "matplotlib" in EXTRAS["plots"] <= EXTRAS["dev"]
