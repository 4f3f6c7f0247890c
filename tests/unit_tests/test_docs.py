"""The docs that follow the code, each held to it:

* the list of files is what ``tools.architecture_files`` renders from the
  modules' docstrings;
* the table of patches names every attribute of another package's module
  or class that our code replaces (found with ``ast``: an assignment to it,
  or a ``setattr`` on it), no more, each with the version it was checked
  against, which must be the one the repository pins;
* the list of parts names the modules of ``ORDER``
  (test_architecture.py), in its order;
* README.md and docs/ name no commit, date, issue or stop: a figure says
  how and where it was measured, and against which code in words.

Each has a negative control that feeds it a small tree, source or table and
asserts that the difference is caught.
"""

import ast
import os
import re
from typing import Dict, List, Optional, Set, Tuple

import pytest

from tests.unit_tests.test_architecture import ORDER, REPO, find_modules, write_package
from tools import architecture_files

ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


# ----- the list of files -----
def test_the_files_are_what_the_tool_renders():
    diff = architecture_files.differences(REPO)
    assert not diff, (
        "docs/architecture.md's files differ from the docstrings; run "
        "python -m tools.architecture_files:\n" + "\n".join(diff)
    )


def small_repository(root) -> None:
    write_package(
        root,
        {
            "pretrain_gpt.py": '"""Pretrain GPT."""\n',
            "megatron/training/__init__.py": '"""The trainer."""\n',
            "deadpool_ext/__init__.py": '"""DeadPool.\n\nMore on it."""\n',
            "deadpool_ext/wire.py": '"""The wire: signed\nmessages. And more."""\n',
            "docs/architecture.md": f"# A\n\n{architecture_files.BEGIN}\n"
            f"{architecture_files.END}\n\nThe rest.\n",
        },
    )
    architecture_files.rewrite(str(root))


def test_the_files_list_takes_each_modules_first_sentence(tmp_path):
    small_repository(tmp_path)
    text = read(tmp_path / "docs" / "architecture.md")
    assert "- `wire.py`: The wire: signed messages.\n" in text
    assert "### `deadpool_ext/`\n\nDeadPool.\n" in text
    assert text.endswith(f"{architecture_files.END}\n\nThe rest.\n")
    assert architecture_files.differences(str(tmp_path)) == []


def test_a_module_added_or_described_anew_is_caught(tmp_path):
    small_repository(tmp_path)
    (tmp_path / "deadpool_ext" / "events.py").write_text('"""The event log."""\n')
    (tmp_path / "deadpool_ext" / "wire.py").write_text('"""The channel."""\n')
    changed = architecture_files.differences(str(tmp_path))
    assert "+- `events.py`: The event log." in changed
    assert "-- `wire.py`: The wire: signed messages." in changed
    assert "+- `wire.py`: The channel." in changed


def test_a_module_without_a_docstring_or_a_page_without_markers_is_refused(tmp_path):
    small_repository(tmp_path)
    (tmp_path / "deadpool_ext" / "bare.py").write_text("x = 1\n")
    with pytest.raises(architecture_files.DocstringMissing, match="bare.py"):
        architecture_files.differences(str(tmp_path))
    (tmp_path / "deadpool_ext" / "bare.py").unlink()
    (tmp_path / "docs" / "architecture.md").write_text("# A\n")
    with pytest.raises(architecture_files.MarkersMissing):
        architecture_files.differences(str(tmp_path))


# ----- the patches we carry -----
# Packages of this repository: replacing their attributes is no patch.
OURS = ("deadpool_ext", "megatron.training", "tools", "tests", "pretrain_gpt")
PATCHED_PACKAGES = ["deadpool_ext", "megatron.training"]
Patch = Tuple[str, str]  # (what is replaced, "file:function")


def is_ours(name: str) -> bool:
    return name.startswith(".") or any(name == p or name.startswith(p + ".") for p in OURS)


