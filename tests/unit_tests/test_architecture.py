"""The package's shape, read from the source with ``ast`` (nothing is
imported but by the namespace's check):

* no import cycle among the repository's modules, counting imports inside
  functions too (a function-level import is still a dependency; it only
  hides the cycle until the function runs);
* the pure modules (decisions, layouts, messages, parsing) never reach
  ``torch.distributed``, themselves or through anything of the repository
  they import, so they stay testable without process groups;
* process groups are made in one module of ours (a rank's generation) and
  in the trainer's initialize, nowhere else;
* every import points up docs/architecture.md's list (``ORDER``), and no
  layer reaches one it must not (``FORBIDDEN``: the launcher side holds no
  tensors, the trainer runs without deadpool, tools/ is not installed);
* a process ends only in a ``main`` (``PROCESS_MAINS`` names the two mains
  by contract and the exit they share);
* tests that start processes are in tests/functional_tests, marked
  ``integration`` as a whole module, and tests/unit_tests marks none;
* ``megatron`` is a namespace package: megatron-core from the wheel,
  megatron.training from the repository.

Each check has a negative control that feeds it a small cycle or a small
impure package and asserts that it is caught; so does conftest.py's guard
that keeps unmarked tests from starting processes.
"""

import ast
import multiprocessing
import os
import subprocess
import sys
import sysconfig
import textwrap
from collections import deque
from typing import Dict, Iterator, List, Optional, Set

import pytest

from tests.conftest import ProcessInUnitTest, processes_forbidden_unless_integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The repository's packages, as dotted names (their folders follow).
PACKAGES = ["deadpool_ext", "megatron.training", "tools"]

# Modules that must never reach torch.distributed: pure arithmetic and pure
# parsing, no process groups, no sockets. A package name stands for all of
# its modules. A name that is no module of the repository fails the test.
PURE_MODULES = [
    "deadpool_ext.defaults",  # the tuning constants and the timeouts' order
    "deadpool_ext.policy",  # the job's rules: every decision the coordinator carries out
    "deadpool_ext.protocol",  # the control plane's messages
    "deadpool_ext.topology",  # buddy maps and rank layouts
    "deadpool_ext.inject",  # fault specs (parsing; firing is signals)
    "tools.compare",  # how runs are judged equal
    "tools.planning",  # the planner, goodput model and Slurm layout
]
# Stricter still: no torch and no megatron at all (the planner runs on any laptop).
TORCH_FREE_MODULES = ["deadpool_ext.defaults", "tools.planning"]

Graph = Dict[str, Set[str]]


# ----- the repository's modules -----
def find_modules(root: str, packages: List[str]) -> Dict[str, str]:
    """Dotted module name -> file, for every .py file under the packages."""
    modules = {}
    for package in packages:
        top = os.path.join(root, *package.split("."))
        for folder, _, files in os.walk(top):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    modules[module_name(root, path)] = path
    return modules


def module_name(root: str, path: str) -> str:
    parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: str) -> bool:
    return os.path.basename(path) == "__init__.py"


def parents(module: str) -> List[str]:
    """``a.b.c`` -> ``a.b``, ``a``: the packages Python runs first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


# ----- what a module imports -----
def import_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every import anywhere in the module, in functions too, except under
    ``if TYPE_CHECKING:`` (never run: the usual way to name a type across
    modules without a runtime dependency)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and is_type_checking(node.test):
        for statement in node.orelse:
            yield from import_nodes(statement)
    else:
        for child in ast.iter_child_nodes(node):
            yield from import_nodes(child)


def is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def absolute_base(node: ast.ImportFrom, module: str, path: str) -> str:
    """The module a ``from ... import`` names, with relative dots resolved."""
    if node.level == 0:
        return node.module
    package = module if is_package(path) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def repository_module(name: str, modules: Dict[str, str]) -> Optional[str]:
    """The repository module that loading ``name`` runs: itself, or its
    longest prefix that is one; None outside the repository."""
    for candidate in [name] + parents(name):
        if candidate in modules:
            return candidate
    return None


def targets(node: ast.AST, module: str, path: str, modules: Dict[str, str]) -> Iterator[str]:
    """The repository modules one import statement depends on: ``from p import
    x`` is p.x when x is a submodule, else p (x is a name defined in p)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = absolute_base(node, module, path)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    for name in names:
        found = repository_module(name, modules)
        if found is not None:
            yield found


