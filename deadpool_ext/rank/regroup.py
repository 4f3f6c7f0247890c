"""Re-point every process group that training objects hold to a new generation.

About sixty references per rank (DDP, its buffers and bucket groups, the
distributed optimizer, the model's pg_collection and layers, the mirror)
point at process groups. Rather than list them, ``swap_groups`` walks the
objects and replaces groups by identity, which also covers layers this
module has never heard of. Groups are named by their *role*: the
``parallel_state`` global that holds them, ``WORLD``, or a role the caller
adds (the mirror's pair groups).

A rebuild has two halves because the new groups can only be created once
every old one is gone (gloo closes a group's sockets only when its last
Python reference dies, and peers blocked on us are released only then):

    slots = detach(roots)       # groups -> GroupSlot(role), old groups destroyed
    ... every rank creates the new generation ...
    attach(roots, slots)        # GroupSlot(role) -> the new group of that role

The same pair moves a warm spare's model, built against a fake world, onto
the real one.
"""

import gc
import time
import types
import weakref
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

ProcessGroup = dist.ProcessGroup


class RegroupError(RuntimeError):
    """A group could not be re-pointed or an old group stayed alive."""


@dataclass(frozen=True, eq=False)
class GroupSlot:
    """Stands where a group was while the groups are being rebuilt."""

    role: str


class SetAside:
    """Groups out of torch's registry between two generations
    (``set_aside``), with what registering them again needs. The walk
    never enters it: these groups must survive the swap."""

    def __init__(self, entries: List[dict]):
        self.entries = entries


# Values that never hold a process group (or hold only set-aside ones): not
# worth walking into.
_LEAVES = (
    SetAside,
    torch.Tensor,
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    type(None),
    type,
    types.ModuleType,
    torch.dtype,
    torch.device,
    torch.Size,
    weakref.ref,
    types.BuiltinFunctionType,
)


def groups_by_role(extra: Optional[Dict[str, object]] = None) -> Dict[str, ProcessGroup]:
    """Every group megatron's parallel_state holds, by global name, plus the
    default group and the caller's own."""
    roles: Dict[str, ProcessGroup] = {}
    for name, value in vars(parallel_state).items():
        if isinstance(value, ProcessGroup):
            roles[name] = value
        elif isinstance(value, (list, tuple)):
            roles.update(
                {f"{name}[{i}]": v for i, v in enumerate(value) if isinstance(v, ProcessGroup)}
            )
        elif isinstance(value, dict):
            roles.update(
                {f"{name}[{k!r}]": v for k, v in value.items() if isinstance(v, ProcessGroup)}
            )
    if dist.is_initialized():
        roles["WORLD"] = dist.group.WORLD
    roles.update(extra or {})
    return roles


def _key(key) -> str:
    """A dict key for error paths (repr of a tensor key would be slow)."""
    return repr(key) if isinstance(key, (str, int)) else type(key).__name__


class _Swapper:
    """One walk over an object graph, replacing values found in ``mapping``
    (keyed by id) wherever they can be replaced."""

    def __init__(self, mapping: Dict[int, object], kinds: tuple):
        self.mapping, self.kinds = mapping, kinds
        self.seen = set()
        self.count = 0
        self.unknown: List[str] = []
        self.stuck: List[str] = []

    def visit(self, value, path: str):
        """Returns the replacement for ``value`` (itself if unchanged)."""
        if isinstance(value, self.kinds):
            if id(value) in self.mapping:
                self.count += 1
                return self.mapping[id(value)]
            self.unknown.append(path)
            return value
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            self._visit_graph(value.grad_fn, f"{path}.grad_fn")
        if isinstance(value, _LEAVES) or id(value) in self.seen:
            return value
        self.seen.add(id(value))
        if isinstance(value, dict):
            for key, item in list(value.items()):
                new = self.visit(item, f"{path}[{_key(key)}]")
                if new is not item:
                    value[key] = new
        elif isinstance(value, list):
            for i, item in enumerate(value):
                new = self.visit(item, f"{path}[{i}]")
                if new is not item:
                    value[i] = new
        elif isinstance(value, tuple):
            items = [self.visit(item, f"{path}[{i}]") for i, item in enumerate(value)]
            if any(a is not b for a, b in zip(items, value)):
                return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        elif isinstance(value, (set, frozenset)):
            for item in value:
                if self.visit(item, f"{path}{{}}") is not item:
                    self.stuck.append(path)
        elif isinstance(value, types.MethodType):
            self.visit(value.__self__, f"{path}.__self__")
        elif isinstance(value, types.FunctionType):
            for i, cell in enumerate(value.__closure__ or ()):
                self._visit_cell(cell, f"{path}.<closure {i}>")
        else:
            self._visit_object(value, path)
        return value

    def _visit_graph(self, node, path: str) -> None:
        """An autograd graph a layer keeps (megatron-core's MoE token
        dispatchers keep tensors from dispatch to combine, so a failure
        between them leaves the graph alive): custom functions hold groups
        in their contexts' attributes."""
        stack = [node]
        while stack:
            node = stack.pop()
            if node is None or id(node) in self.seen:
                continue
            self.seen.add(id(node))
            self._visit_object(node, f"{path}<{type(node).__name__}>")
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _visit_cell(self, cell, path: str) -> None:
        try:
            item = cell.cell_contents
        except ValueError:  # an empty cell
            return
        new = self.visit(item, path)
        if new is not item:
            cell.cell_contents = new

    def _visit_object(self, value, path: str) -> None:
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict):
            for key, item in list(attrs.items()):
                new = self.visit(item, f"{path}.{key}")
                if new is not item:
                    attrs[key] = new
        for cls in type(value).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if name in ("__dict__", "__weakref__") or not hasattr(value, name):
                    continue
                item = getattr(value, name)
                new = self.visit(item, f"{path}.{name}")
                if new is not item:
                    try:
                        setattr(value, name, new)
                    except AttributeError:
                        self.stuck.append(f"{path}.{name}")