class PatchFinder(ast.NodeVisitor):
    """Assignments to an attribute of an imported module or class, and
    ``setattr`` calls on one, read in source order: the names a scope
    binds by ``import`` (or as a plain alias, ``cuda = torch.cuda``) resolve
    the target to its dotted name."""

    def __init__(self, path: str):
        self.path, self.scopes, self.where = path, [{}], []
        self.found: Set[Patch] = set()

    def resolve(self, node: ast.expr) -> Optional[str]:
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
        return None

    def bind(self, name: str, value: Optional[str]) -> None:
        self.scopes[-1][name] = value

    def note(self, base: Optional[str], attribute: str) -> None:
        if base and not is_ours(base):
            where = ".".join(self.where) or "<module>"
            self.found.add((f"{base}.{attribute}", f"{self.path}:{where}"))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.bind(alias.asname, alias.name)
            else:
                top = alias.name.split(".")[0]
                self.bind(top, top)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = "." * node.level + (node.module or "")
        for alias in node.names:
            self.bind(alias.asname or alias.name, f"{base}.{alias.name}")

    def visit_FunctionDef(self, node) -> None:
        arguments = getattr(node, "args", None)  # a class has none
        names = [a.arg for a in ast.walk(arguments) if isinstance(a, ast.arg)] if arguments else []
        self.scopes.append(dict.fromkeys(names))  # a parameter hides an import of its name
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self.assigned(target)
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self.bind(node.targets[0].id, self.resolve(node.value))

    def visit_AugAssign(self, node) -> None:
        self.generic_visit(node)
        self.assigned(node.target)

    visit_AnnAssign = visit_AugAssign

    def assigned(self, target: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.assigned(element)
        elif isinstance(target, ast.Attribute):
            self.note(self.resolve(target.value), target.attr)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "setattr" and len(node.args) > 1:
            name = node.args[1]
            literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
            self.note(self.resolve(node.args[0]), name.value if literal else "*")


def patches_in(source: str, path: str) -> Set[Patch]:
    finder = PatchFinder(path)
    finder.visit(ast.parse(source, path))
    return finder.found


def patches_of(root: str, packages: List[str]) -> Set[Patch]:
    found = set()
    for path in find_modules(root, packages).values():
        found |= patches_in(read(path), os.path.relpath(path, root))
    return found


TABLE_HEADER = "| what is replaced | why | where | checked against |"


def patch_table(text: str) -> Dict[Patch, str]:
    """(what, where) -> the version it was checked against, for every name
    in each row's first cell."""
    lines = text.split("\n")
    assert TABLE_HEADER in lines, f"docs/architecture.md has no table {TABLE_HEADER!r}"
    rows = {}
    for line in lines[lines.index(TABLE_HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        what, _, where, version = [cell.strip() for cell in line.strip("|").split(" | ")]
        for name in re.findall(r"`([^`]+)`", what):
            rows[(name, where.strip("`"))] = version
    return rows


def table_against_code(table: Dict[Patch, str], found: Set[Patch]) -> List[str]:
    missing = [f"not in the table: {w} replaces {n}" for n, w in sorted(found - set(table))]
    gone = [f"in the table, not in the code: {w} {n}" for n, w in sorted(set(table) - found)]
    return missing + gone


def pins(root: str) -> Dict[str, str]:
    """The versions the repository pins: what each row's version must be."""
    torch = re.search(r"^TORCH \?= torch==(\S+)$", read(os.path.join(root, "Makefile")), re.M)
    core = re.search(r'"megatron-core>=([0-9.]+)', read(os.path.join(root, "setup.py")))
    python = re.search(r'target-version = "py3(\d+)"', read(os.path.join(root, "pyproject.toml")))
    return {
        "torch": f"torch {torch.group(1)}",
        "megatron": f"megatron-core {core.group(1)}",
        "standard library": f"Python 3.{python.group(1)}",
    }


def unpinned_versions(table: Dict[Patch, str], pinned: Dict[str, str]) -> List[str]:
    found = []
    for (name, where), version in sorted(table.items()):
        owner = name.split(".")[0]
        expected = pinned.get(owner, pinned["standard library"])
        if version != expected:
            found.append(f"{name} ({where}): checked against {version!r}; pinned: {expected!r}")
    return found


def test_every_patch_we_carry_is_in_the_table():
    table = patch_table(read(ARCHITECTURE))
    wrong = table_against_code(table, patches_of(REPO, PATCHED_PACKAGES))
    assert not wrong, "docs/architecture.md's patches against the code:\n" + "\n".join(wrong)


def test_every_patch_was_checked_against_the_pinned_version():
    wrong = unpinned_versions(patch_table(read(ARCHITECTURE)), pins(REPO))
    assert not wrong, "recheck these patches against the pinned version:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch.distributed as dist\ndist.new_group = f\n", "torch.distributed.new_group"),
        ("import torch\ndef f():\n    torch.Tensor.to = g\n", "torch.Tensor.to"),
        ("import torch\ndef f():\n    cuda = torch.cuda\n    cuda.sync = g\n", "torch.cuda.sync"),
        ("from megatron.core import parallel_state as ps\nsetattr(ps, n, None)\n", "*"),
        ("import torch\nfor n in N:\n    setattr(torch, n, g)\n", "torch.*"),
        ("from megatron.core.x import C\nclass D:\n    def f(self):\n        C.m = g\n", "C.m"),
        ("import sys\nsys.argv, x = [], 1\n", "sys.argv"),
    ],
)
def test_a_replaced_attribute_of_another_package_is_found(source, expected):
    found = patches_in(source, "pkg/m.py")
    assert len(found) == 1 and next(iter(found))[0].endswith(expected), found