def parse(path: str) -> ast.AST:
    with open(path) as f:
        return ast.parse(f.read(), path)


def dependencies(module: str, modules: Dict[str, str]) -> Set[str]:
    """The repository modules ``module`` imports, at module level or in a
    function. Parent packages are left out: Python runs them first, but an
    edge to each would call every package that re-exports its modules a cycle."""
    path = modules[module]
    found = set()
    for node in import_nodes(parse(path)):
        found.update(targets(node, module, path, modules))
    return found - {module}


def import_graph(root: str, packages: List[str]) -> Graph:
    modules = find_modules(root, packages)
    return {module: dependencies(module, modules) for module in modules}


# ----- cycles -----
def shortest_path(graph: Graph, start: str, goal: str) -> Optional[List[str]]:
    """Breadth-first: the shortest import chain from start to goal."""
    came_from = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, ())):
            if child == goal:
                chain = [child, node]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    return None


def rotate_to_smallest(cycle: List[str]) -> tuple:
    """One form per cycle whichever module it was found from."""
    ring = cycle[:-1]
    i = ring.index(min(ring))
    return tuple(ring[i:] + ring[:i] + [ring[i]])


def find_cycles(graph: Graph) -> List[List[str]]:
    """The shortest cycle through each module that is on one, each cycle once,
    as ``[a, b, a]``."""
    cycles = set()
    for module in graph:
        cycle = shortest_path(graph, module, module)
        if cycle:
            cycles.add(rotate_to_smallest(cycle))
    return [list(c) for c in sorted(cycles)]


def show(chain: List[str]) -> str:
    return " -> ".join(chain)


# ----- torch.distributed -----
def distributed_imports(path: str) -> List[int]:
    """Lines that import torch.distributed, in any form (``import
    torch.distributed``, ``from torch import distributed``, ``from
    torch.distributed.x import y``), or use it as ``torch.distributed``."""
    lines = []
    tree = parse(path)
    for node in import_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.level == 0 and node.module == "torch":
            names = [f"torch.{alias.name}" for alias in node.names]
        else:
            names = [node.module or ""] if node.level == 0 else []
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            lines.append(node.lineno)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return sorted(set(lines))


def expand(names: List[str], modules: Dict[str, str]) -> List[str]:
    """Module names, a package standing for itself and all its modules; a
    name that matches nothing fails, so a renamed module is not left unchecked."""
    expanded = []
    for name in names:
        matches = sorted(m for m in modules if m == name or m.startswith(name + "."))
        assert matches, (
            f"PURE_MODULES lists {name}, which is no module or package "
            "of the repository: update the list"
        )
        expanded += matches
    return expanded


def reaches_distributed(module: str, graph: Graph, modules: Dict[str, str]) -> List[str]:
    """Every import chain from ``module`` to a repository module that imports
    torch.distributed (parent packages count: Python runs them first)."""
    came_from = {module: None}
    queue = deque([module])
    found = []
    while queue:
        node = queue.popleft()
        lines = distributed_imports(modules[node])
        if lines:
            chain = [node]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            found.append(f"{show(chain[::-1])} (line {', '.join(map(str, lines))})")
        for child in sorted(graph[node] | (set(parents(node)) & set(modules))):
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    return found


def impure(names: List[str], root: str, packages: List[str]) -> List[str]:
    modules = find_modules(root, packages)
    graph = import_graph(root, packages)
    return [
        chain
        for module in expand(names, modules)
        for chain in reaches_distributed(module, graph, modules)
    ]


def imported_names(path: str) -> Set[str]:
    """Absolute module names a file imports (relative imports are the repository's)."""
    names = set()
    for node in import_nodes(parse(path)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif node.level == 0 and node.module:
            names.add(node.module)
    return names


def reachable(module: str, graph: Graph, modules: Dict[str, str]) -> Set[str]:
    seen, queue = {module}, deque([module])
    while queue:
        node = queue.popleft()
        for child in graph[node] | (set(parents(node)) & set(modules)):
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return seen


def heavy_imports(names: List[str], root: str, packages: List[str]) -> List[str]:
    """'module: name' for every torch or megatron import the modules reach."""
    modules = find_modules(root, packages)
    graph = import_graph(root, packages)
    found = []
    for module in expand(names, modules):
        for reached in sorted(reachable(module, graph, modules)):
            found += [
                f"{module} -> {reached}: {name}"
                for name in sorted(imported_names(modules[reached]))
                if name.split(".")[0] in ("torch", "megatron")
            ]
    return found


# ----- the repository -----
def test_no_import_cycle():
    cycles = find_cycles(import_graph(REPO, PACKAGES))
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        show(c) for c in cycles
    )


