"""The code's structure rules (docs/dev/architecture.md), checked on the source:

1. No module uses another module's private names: `x._name` is allowed only where `_name` is defined in
   the same module (its own classes' attributes, its own helpers), on `self`/`cls`, or for the short list
   of third-party private APIs below.
   Nor `from m import _name`, nor `getattr(x, "_name")` (hasattr/setattr/delattr too) of another module's name.
2. The streaming package's imports form a tree of layers: no cycles; core (the package top) imports
   neither checkpoint/ nor bind/; io/ imports from core only errors, config, units and layout.
3. The framework (miles/) imports from miles_plugins only the store's public API (nvme_stream's
   ``__all__``), the named set FRAMEWORK_MAY_IMPORT (architecture.md: "What the framework uses of the store")
   and the host services (miles_plugins/host/), which import neither the store nor the framework.
4. The training backends are compute engines under one train rank: rank.TrainRank runs init, the train call,
   sleep/wake, checkpoints, the weight handoff and shutdown and hands the loss in; a backend's engine computes
   only, shares no code with the other by copy, and a chain of stores is wrapped by one class.
5. No import cycles in miles/ (function-level and `if TYPE_CHECKING:` imports included) and no environment
   variable written that nothing reads.
6. The store and the framework are layers (LAYERS, lowest first; architecture.md, "The packages"): no import,
   at any level of a module, runs from a lower layer up to a higher one.
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
    "_get_scalar_dtype",  # torch.optim.optimizer._get_scalar_dtype: the dtype torch's Adam keeps `step` in
    # torch's new-group helper and its registry: the weight-update group is built as sglang builds the groups its
    # ranks join (init_custom_process_group), or the two sides name their store keys differently (weights/group.py)
    "_new_process_group_helper", "_world",
    # not private: the attribute name of the store on a bound optimizer is public API (DESIGN.md section 3)
    "_nvme_state_store",
}
NVME_STREAM = "miles_plugins.optimizers.nvme_stream"
STREAMING_PKG = "miles_plugins.optimizers.streaming"
# What miles/ may import from the store besides nvme_stream's __all__, module by module, with why
# (the same list, in words: docs/dev/architecture.md, "What the framework uses of the store").
FRAMEWORK_MAY_IMPORT = {
    # the CLI's defaults and value sets are the store's own (one home per default)
    f"{STREAMING_PKG}.config": {"DEFAULT_BUCKET_NUMEL", "DEFAULT_CHUNK_MB", "DEFAULT_DEPTH",
                                "DEFAULT_HOST_CACHE_RESERVE_MB", "DEFAULT_IO_THREADS", "HOST_CACHE_AUTO",
                                "IO_ENGINES", "MOMENT_DTYPES", "StreamConfig"},
    f"{STREAMING_PKG}.units": {"GB", "MiB"},
    # validation checks the store's flags by the store's own rules and words their failure for the flags
    f"{STREAMING_PKG}.errors": {"StoreConfigError"},
    # the raw-file primitives `miles bench` measures the disk floor with, and the scratch file it times
    f"{STREAMING_PKG}.io.stager": {"HostMemory", "NO_DIRECT", "Stager", "align_up", "drop_page_cache",
                                   "host_buffer", "open_direct", "pread_into", "pwrite_all"},
    # `miles plan` and the disk checks size the store with its own cost model (footprint.py), codecs,
    # host-tier placement and "auto" tier size
    f"{STREAMING_PKG}.codec": {"make_moment_codecs"},
    f"{STREAMING_PKG}.footprint": {"StoreFootprint", "smallest_bucket_numel", "store_footprint"},
    f"{STREAMING_PKG}.layout": {"EXP_AVG", "EXP_AVG_SQ"},
    f"{STREAMING_PKG}.plan": {"fit_host_cache", "place_in_host_ram"},
}
# The host services (directory ownership, host memory) both sides import: not the store, free to the framework.
HOST_PKG = "miles_plugins.host"
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


# ---- private imports and private getattrs ----------------------------------------------------------------
PRIVATE_BY_NAME = ("getattr", "hasattr", "setattr", "delattr")


def _private_name(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in THIRD_PARTY_PRIVATE


def _private_imports_and_getattrs(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = _defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"{path.relative_to(REPO)}:{node.lineno}: from {'.' * node.level}{node.module or ''} import "
                      f"{alias.name}" for alias in node.names if _private_name(alias.name)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PRIVATE_BY_NAME
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private_name(node.args[1].value)
              and node.args[1].value not in own):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_imports_or_getattrs_another_modules_private_names():
    found = [hit for path in _python_files(ROOTS) for hit in _private_imports_and_getattrs(path)]
    assert not found, "private names imported or fetched by name from another module (give them a public " \
                      "name on their owner):\n" + "\n".join(found)


# ---- the framework's view of the store -----------------------------------------------------------------
def _public_api_of_nvme_stream() -> set[str]:
    tree = ast.parse((REPO / "miles_plugins/optimizers/nvme_stream.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("nvme_stream.py declares no __all__")


def _framework_plugin_imports() -> list[tuple[str, str, str]]:
    """(where, module, name) of every import of miles_plugins in miles/, function-level ones included."""
    found = []
    for path in _python_files(["miles"]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("miles_plugins"):
                found += [(where, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(where, alias.name, "*") for alias in node.names if alias.name.startswith("miles_plugins")]
    return found


def test_the_framework_uses_only_the_plugins_public_face():
    public = {NVME_STREAM: _public_api_of_nvme_stream(), **FRAMEWORK_MAY_IMPORT}
    wrong = [f"{where}: from {module} import {name}" for where, module, name in _framework_plugin_imports()
             if name not in public.get(module, set()) and not module.startswith(HOST_PKG)]
    assert not wrong, ("miles/ imports store internals outside nvme_stream's __all__ and FRAMEWORK_MAY_IMPORT "
                       "(export the name from nvme_stream, or add it to the set and to architecture.md with "
                       "why):\n" + "\n".join(wrong))


def test_the_host_services_import_neither_the_store_nor_the_framework():
    """Directory ownership and the host-memory reading live in one package the store and miles/ both import;
    it imports nothing of either (the store stays usable alone, and the framework needs no store internals)."""
    host = REPO / HOST_PKG.replace(".", "/")
    assert {"ownership.py", "memory.py"} <= {p.name for p in host.glob("*.py")}
    wrong = []
    for path in sorted(host.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                modules = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            wrong += [f"{path.relative_to(REPO)}:{node.lineno}: {m}" for m in modules
                      if m.split(".")[0] in ("miles", "miles_plugins") or m.startswith("..")]
    assert not wrong, "the host services import the store or the framework:\n" + "\n".join(wrong)
    framework = {module for _, module, _ in _framework_plugin_imports()}
    inside_io = sorted(m for m in framework if m.startswith(f"{STREAMING_PKG}.io.") and m != f"{STREAMING_PKG}.io.stager")
    assert not inside_io, f"miles/ imports the store's io/ for what the host services offer: {inside_io}"


def test_the_framework_set_is_written_down_in_the_architecture_page():
    page = (REPO / "docs/dev/architecture.md").read_text()
    missing = [f"{module}: {name}" for module, names in FRAMEWORK_MAY_IMPORT.items()
               for name in sorted(names) if f"`{name}`" not in page or module.rsplit(".", 1)[1] not in page]
    assert not missing, "architecture.md does not name these parts of the framework's view of the store:\n" + \
        "\n".join(missing)


# ---- the training backends: engines under one train rank ---------------------------------------------------
BACKENDS_DIR = REPO / "miles/backends"
ENGINES = {"TorchEngine": BACKENDS_DIR / "torch_backend/trainer.py",
           "MegatronEngine": BACKENDS_DIR / "megatron_backend/trainer.py"}
RANKS = {"TorchTrainer": "TorchEngine", "MegatronTrainer": "MegatronEngine"}  # each backend's rank: its engine
# What rank.TrainRank runs for every backend; an engine or a backend's rank defining one of them forks it.
RANK_METHODS = {"init", "train", "sleep", "wake", "save", "finish_save", "load", "shutdown", "info", "push_weights"}


def _class_methods(path: pathlib.Path, cls: str) -> set[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    raise AssertionError(f"{path} defines no class {cls}")


def _class_body(path: pathlib.Path, cls: str) -> list[str]:
    """The statements of class ``cls`` other than its docstring, as source."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            body = node.body[1:] if ast.get_docstring(node) else node.body
            return [ast.unparse(n) for n in body]
    raise AssertionError(f"{path} defines no class {cls}")


