"""The package's layers point one way, and no module imports itself back through others.

Every ``import`` statement counts, those inside function bodies and ``TYPE_CHECKING``
blocks included: an import deferred to a call is still an arrow between two modules, and
a cycle closed by one is still a cycle. Read from the source files, so the test needs
nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlhfflow"

#: From the top down. A module may import its own package's modules and any lower layer's;
#: the packages of one layer are independent of each other. A module belongs to the
#: longest package named here that contains it.
LAYERS: list[tuple[str, ...]] = [
    ("rlhfflow.cli",),                         # the commands
    ("rlhfflow.runtime",),                     # the coordinator's side of a run
    ("rlhfflow.runtime.worker",),              # what runs inside a device worker
    ("rlhfflow.plan.auto", "rlhfflow.monitor"),  # the auto-planner; watching a run
    ("rlhfflow.plan",),                        # placement and the compiled schedule
    ("rlhfflow.config",),                      # what the user wrote
    ("rlhfflow.stages",),                      # the built-in stage types
    ("rlhfflow.serve",),                       # the OpenAI-compatible endpoint, agents
    ("rlhfflow.sdk",),                         # the stage SDK plugin authors write against
    ("rlhfflow.data",),                        # data sets and the prompt stream
    ("rlhfflow.engine",),                      # models, decoding, episodes, user code
    ("rlhfflow.spec",),                        # typed settings the SDK names (algorithm)
    ("rlhfflow.ops", "rlhfflow.storage", "rlhfflow.launch"),  # leaves
    ("rlhfflow",),                             # the package root: version, errors, types
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` imports a.b.c's module
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("rlhfflow"):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of the longest package in LAYERS holding ``module``."""
    best = (len(LAYERS), "")
    for index, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) \
                    and len(package) > len(best[1]):
                best = (index, package)
    return best


def test_every_module_belongs_to_a_layer():
    assert [m for m in modules() if layer_of(m)[0] == len(LAYERS)] == []


def test_layers_point_one_way():
    wrong = []
    for name, targets in sorted(import_graph().items()):
        layer, package = layer_of(name)
        for target in sorted(targets):
            target_layer, target_package = layer_of(target)
            if target_package == package:
                continue
            if target_layer < layer or (target_layer == layer and target_package != package):
                wrong.append(f"{name} -> {target}")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_function_level_imports_count(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from rlhfflow.cli import main\n")
    assert imports_of("rlhfflow.ops.m", path, {"rlhfflow.cli", "rlhfflow.cli.main"}) \
        == {"rlhfflow.cli.main"}


def test_every_error_of_the_package_is_one_family():
    """Each exception class rlhfflow defines derives from ``rlhfflow.errors``'s base, so
    the command line maps them in one place (exit 2 for a user's mistake, 1 for a run)."""
    import importlib
    import inspect

    import click

    from rlhfflow.errors import RlhfflowError, RunError, UserError

    strays = []
    for name in modules():
        if name.startswith("rlhfflow.launch") or name.endswith("__main__"):
            continue  # the launcher imports the standard library only
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) \
                    and cls.__module__ == name and not issubclass(cls, RlhfflowError) \
                    and not issubclass(cls, click.ClickException):  # how the CLI says them
                strays.append(f"{name}.{cls_name}")
    assert strays == []
    assert UserError.exit_code == 2 and RunError.exit_code == 1


def test_the_sdk_imports_no_built_in_stage_and_no_torch():
    """A plugin author's package depends on the SDK alone: importing it must not import
    torch or the built-in stage types (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, rlhfflow.sdk, rlhfflow.sdk.reference; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m.startswith('rlhfflow.stages') or m.startswith('rlhfflow.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_stage_module_imports_another_built_in_stage():
    """The built-in stage modules share code through the engine, the SDK and
    ``rlhfflow.stages.trainers``, never by importing each other (``rolloutparams`` is
    the ``rollout`` stage's parameters, no stage of its own)."""
    graph = import_graph()
    stage_modules = {m for m in graph if m.startswith("rlhfflow.stages.")
                     and m not in ("rlhfflow.stages.trainers", "rlhfflow.stages.rolloutparams")}
    crossing = sorted(f"{m} -> {t}" for m in stage_modules for t in graph[m]
                      if t in stage_modules)
    assert crossing == []


def test_the_plan_and_the_algorithm_check_import_no_torch():
    """Planning and compiling a run and checking a config's algorithm (its estimator and
    loss names, looked up in the ops registries) need no torch: in a fresh interpreter,
    importing every plan and config module and validating an ``algorithm:`` section leave
    it out, and the engine too. The loader is the exception: it registers the built-in
    stage types, whose modules import the engine (``rlhfflow.stages``)."""
    import subprocess
    import sys

    light = sorted(m for m in modules() if m.startswith(("rlhfflow.plan", "rlhfflow.config"))
                   and m != "rlhfflow.config.loader")
    assert "rlhfflow.plan.compiler" in light and "rlhfflow.plan.auto.planner" in light
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {light!r}]; "
            "from rlhfflow.spec.algorithm import AlgorithmSpec; "
            "ppo = AlgorithmSpec.model_validate({'off_policy': {'correction': 'tis'}}); "
            "grpo = AlgorithmSpec.model_validate({'name': 'grpo', 'scale_rewards': 'batch'}); "
            "assert ppo.uses_critic and grpo.grouped; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m.startswith('rlhfflow.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_plan_module_imports_the_engine():
    """The plan computes with model shapes (``rlhfflow.config.shapes.ModelShape``) read
    by the config layer; it loads no model code itself."""
    graph = import_graph()
    arrows = sorted(f"{m} -> {t}" for m in graph if m.startswith("rlhfflow.plan")
                    for t in graph[m] if t.startswith("rlhfflow.engine"))
    assert arrows == []


def test_the_coordinators_decisions_import_no_dask_torch_or_storage():
    """The run's decisions (``rlhfflow.runtime.coordinator``) are a pure state, tested
    without a cluster: in a fresh interpreter, importing it leaves Dask, torch, zarr and
    the runtime's I/O modules out."""
    import subprocess
    import sys

    code = ("import sys, rlhfflow.runtime.coordinator; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('dask', 'distributed', 'torch', 'zarr') or m.startswith('rlhfflow.storage') "
            "or m in ('rlhfflow.runtime.backend', 'rlhfflow.runtime.executor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