def test_pure_modules_never_reach_torch_distributed():
    chains = impure(PURE_MODULES, REPO, PACKAGES)
    assert not chains, "pure modules that reach torch.distributed:\n" + "\n".join(chains)


def test_the_planner_imports_neither_torch_nor_megatron():
    found = heavy_imports(TORCH_FREE_MODULES, REPO, PACKAGES)
    assert not found, "torch-free modules that import torch or megatron:\n" + "\n".join(found)


def test_the_torch_free_check_sees_a_heavy_import(tmp_path):
    package = tmp_path / "light"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from light import b\n")
    (package / "b.py").write_text("def f():\n    import megatron.core\n")
    assert heavy_imports(["light.a"], str(tmp_path), ["light"]) == [
        "light.a -> light.b: megatron.core"
    ]


def test_the_graph_sees_the_packages_imports():
    """Guards the reader: an empty graph would pass every check above."""
    graph = import_graph(REPO, PACKAGES)
    edges = [(a, b) for a, deps in graph.items() for b in deps]
    assert any(a.startswith("deadpool_ext.") and b.startswith("deadpool_ext.") for a, b in edges)
    assert any(
        a.startswith("deadpool_ext.") and b.startswith("megatron.training.") for a, b in edges
    )


# docs/architecture.md's list of the parts, bottom-up: a module imports only
# what stands above it. A package listed whole (the trainer, policy/,
# tools/) is one place, its modules free to import each other (without a
# cycle); state/, control/ and rank/ are listed module by module, and a
# module of theirs left out of the list may import nothing.
ORDER = [
    "deadpool_ext.defaults",
    "megatron.training",
    "deadpool_ext.protocol",
    "deadpool_ext.topology",
    "deadpool_ext.policy",
    "deadpool_ext.inject",
    "deadpool_ext.sockets",
    "deadpool_ext.wire",
    "deadpool_ext.events",
    "deadpool_ext.lifetime",
    "deadpool_ext.config",
    "deadpool_ext.state.digest",
    "deadpool_ext.state.snapshot",
    "deadpool_ext.state.replay",
    "deadpool_ext.state.mirror",
    "deadpool_ext.state.reshard",
    "deadpool_ext.control.gpu_health",
    "deadpool_ext.control.slurm_state",
    "deadpool_ext.control.membership",
    "deadpool_ext.control.record",
    "deadpool_ext.control.awake_clock",
    "deadpool_ext.control.detector",
    "deadpool_ext.control.status",
    "deadpool_ext.control.operations",
    "deadpool_ext.control.standby",
    "deadpool_ext.control.metrics",
    "deadpool_ext.control.zygote",
    "deadpool_ext.control.agent",
    "deadpool_ext.control.command_line",
    "deadpool_ext.control.ports",
    "deadpool_ext.control.process_tree",
    "deadpool_ext.control.jobs",
    "deadpool_ext.control.coordinator",
    "deadpool_ext.control.run_loop",
    "deadpool_ext.control.launch",
    "deadpool_ext.control.ctl",
    "deadpool_ext.rank.whereabouts",
    "deadpool_ext.rank.regroup",
    "deadpool_ext.rank.generation",
    "deadpool_ext.rank.errors",
    "deadpool_ext.rank.client",
    "deadpool_ext.rank.restore",
    "deadpool_ext.rank.sample_rng",
    "deadpool_ext.rank.sdc",
    "deadpool_ext.rank.flips",
    "deadpool_ext.rank.hooks",
    "deadpool_ext.rank.rebuild",
    "deadpool_ext.rank.recovery",
    "deadpool_ext.rank.main",
    "deadpool_ext.entry",
    "deadpool_ext.launch",
    "deadpool_ext.ctl",
    "tools",
]