def swap_groups(roots: Dict[str, object], mapping: Dict[int, object], kinds: tuple) -> int:
    """Replace, everywhere reachable from ``roots`` (autograd graphs
    included), each value of a type in ``kinds`` by ``mapping[id(value)]``.
    Raises if one is not in the mapping or sits where it cannot be
    replaced. Returns how many were replaced."""
    swapper = _Swapper(mapping, kinds)
    for name, root in roots.items():
        swapper.visit(root, name)
    if swapper.unknown:
        raise RegroupError("process groups of no known role at " + ", ".join(swapper.unknown[:5]))
    if swapper.stuck:
        raise RegroupError(
            "process groups held where they cannot be replaced: " + ", ".join(swapper.stuck[:5])
        )
    return swapper.count


def _forget_parallel_state() -> None:
    """destroy_model_parallel() leaves some groups and rank lists set; a new
    initialize_model_parallel() must start from nothing."""
    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if not name.startswith("_") or callable(value) or isinstance(value, types.ModuleType):
            continue
        if isinstance(value, ProcessGroup) or name.endswith(("_GLOBAL_RANKS", "_RANKS")):
            setattr(parallel_state, name, None)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, ProcessGroup) for v in value):
            setattr(parallel_state, name, None)
        elif isinstance(value, dict) and any(isinstance(v, ProcessGroup) for v in value.values()):
            setattr(parallel_state, name, {})


def _swap_out(roots: Dict[str, object], extra_roles) -> tuple:
    """Groups -> slots; returns the slots and weak references to the groups
    (a helper so that no local of the caller keeps a group alive)."""
    roles = groups_by_role(extra_roles)
    slots: Dict[str, GroupSlot] = {}
    mapping: Dict[int, GroupSlot] = {}
    for role in roles:
        if id(roles[role]) not in mapping:
            mapping[id(roles[role])] = slots[role] = GroupSlot(role)
    alive = {role: weakref.ref(roles[role]) for role in slots}
    swap_groups(roots, mapping, (ProcessGroup,))
    return slots, alive


def set_aside(groups: Iterable[object]) -> SetAside:
    """Take groups out of torch's registry without destroying them, so that
    they outlive the default group (destroying it destroys every registered
    group). What ``put_back`` needs to register them in the next world.
    Torch's private registry helpers: the ones its own ``shrink_group`` uses
    (``python -m tools.probes.keep_groups`` checks them)."""
    world = dist.distributed_c10d._world
    entries = []
    for group in groups:
        backend, store = world.pg_map[group]
        entries.append(
            {
                "group": group,
                "backend": backend,
                "store": store,
                "name": world.pg_names[group],
                "config": world.pg_backend_config.get(group, ""),
                "ranks": dict(world.pg_group_ranks[group]),
            }
        )
        dist.distributed_c10d._cleanup_process_group_global_state(group)
    return SetAside(entries)


def put_back(aside: Optional[SetAside], gen: int) -> int:
    """Register set-aside groups in generation ``gen``'s world, under names
    its own groups (numbered from 0 again) cannot take; returns how many."""
    entries = [] if aside is None else aside.entries
    for entry in entries:
        name = f"kept{gen}/{entry['name']}"  # unique: its old name was
        entry["group"]._set_group_name(name)
        dist.distributed_c10d._register_pg_in_world(
            entry["group"], entry["backend"], entry["store"], name, entry["config"], entry["ranks"]
        )
    return len(entries)


