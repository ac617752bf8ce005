"""Code that only runs on a GPU host must still import here: every module of the packages imports on
CPU (heavy GPU dependencies are imported inside functions), and every `from X import name` in the GPU
and end-to-end tests names something X has. Otherwise a rename is found only on the GPU host."""

import ast
import importlib
import os
import pkgutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("miles", "miles_plugins")
TEST_DIRS = ("tests/gpu", "tests/e2e", "tests/unit")


def _modules():
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
            yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_module_imports_on_cpu(name):
    importlib.import_module(name)


def _from_imports():
    for test_dir in TEST_DIRS:
        folder = os.path.join(ROOT, test_dir)
        for fname in sorted(os.listdir(folder)):
            if not fname.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, fname)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    yield f"{test_dir}/{fname}", node.module, [a.name for a in node.names]


def _top_level_names(path):
    """Names a module file defines at top level (for test modules whose import needs a GPU package)."""
    names = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _local(module):
    top = module.split(".")[0]
    return top in PACKAGES or any(os.path.exists(os.path.join(ROOT, d, top + ".py")) for d in TEST_DIRS)


@pytest.mark.parametrize("where, module, names", [i for i in _from_imports() if _local(i[1])],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_test_imports_name_what_exists(where, module, names, monkeypatch):
    for d in TEST_DIRS:
        monkeypatch.syspath_prepend(os.path.join(ROOT, d))
    try:
        defined = set(dir(importlib.import_module(module)))
    except ModuleNotFoundError as e:  # a GPU-only test helper (megatron-core): read its file instead
        if e.name.split(".")[0] in PACKAGES or "." in module:
            raise
        path = next(os.path.join(ROOT, d, module + ".py") for d in TEST_DIRS
                    if os.path.exists(os.path.join(ROOT, d, module + ".py")))
        defined = _top_level_names(path)
    missing = [n for n in names if n != "*" and n not in defined]
    assert not missing, f"{where}: `from {module} import` names what {module} lacks: {missing}"