def place(module: str, order: List[str]) -> Optional[int]:
    """Where ``module`` stands in ``order`` (its longest listed prefix)."""
    for name in [module] + parents(module):
        if name in order:
            return order.index(name)
    return None


def downward_imports(order: List[str], root: str, packages: List[str]) -> List[str]:
    """'a -> b' for each import of a module listed below the importer, and
    'a unlisted' for a module the order does not place that imports any
    (a bare package's __init__ imports nothing)."""
    found = []
    for module, deps in sorted(import_graph(root, packages).items()):
        here = place(module, order)
        if here is None:
            found += [f"{module} unlisted"] if deps else []
            continue
        found += [f"{module} -> {dep}" for dep in sorted(deps) if place(dep, order) > here]
    return found


def test_every_import_points_up_the_architecture_list():
    found = downward_imports(ORDER, REPO, PACKAGES)
    assert not found, "imports against docs/architecture.md's order:\n" + "\n".join(found)


def test_an_import_of_a_module_listed_below_is_found(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "from pkg import high\n",
            "pkg/high.py": "",
            "pkg/stray.py": "from pkg import low\n",
        },
    )
    order = ["pkg.low", "pkg.high"]
    found = downward_imports(order, str(tmp_path), ["pkg"])
    assert found == ["pkg.low -> pkg.high", "pkg.stray unlisted"]


# Who may not import whom, directly or through anything of the repository
# (docs/architecture.md): (importer, what it never reaches, why).
FORBIDDEN = [
    (
        "deadpool_ext.control",
        ["deadpool_ext.rank", "deadpool_ext.state"],
        "the launcher side holds no tensors and joins no collective",
    ),
    ("deadpool_ext.state", ["deadpool_ext.rank"], "the data plane sits below the worker's story"),
    ("megatron.training", ["deadpool_ext"], "the trainer runs without deadpool"),
    ("deadpool_ext", ["tools"], "tools/ is not installed"),
    ("megatron.training", ["tools"], "tools/ is not installed"),
]


def forbidden_reaches(rules, root: str, packages: List[str]) -> List[str]:
    modules = find_modules(root, packages)
    graph = import_graph(root, packages)
    found = []
    for importer, never, why in rules:
        for module in expand([importer], modules):
            for reached in sorted(reachable(module, graph, modules)):
                if any(reached == n or reached.startswith(n + ".") for n in never):
                    chain = shortest_path(graph, module, reached) or [module, reached]
                    found.append(f"{show(chain)} ({why})")
    return found


def test_no_layer_imports_one_it_must_not_reach():
    found = forbidden_reaches(FORBIDDEN, REPO, PACKAGES)
    assert not found, "imports across a forbidden line:\n" + "\n".join(found)


def test_a_forbidden_reach_through_another_module_is_found(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/top/__init__.py": "",
            "pkg/top/a.py": "from pkg import helper\n",
            "pkg/helper.py": "def f():\n    from pkg.low import b\n",
            "pkg/low/__init__.py": "",
            "pkg/low/b.py": "",
        },
    )
    found = forbidden_reaches([("pkg.top", ["pkg.low"], "a reason")], str(tmp_path), ["pkg"])
    assert "pkg.top.a -> pkg.helper -> pkg.low.b (a reason)" in found
    assert forbidden_reaches([("pkg.low", ["pkg.top"], "up")], str(tmp_path), ["pkg"]) == []


# A process ends only in a ``main`` (or under ``if __name__ == "__main__"``):
# everything else raises a typed error or returns a code. Two functions are
# mains by contract, though not by name; wire.leave is how mains exit (its
# calls are checked as exits).
PROCESS_MAINS = {
    ("deadpool_ext.wire", "leave"): "the exit of a main that holds a store client",
    ("deadpool_ext.rank.main", "run"): "a rank's main: pretrain_gpt.py's main hands it "
    "the process through run_training",
    ("megatron.training.megatron_lm", "pretrain"): "Megatron-LM's scripts' main: it ends "
    "the process as Megatron-LM's does (bad flags: exit code 2)",
}
EXITS = {"SystemExit", "sys.exit", "os._exit", "exit", "quit", "leave"}


def dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        return dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