def test_backends_are_engines_under_the_one_train_rank():
    forked = {cls: sorted(_class_methods(path, cls) & RANK_METHODS) for cls, path in ENGINES.items()}
    assert not any(forked.values()), f"engines define what rank.TrainRank runs: {forked}"
    assert RANK_METHODS <= _class_methods(BACKENDS_DIR / "rank.py", "TrainRank")
    for rank, engine in RANKS.items():  # a backend's rank only names its engine
        assert _class_body(ENGINES[engine], rank) == [f"engine_type = {engine}"], f"{rank} does more than name it"
    loss_importers = [str(path.relative_to(REPO)) for path in sorted(BACKENDS_DIR.rglob("*.py"))
                      if "policy_gradient_loss" in path.read_text() and path.name != "step.py"]
    assert not loss_importers, f"the rank hands the loss in (backends/step.py); these use their own: {loss_importers}"


def test_no_backend_imports_another_backend():
    wrong = []
    for path in sorted(BACKENDS_DIR.rglob("*.py")):
        own = path.relative_to(BACKENDS_DIR).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles.backends."):
                other = node.module.split(".")[2]
                if other.endswith("_backend") and other != own:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}")
    assert not wrong, "shared backend code belongs in miles/backends/ (engine.py, rank.py):\n" + "\n".join(wrong)


