"""The coordinator stays a shell of I/O around the job's record: it calls no
rule of policy/ itself (every decision is made there, through the ordered
triggers and ``Policy.decide``), and it stays small. Read from the source
with ``ast``; a negative control feeds the check a shell that decides."""

import ast
import importlib
import inspect
import os
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHELL = os.path.join(REPO, "deadpool_ext", "control", "coordinator.py")
# What the shell may run of policy/: the ordered triggers, the decision of a
# generation that collected its reports, and what the job's end says. It
# builds effects and views (classes) freely.
ENTRY_POINTS = {"TRIGGERS", "Policy", "at_end"}
MOST_LINES, MOST_ATTRIBUTES = 450, 15


def imported_from_policy(tree: ast.AST) -> Dict[str, Tuple[str, str]]:
    """Local name -> (module, name) of everything taken from policy/."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "deadpool_ext.policy"
        ):
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def resolved(module: str, name: str):
    base = importlib.import_module(module)
    return getattr(base, name, None) or importlib.import_module(f"{module}.{name}")


def rules_called(source: str) -> List[str]:
    """The functions of policy/ the shell calls that are not entry points."""
    tree = ast.parse(source)
    names = imported_from_policy(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, target = node.func, None
        if isinstance(func, ast.Name) and func.id in names:
            target, label = resolved(*names[func.id]), func.id
        elif isinstance(func, ast.Attribute) and getattr(func.value, "id", None) in names:
            module = resolved(*names[func.value.id])
            target, label = getattr(module, func.attr, None), f"{func.value.id}.{func.attr}"
        if target is None or inspect.isclass(target) or inspect.ismodule(target):
            continue
        if label.split(".")[-1] not in ENTRY_POINTS:
            found.append(f"line {node.lineno}: {label}")
    return found


def attributes(source: str) -> List[str]:
    """Every ``self.X`` the shell's class assigns."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    assigned = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [node.target] if isinstance(node, ast.AnnAssign) else targets
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                    assigned.add(t.attr)
    return sorted(assigned)


def test_the_coordinator_calls_no_rule_of_its_own():
    with open(SHELL) as f:
        assert rules_called(f.read()) == []


def test_a_shell_that_decides_itself_is_caught():
    source = (
        "from deadpool_ext.policy.decide import waits_for_spares, Policy\n"
        "from deadpool_ext.policy import triggers\n"
        "class Shell:\n"
        "    def step(self, view):\n"
        "        Policy().decide(view)\n"
        "        triggers.lost_ranks(view)\n"
        "        return waits_for_spares(1, 0, 1, 0.0, 5.0)\n"
    )
    assert rules_called(source) == ["line 6: triggers.lost_ranks", "line 7: waits_for_spares"]


def test_the_coordinator_stays_small():
    """It grew back to 1,054 lines and 46 attributes once, as features
    landed in it: a feature adds a rule to policy/ instead."""
    with open(SHELL) as f:
        source = f.read()
    assert len(source.splitlines()) < MOST_LINES
    assert len(attributes(source)) < MOST_ATTRIBUTES, attributes(source)