def exits_outside_main(module: str, tree: ast.AST, mains=PROCESS_MAINS) -> List[str]:
    """``module:line function`` for each exit (``raise SystemExit``,
    ``sys.exit``, ``os._exit``, ``wire.leave``) outside a main."""
    found = []

    def visit(node: ast.AST, function: Optional[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if is_main_guard(node) or function == "main" or (module, function) in mains:
            return
        is_exit = (isinstance(node, ast.Raise) and node.exc is not None) or isinstance(
            node, ast.Call
        )
        name = dotted(node.exc if isinstance(node, ast.Raise) else node) if is_exit else ""
        if name in EXITS or name.endswith(".leave"):
            found.append(f"{module}:{node.lineno} {function or '<module>'}: {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_processes_end_only_in_main():
    """A helper that ends the process skips its caller's cleanup and its
    typed exit code (a configuration error is a usage exit, 2)."""
    modules = find_modules(REPO, ["deadpool_ext", "megatron.training"])
    modules["pretrain_gpt"] = os.path.join(REPO, "pretrain_gpt.py")
    found = [f for m, path in sorted(modules.items()) for f in exits_outside_main(m, parse(path))]
    assert not found, "exits outside a main:\n" + "\n".join(found)
    for module, function in PROCESS_MAINS:
        tree = parse(modules[module])
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{module}.{function} is gone: drop it from PROCESS_MAINS"


@pytest.mark.parametrize(
    "source",
    [
        "def check():\n    raise SystemExit('bad flag')\n",
        "import sys\ndef helper():\n    sys.exit(2)\n",
        "import os\nclass A:\n    def stop(self):\n        os._exit(1)\n",
        "from deadpool_ext import wire\ndef f():\n    wire.leave(1)\n",
        "def f():\n    def main():\n        pass\n    raise SystemExit(1)\n",
    ],
)
def test_an_exit_outside_main_is_found(source):
    assert exits_outside_main("pkg.m", ast.parse(source))


def test_exits_in_main_and_under_the_main_guard_are_allowed():
    source = "import sys\ndef main():\n    raise SystemExit(2)\n"
    source += "if __name__ == '__main__':\n    sys.exit(main())\n"
    assert exits_outside_main("pkg.m", ast.parse(source)) == []
    assert exits_outside_main("pkg.m", ast.parse("def run():\n    exit(1)\n")) != []
    assert (
        exits_outside_main("pkg.m", ast.parse("def run():\n    exit(1)\n"), {("pkg.m", "run"): ""})
        == []
    )


def module_file(name: str, path: List[str]) -> Optional[str]:
    """Where ``name`` would be imported from, found without importing it."""
    relative = name.replace(".", os.sep)
    for root in path:
        for candidate in (relative + ".py", os.path.join(relative, "__init__.py")):
            if os.path.isfile(os.path.join(root, candidate)):
                return os.path.join(root, candidate)
    return None


def test_the_zygotes_preload_names_modules_that_exist():
    """The zygote skips a name it cannot import in silence (a worker then
    reports its own import error): after a rename every spare would import
    the module again after a failure. Its one name of ours crosses the
    control -> rank line as a string, as docs/architecture.md says."""
    tree = parse(os.path.join(REPO, "deadpool_ext", "control", "zygote.py"))
    preload = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and dotted(node.targets[0]) == "PRELOAD"
    )
    path = [REPO] + [p for p in sys.path if p and os.path.isdir(p)]
    assert [name for name in preload if module_file(name, path) is None] == []
    assert [name for name in preload if name.startswith("deadpool_ext")] == [
        "deadpool_ext.rank.main"
    ]
    assert module_file("deadpool_ext.rank.no_such_module", path) is None  # the control


# ----- negative controls: the checks catch what they claim to -----
def write_package(root, files: Dict[str, str]) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


def test_a_cycle_is_found_and_shown():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_a_function_level_relative_import_is_found(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/a.py": "from pkg.sub import b\n",
            "pkg/sub/b.py": "def later():\n    from .. import a\n    return a\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    cycles = find_cycles(import_graph(str(tmp_path), ["pkg"]))
    assert cycles == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_an_import_only_for_type_checking_is_no_dependency(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg import b\nelse:\n    import json\n",
            "pkg/b.py": "from pkg import a\n",
        },
    )
    assert find_cycles(import_graph(str(tmp_path), ["pkg"])) == []


@pytest.mark.parametrize(
    "statement",
    [
        "import torch.distributed",
        "import torch.distributed as dist",
        "from torch import distributed",
        "from torch import nn, distributed as dist",
        "from torch.distributed import ProcessGroup",
        "from torch.distributed.checkpoint import save",
        "import torch\nworld = torch.distributed.get_world_size",
    ],
)
def test_every_form_of_importing_torch_distributed_is_seen(tmp_path, statement):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/pure.py": "from pkg.helpers import helper\n",
            "pkg/helpers.py": "def helper():\n" + textwrap.indent(statement, "    ") + "\n",
        },
    )
    chains = impure(["pkg.pure"], str(tmp_path), ["pkg"])
    assert len(chains) == 1 and chains[0].startswith("pkg.pure -> pkg.helpers (line "), chains