def _code_lines(path: pathlib.Path) -> list[str]:
    """The lines `duplicates` compares: stripped, white space folded; no blanks, comments, lone punctuation,
    imports or docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            first = node.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = " ".join(line.split("#", 1)[0].split()) if "#" in line and "'" not in line and '"' not in line \
            else " ".join(line.split())
        if (number in docstrings or not text or text.startswith(("#", "import ", "from "))
                or all(c in "()[]{},:" for c in text)):
            continue
        lines.append(text)
    return lines


def test_the_two_trainers_share_no_six_line_block():
    first, second = (_code_lines(path) for path in ENGINES.values())
    runs = {tuple(first[i:i + 6]) for i in range(len(first) - 5)}
    shared = [second[i:i + 6] for i in range(len(second) - 5) if tuple(second[i:i + 6]) in runs]
    assert not shared, "the engines repeat each other (move it into engine.TrainEngine):\n" + \
        "\n---\n".join("\n".join(block) for block in shared[:3])


def test_one_class_wraps_a_chains_stores():
    """A class holding a list of stores as `self.stores` is the store group; there is one."""
    holders = []
    for path in _python_files(ROOTS):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(t, ast.Attribute) and t.attr == "stores" and isinstance(t.value, ast.Name)
                    and t.value.id == "self" for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets):
                holders.append(f"{path.relative_to(REPO)}: {node.name}")
    assert len(holders) == 1, f"one wrapper for a ChainedOptimizer's stores, found {holders}"


# ---- dead code: import cycles, environment variables ------------------------------------------------------
def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def _miles_imports(typing_imports: bool = False, roots: tuple[str, ...] = ("miles",)) -> dict[str, set[str]]:
    """{module of ``roots``: modules of ``roots`` it imports}, function-level imports included, and the
    ``if TYPE_CHECKING:`` ones when ``typing_imports``."""
    modules = {_module_name(p): p for p in _python_files(roots)}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = set() if typing_imports else _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every module of one
    imports every other, directly or through the rest."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_import_cycles_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({**graph, "c": {"d"}}) == []


def test_miles_has_no_import_cycles():
    """Counting function-level and ``if TYPE_CHECKING:`` imports: a type a lower module needs comes from the
    module that defines it, not from a package whose ``__init__`` imports the lower module back."""
    graph = _miles_imports(typing_imports=True)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in miles/ (each: its modules, and the imports between them):\n" + "\n".join(
        ", ".join(f"{m} -> {sorted(graph[m] & set(cycle))}" for m in cycle) for cycle in cycles)


# The layers of the store and the framework, lowest first. A module belongs to the layer of the longest name
# here that is the module or a package holding it, and imports only from its own layer and those below.
# A module no name places falls to the bottom with the package roots: it may import nothing until it is placed.
LAYERS = (
    ("miles", "miles_plugins.host"),  # the package roots (empty) and the host services both sides use
    ("miles_plugins",),  # the store
    ("miles.arg_parser", "miles.parallel"),  # argparse with suggestions; Megatron's layout arithmetic
    ("miles.config",),  # the run's configuration: flags, RunConfig, defaults, paths, the backends table, errors
    ("miles.untrusted_json", "miles.logging_setup", "miles.progress", "miles.process_memory", "miles.sizing"),
    ("miles.models", "miles.checkpoint", "miles.rl", "miles.offload", "miles.routing"),
    ("miles.weights", "miles.rollout"),
    ("miles.backends",),
    # validation against the model, the machine and the disks (validate_args); `miles plan`, which reads a model
    # the megatron backend builds through its family, as validation does
    ("miles.preflight", "miles.sizing.cli"),
    ("miles.ray",),
    ("miles.run_lifecycle", "miles.metrics"),
    ("miles.train", "miles.bench"),
    ("miles.cli",),
)


def layer_of(module: str, layers=LAYERS) -> int:
    placed = [(len(name), index) for index, names in enumerate(layers) for name in names
              if module == name or module.startswith(name + ".")]
    return max(placed)[1] if placed else 0


def arrows_back_up(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Each import from a lower layer to a higher one, as ``importer (layer) -> imported (layer)``."""
    return [f"{module} ({layer_of(module, layers)}) -> {target} ({layer_of(target, layers)})"
            for module in sorted(graph) for target in sorted(graph[module])
            if layer_of(target, layers) > layer_of(module, layers)]