def detach(
    roots: Dict[str, object],
    extra_roles: Optional[Dict[str, object]] = None,
    settle_s: float = 5.0,
    keep: Iterable[object] = (),
) -> Dict[str, GroupSlot]:
    """Swap every group under ``roots`` for a GroupSlot, destroy the groups
    but those in ``keep`` (set aside first: the next generation's
    megatron-core finds them again, and ``attach`` puts them back) and wait
    until no other old group object is alive. Returns the slots by role."""
    slots, alive = _swap_out(roots, extra_roles)
    kept = {id(group) for group in keep}
    alive = {role: ref for role, ref in alive.items() if id(ref()) not in kept}
    extra_roles = keep = None
    _forget_parallel_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    deadline = time.monotonic() + settle_s
    while True:
        left = [role for role in alive if alive[role]() is not None]
        if left:  # only cycles keep them now: collect (slow on a big heap)
            gc.collect()
            left = [role for role in alive if alive[role]() is not None]
        if not left:
            return slots
        if time.monotonic() > deadline:
            raise RegroupError(
                "old process groups still referenced: "
                + "; ".join(f"{role} (held by {_holders(alive[role]())})" for role in left[:5])
            )
        time.sleep(0.05)


def reset() -> None:
    """Drop a half-built generation (a failure during a rebuild); the
    objects still hold GroupSlots."""
    _forget_parallel_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _holders(obj) -> str:
    """Who keeps an old group alive: for the error message. (No
    comprehension may use ``obj``: it would hold it in a cell of its own.)"""
    found = []
    for ref in gc.get_referrers(obj):
        if ref is found or isinstance(ref, types.FrameType) and ref.f_code.co_name == "_holders":
            continue
        if isinstance(ref, dict):
            found.append(f"dict[{_key_of(ref, obj)!r}]")
        elif isinstance(ref, types.CellType):
            found.append(f"a closure of {_closure_owners(ref)}")
        else:
            found.append(f"{type(ref).__name__} {_safe_repr(ref)}")
    return ", ".join(found[:4]) or _untracked_holders(obj) or "nothing Python can see"


def _safe_repr(obj) -> str:
    """An object's repr for the message, or nothing where making it fails
    (a P2POp's asks its group for the rank, whose default group is gone)."""
    try:
        return repr(obj)[:80]
    except Exception:  # noqa: BLE001 - only words for a message
        return ""


def _untracked_holders(obj) -> str:
    """Tuples and dicts of objects the collector does not track (a process
    group among them) are not tracked either, so get_referrers cannot see
    them: look one level down from every tracked object."""
    found = []
    for outer in gc.get_objects():
        for inner in gc.get_referents(outer):
            if gc.is_tracked(inner) or not isinstance(inner, (tuple, dict)):
                continue
            items = inner.values() if isinstance(inner, dict) else inner
            for item in items:
                if item is obj:
                    kind, where = type(inner).__name__, type(outer).__name__
                    found.append(f"an untracked {kind} in {where} {repr(outer)[:80]}")
    return ", ".join(found[:3])


def _key_of(mapping: dict, value) -> object:
    for key, item in mapping.items():
        if item is value:
            return key
    return None


def _closure_owners(cell) -> str:
    """The functions (or running calls) whose closure holds ``cell``."""
    names = []
    for holder in gc.get_referrers(cell):
        if isinstance(holder, types.FrameType):
            names.append(f"{holder.f_code.co_qualname} ({holder.f_code.co_filename})")
        elif isinstance(holder, tuple):
            names += [
                f"{fn.__module__}.{fn.__qualname__}"
                for fn in gc.get_referrers(holder)
                if isinstance(fn, types.FunctionType)
            ]
    return " and ".join(names[:2]) or "a function Python cannot name"


def attach(
    roots: Dict[str, object],
    slots: Dict[str, GroupSlot],
    extra_roles: Optional[Dict[str, object]] = None,
) -> int:
    """Put the new generation's group of each role where its slot stands."""
    roles = groups_by_role(extra_roles)
    missing = [role for role in slots if role not in roles]
    if missing:
        raise RegroupError(f"the new generation has no group for {', '.join(missing[:5])}")
    mapping = {id(slot): roles[role] for role, slot in slots.items()}
    return swap_groups(roots, mapping, (GroupSlot,))


def live_groups(objects: Iterable[object]) -> int:
    """How many process groups are reachable from ``objects`` (for tests)."""
    swapper = _Swapper({}, (ProcessGroup,))
    for i, obj in enumerate(objects):
        swapper.visit(obj, f"root{i}")
    return len(swapper.unknown)