def test_other_torch_imports_are_pure(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/pure.py": "import torch\nimport torch.nn\nfrom torch import nn\n"
            "from pkg import distributed\n",
            "pkg/distributed.py": "",
        },
    )
    assert impure(["pkg"], str(tmp_path), ["pkg"]) == []


def test_a_parent_package_that_imports_distributed_makes_its_modules_impure(tmp_path):
    write_package(tmp_path, {"pkg/__init__.py": "import torch.distributed\n", "pkg/pure.py": ""})
    chains = impure(["pkg.pure"], str(tmp_path), ["pkg"])
    assert [c.split(" (")[0] for c in chains] == ["pkg.pure -> pkg"]


def test_a_listed_module_that_does_not_exist_fails(tmp_path):
    write_package(tmp_path, {"pkg/__init__.py": "", "pkg/pure.py": ""})
    with pytest.raises(AssertionError, match="pkg.gone"):
        impure(["pkg.pure", "pkg.gone"], str(tmp_path), ["pkg"])


def test_a_package_stands_for_all_its_modules(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/planning/__init__.py": "",
            "pkg/planning/deep/__init__.py": "",
            "pkg/planning/deep/rule.py": "import torch.distributed as dist\n",
            "pkg/planning_notes.py": "import torch.distributed\n",  # a prefix, not a child
        },
    )
    chains = impure(["pkg.planning"], str(tmp_path), ["pkg"])
    assert [c.split(" (")[0] for c in chains] == ["pkg.planning.deep.rule"]


# ----- the unit/integration split (conftest.py) -----
class FakeItem:
    nodeid = "probe"

    def __init__(self, integration: bool):
        self.integration = integration

    def get_closest_marker(self, name):
        if name == "integration" and self.integration:
            return pytest.mark.integration.mark
        return None


def test_an_unmarked_test_cannot_start_a_process():
    def start_process():
        multiprocessing.get_context("fork").Process(target=print).start()

    with processes_forbidden_unless_integration(FakeItem(integration=False)):
        for start in (
            lambda: subprocess.run(["true"]),
            os.fork,
            start_process,
            lambda: os.system("true"),
        ):
            with pytest.raises(ProcessInUnitTest, match="probe started a process"):
                start()


def test_an_integration_test_starts_processes_unhindered():
    before = subprocess.Popen._execute_child
    with processes_forbidden_unless_integration(FakeItem(integration=True)):
        assert subprocess.Popen._execute_child is before