def test_arrows_back_up_finds_an_import_of_a_higher_layer():
    layers = (("a",), ("b", "c.low"), ("c",))
    graph = {"a.x": {"b"}, "b": {"c.low.y", "c.z"}, "c.z": {"a.x"}, "c.low.y": set()}
    assert arrows_back_up(graph, layers) == ["a.x (0) -> b (1)", "b (1) -> c.z (2)"]
    assert layer_of("unplaced.module", layers) == 0


def test_no_import_runs_back_up_the_layers():
    """Counting function-level and ``if TYPE_CHECKING:`` imports: a lower layer that needs a higher one's code
    takes the code down (or the check up into the layer that owns what it checks)."""
    arrows = arrows_back_up(_miles_imports(typing_imports=True, roots=tuple(ROOTS)))
    assert not arrows, f"{len(arrows)} import(s) run back up LAYERS (move the code, or place a new module in " \
                       "LAYERS):\n" + "\n".join(arrows)


def _environment_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """MILES_* variable names written into an environment (dict keys and assignments) and read from one."""
    written, read = set(), set()

    def name_of(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and node.value.startswith("MILES_") else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            written.update(n for n in map(name_of, node.keys) if n)
        elif isinstance(node, ast.Subscript) and name_of(node.slice):
            (written if isinstance(node.ctx, ast.Store) else read).add(node.slice.value)
        elif isinstance(node, ast.Call) and node.args and name_of(node.args[0]):
            func = ast.unparse(node.func)
            if func.endswith(("environ.get", "getenv", "environ.pop")):
                read.add(node.args[0].value)
            elif func.endswith("environ.setdefault"):
                written.add(node.args[0].value)
        elif isinstance(node, (ast.Tuple, ast.List)) and all(name_of(e) or isinstance(e, ast.Constant) for e in node.elts):
            read.update(n for n in map(name_of, node.elts) if n)  # a list of names forwarded to a process
    return written, read


def test_every_environment_variable_written_is_read():
    written, read = set(), set()
    for path in _python_files(ROOTS):
        w, r = _environment_names(ast.parse(path.read_text()))
        written |= w
        read |= r
    assert not written - read, f"environment variables set and never read (drop them): {sorted(written - read)}"


def test_the_public_api_offers_no_study_only_codec(tmp_path):
    """The unscaled fp8 cast served only a study script; the store's API refuses it like any unknown format."""
    import torch

    from miles_plugins.optimizers import nvme_stream
    from miles_plugins.optimizers.streaming import codec

    assert not [name for name in dir(codec) if "unscaled" in name.lower()]
    with pytest.raises(nvme_stream.StoreConfigError, match="is not supported"):
        nvme_stream.stream_optimizer_state(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]),
                                           dir=str(tmp_path), moment_dtype="_fp8e4m3_unscaled")
