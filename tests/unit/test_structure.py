"""The code's structure rules (docs/dev/architecture.md), checked on the source:

1. No module uses another module's private names: `x._name` is allowed only where `_name` is defined in
   the same module (its own classes' attributes, its own helpers), on `self`/`cls`, or for the short list
   of third-party private APIs below.
2. The streaming package's imports form a tree of layers: no cycles; core (the package top) imports
   neither checkpoint/ nor bind/; io/ imports from core only errors, config, units and layout.
ROOTS lists the directories checked: the store and the whole framework.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOTS = ["miles_plugins", "miles"]
STREAMING = REPO / "miles_plugins/optimizers/streaming"

# Private names of other projects we have to use, each with why.
THIRD_PARTY_PRIVATE = {
    "_C",  # torch._C
    "_getframe", "_exit",  # sys._getframe, os._exit
    "_base",  # tensor._base
    "_cdata",  # storage._cdata: the identity of a torch storage (shared/tied weights)
    "_ArgumentGroup",  # argparse._ArgumentGroup: the type of parser.add_argument_group()
    # megatron-core DistributedOptimizer internals the binding adapts (bind/megatron_optimizer.py)
    "_get_model_param_range_map", "_is_distopt_quantized_param", "_copy_model_params_to_main_params",
    "_defer_param_sync",
    # not private: the attribute name of the store on a bound optimizer is public API (DESIGN.md section 3)
    "_nvme_state_store",
}
IO_MAY_IMPORT = {"errors", "config", "units", "layout"}
# The one upward edge left: the store's save_to/load_from call checkpoint/ (architecture.md).
UPWARD_ALLOWED = {("store", "checkpoint.save_load")}


def _python_files(roots):
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def _defined_private_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_")}


def _private_accesses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = _defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in own or name in THIRD_PARTY_PRIVATE:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue  # an inherited private name of the class itself
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [hit for path in _python_files(ROOTS) for hit in _private_accesses(path)]
    assert not found, "private names used outside the module that defines them (make them public or move " \
                      "the code):\n" + "\n".join(found)


def _streaming_imports() -> dict[str, set[str]]:
    """{module: modules it imports}, both as dotted paths relative to the streaming package."""
    graph = {}
    for path in sorted(STREAMING.rglob("*.py")):
        module = ".".join(path.relative_to(STREAMING).with_suffix("").parts)
        package = module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package[:len(package) - (node.level - 1)]
            prefix = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # `from . import x` names a module; `from .m import x` names m
                candidate = ".".join(prefix + [alias.name])
                targets.add(candidate if (STREAMING / (candidate.replace(".", "/") + ".py")).exists()
                            else ".".join(prefix))
        graph[module] = {t for t in targets if t and not t.endswith("__init__")}
    return graph


def test_streaming_imports_have_no_cycles():
    graph = _streaming_imports()
    state = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        if state.get(module) == "active":
            pytest.fail("import cycle: " + " -> ".join(trail[trail.index(module):] + [module]))
        state[module] = "active"
        for target in sorted(graph.get(module, ())):
            visit(target, trail + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_streaming_layers_import_only_downwards():
    wrong = []
    for module, targets in _streaming_imports().items():
        layer = module.split(".")[0] if "." in module else "core"
        for target in targets:
            target_layer = target.split(".")[0] if "." in target else "core"
            if layer == "core" and target_layer in ("checkpoint", "bind") and (module, target) not in UPWARD_ALLOWED:
                wrong.append(f"core module {module} imports {target}")
            if layer == "io" and target_layer == "core" and target not in IO_MAY_IMPORT:
                wrong.append(f"io/{module.split('.', 1)[1]} imports core module {target}")
            if layer == "io" and target_layer in ("checkpoint", "bind"):
                wrong.append(f"io/{module.split('.', 1)[1]} imports {target}")
            if layer == "checkpoint" and target_layer == "bind":
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))