# ----- where tests live (as Megatron-LM's): in-process ones in tests/unit_tests,
# those that start processes in tests/functional_tests -----
def marks_every_test_integration(tree: ast.Module) -> bool:
    """A module-level ``pytestmark`` that is, or lists, ``pytest.mark.integration``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            return any(ast.unparse(m) == "pytest.mark.integration" for m in marks)
    return False


def integration_marks(tree: ast.Module) -> int:
    """How many times the module uses the mark ``pytest.mark.integration``
    (as a decorator, a ``pytestmark``, a parameter's mark), not counting
    what is read off it (``pytest.mark.integration.mark``) or strings."""
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return sum(
        1
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and id(n) not in inner
        and ast.unparse(n) == "pytest.mark.integration"
    )


def modules_under(root: str) -> List[str]:
    """The test modules under ``root``, its subfolders' too (the unit tests
    are laid out by subpackage)."""
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if name.startswith("test_") and name.endswith(".py")
    )


def misplaced_tests(tests_dir: str) -> List[str]:
    """Test files in the wrong folder: a unit test file that marks anything
    integration, or a functional one whose tests are not all integration."""
    wrong = []
    for folder, functional in (("unit_tests", False), ("functional_tests", True)):
        for path in modules_under(os.path.join(tests_dir, folder)):
            tree = parse(path)
            placed = (
                marks_every_test_integration(tree) if functional else not integration_marks(tree)
            )
            if not placed:
                wrong.append(os.path.relpath(path, tests_dir))
    return wrong


def test_process_starting_tests_are_functional_tests_and_the_rest_unit_tests():
    assert misplaced_tests(os.path.join(REPO, "tests")) == []


def test_the_layout_check_sees_a_misplaced_test(tmp_path):
    for folder in ("unit_tests", "functional_tests"):
        (tmp_path / folder).mkdir()
    marked = "import pytest\n\npytestmark = pytest.mark.integration\n\n\ndef test_a():\n    pass\n"
    one_marked = "import pytest\n\n\n@pytest.mark.integration\ndef test_a():\n    pass\n"
    (tmp_path / "functional_tests" / "test_ok.py").write_text(marked)
    (tmp_path / "functional_tests" / "test_unmarked.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "unit_tests" / "test_ok.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "unit_tests" / "test_marked.py").write_text(marked)
    (tmp_path / "unit_tests" / "test_one_marked.py").write_text(one_marked)
    (tmp_path / "unit_tests" / "policy").mkdir()
    (tmp_path / "unit_tests" / "policy" / "test_marked.py").write_text(marked)
    assert misplaced_tests(str(tmp_path)) == [
        "unit_tests/policy/test_marked.py",
        "unit_tests/test_marked.py",
        "unit_tests/test_one_marked.py",
        "functional_tests/test_unmarked.py",
    ]


# ----- where process groups are made -----
# A generation owns every group (rank.generation); megatron-core's parallel
# state is made by the trainer's initialize (and, through it, by a generation).
GROUP_MAKERS = {"deadpool_ext.rank.generation", "megatron.training.initialize"}
GROUP_CALLS = {"new_group", "init_process_group", "new_subgroups", "new_subgroups_by_enumeration"}


def group_calls(path: str) -> List[int]:
    """Lines that call torch.distributed's group constructors (``dist.new_group``,
    ``torch.distributed.init_process_group``, ...)."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in GROUP_CALLS:
                found.append(node.lineno)
    return found


def group_makers(root: str, packages: List[str]) -> Dict[str, List[int]]:
    modules = find_modules(root, packages)
    return {m: lines for m, p in sorted(modules.items()) if (lines := group_calls(p))}


def test_only_a_generation_and_the_trainers_initialize_make_process_groups():
    makers = group_makers(REPO, ["deadpool_ext", "megatron.training"])
    assert set(makers) <= GROUP_MAKERS, makers
    assert "deadpool_ext.rank.generation" in makers


def test_the_group_check_sees_a_group_made_elsewhere(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import torch.distributed as dist\ng = dist.new_group([0, 1])\n",
            "pkg/b.py": "from torch.distributed import new_group\nnew_group([0])\n",
            "pkg/c.py": "x = 1\n",
        },
    )
    assert group_makers(str(tmp_path), ["pkg"]) == {"pkg.a": [2], "pkg.b": [2]}


# ----- the megatron namespace -----


def test_megatron_is_a_namespace_of_the_wheel_and_the_repo():
    import megatron
    import megatron.core
    import megatron.training

    site = {
        os.path.realpath(p)
        for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
    }
    core = os.path.realpath(megatron.core.__file__)
    assert "site-packages" in core.split(os.sep)
    assert any(core.startswith(s + os.sep) for s in site), core
    # Not our tree (a venv inside the checkout is fine: that is site-packages).
    assert not core.startswith(os.path.realpath(os.path.join(REPO, "megatron")) + os.sep)
    training = os.path.realpath(megatron.training.__file__)
    ours = os.path.realpath(os.path.join(REPO, "megatron", "training"))
    assert training.startswith(ours + os.sep)
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))
    assert not os.path.exists(os.path.join(REPO, "megatron", "core"))
    assert getattr(megatron, "__file__", None) is None  # a namespace package
    paths = {os.path.realpath(p) for p in megatron.__path__}
    assert os.path.realpath(os.path.join(REPO, "megatron")) in paths