@pytest.mark.parametrize(
    "source",
    [
        "from deadpool_ext import wire\nwire.x = 1\n",  # our own module
        "from . import hooks\nhooks.y = 2\n",  # ours, relative
        "import torch\ndef f(model):\n    model.x = 1\n",  # an object, not a module or class
        "import torch\ndef f(torch):\n    torch.x = 1\n",  # a parameter, not the import
        "import torch\ndef f():\n    cuda = make()\n    cuda.x = 1\n",  # rebound: no longer torch's
        "import torch\nx = torch.zeros(1)\n",  # a call, not a replacement
    ],
)
def test_what_is_no_patch_is_not_found(source):
    assert patches_in(source, "pkg/m.py") == set()


def test_the_where_names_the_file_and_the_function(tmp_path):
    write_package(
        tmp_path,
        {"pkg/a.py": "import torch\nclass A:\n    def patch(self):\n        torch.x = 1\n"},
    )
    assert patches_of(str(tmp_path), ["pkg"]) == {("torch.x", "pkg/a.py:A.patch")}


def test_a_patch_left_out_of_the_table_or_one_gone_is_caught():
    row = "| `torch.a`, `torch.b` | why | `m.py:f` | torch 1 |"
    text = f"{TABLE_HEADER}\n|---|---|---|---|\n{row}\n\nMore.\n"
    table = patch_table(text)
    assert table_against_code(table, {("torch.a", "m.py:f"), ("torch.b", "m.py:f")}) == []
    assert table_against_code(table, {("torch.a", "m.py:f"), ("torch.c", "m.py:g")}) == [
        "not in the table: m.py:g replaces torch.c",
        "in the table, not in the code: m.py:f torch.b",
    ]


def test_a_version_other_than_the_pinned_one_is_caught():
    pinned = {"torch": "torch 2", "megatron": "megatron-core 1", "standard library": "Python 3.9"}
    table = {("torch.a", "m:f"): "torch 2", ("sys.argv", "m:g"): "Python 3.9"}
    assert unpinned_versions(table, pinned) == []
    table[("megatron.core.x", "m:h")] = "megatron-core 0"
    assert unpinned_versions(table, pinned) == [
        "megatron.core.x (m:h): checked against 'megatron-core 0'; pinned: 'megatron-core 1'"
    ]


# ----- the list of parts mirrors ORDER -----
PARTS_HEADING = "## The parts and their arrows"


def listed_parts(text: str) -> List[str]:
    """The first word of each unindented line of the section's code block."""
    section = text.split(PARTS_HEADING, 1)[1]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in block.split("\n")[1:] if line and line[0] != " "]


def part_path(name: str, root: str) -> str:
    """How the list writes an ``ORDER`` entry: a path under deadpool_ext/
    (or the repository, for another package); a package ends with '/'."""
    path = name.replace(".", "/")
    shown = path.removeprefix("deadpool_ext/")
    return f"{shown}/" if os.path.isdir(os.path.join(root, path)) else f"{shown}.py"


def test_the_parts_are_listed_in_the_import_order():
    assert listed_parts(read(ARCHITECTURE)) == [part_path(n, REPO) for n in ORDER]


def test_a_part_out_of_order_is_caught(tmp_path):
    write_package(tmp_path, {"deadpool_ext/control/__init__.py": "", "deadpool_ext/wire.py": ""})
    expected = [part_path(n, str(tmp_path)) for n in ["deadpool_ext.wire", "deadpool_ext.control"]]
    listed = "```\nwire.py   the wire\n          more on it\ncontrol/  the launcher\n```\n"
    assert listed_parts(f"{PARTS_HEADING}\n\n{listed}") == expected == ["wire.py", "control/"]
    swapped = "```\ncontrol/  the launcher\nwire.py   the wire\n```\n"
    assert listed_parts(f"{PARTS_HEADING}\n\n{swapped}") != expected


# ----- the user docs say what is, not how it came to be -----
HISTORY = {
    "a commit": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
    "a date": r"\b20\d\d-\d\d-\d\d\b(?! \d\d:)",  # a log line's timestamp is its format
    "an issue or stop number": r"(?i)\b(?:issue|stop)s? \d+",
}


def history(text: str) -> List[str]:
    found = []
    for number, line in enumerate(text.split("\n"), 1):
        found += [f"line {number}: {what}" for what, p in HISTORY.items() if re.search(p, line)]
    return found


def test_the_user_docs_narrate_no_history():
    pages = ["README.md"] + [f"docs/{n}" for n in sorted(os.listdir(os.path.join(REPO, "docs")))]
    found = [
        f"{page} {said}"
        for page in pages
        if page.endswith(".md")
        for said in history(read(os.path.join(REPO, page)))
    ]
    assert not found, "say what is measured and how, not when or at which commit:\n" + "\n".join(
        found
    )


def test_history_in_a_page_is_found():
    text = (
        "Measured 2026-11-22 at 3be0efc.\n(issue 21)\nAt stop 42.\n"
        "[2026-11-22 08:05:16.5] iteration 30 | a log line\nseed 1234, 0.5 s, deadbeef\n"
    )
    assert history(text) == [
        "line 1: a commit",
        "line 1: a date",
        "line 2: an issue or stop number",
        "line 3: an issue or stop number",
    ]
