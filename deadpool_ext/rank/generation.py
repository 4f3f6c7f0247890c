"""One generation of the job, as a rank sees it: entering it (its own
store prefix and default group) and leaving it (every connection it opened
shut down, NCCL groups aborted), so that no rank stays blocked on an old
generation, whatever it is blocked in.

Entering: everyone arrives first (a store barrier, so a failure now is
seen by polling), then generation N's default group is created under its
own prefix in the coordinator's store; megatron's groups and the mirror's
(two-rank groups, ``open_mirror_groups``) follow (``rebuild``), and
``regroup.attach`` re-points live objects to them.

Leaving:

A gloo operation waits until its peer's socket delivers data or closes.
Dropping a group does not close its sockets while anything else holds
them: the data loader's worker processes, forked after the groups exist,
inherit every socket's descriptor; an unfinished asynchronous operation
keeps its group alive in C++. Live ranks blocked on such a peer, or on
each other, are then never released (``abort()`` and ``set_timeout()`` do
not interrupt a gloo operation already waiting).

So a generation's connections are shut down explicitly. ``shutdown()``
acts on the connection, not on one descriptor: the peer reads the end of
the stream whatever else holds a copy, and this rank's own operations on
it fail at once ("Connection closed by peer"), which the trainer turns
into a recovery. A generation's connections are the TCP sockets the
process opened since it began: its own store connection (the rendezvous,
so a rank stuck waiting for a dead peer's address is freed too) and the
pairs its groups connected, read at each release: a connection made after
the groups (gloo's pairs under torch's TORCH_GLOO_LAZY_INIT=1, connected on
first use; a communicator's sockets made on first use) is shut down too.
The control plane's connections (``wire.control_sockets``) are never
touched. NCCL groups of the generation are aborted, which releases their
kernels.

Two callers: ``tear_down`` (the rank stops using the generation; peers
blocked on it are released), and the heartbeat thread, as soon as the
coordinator announces a newer generation that is not a grow, so a main
thread blocked in a collective is released within a watch interval of the
announcement. Neither touches the state: snapshots live in tensors that
no group owns.
"""

import contextlib
import datetime
import threading
import time
import weakref
from typing import Collection, Dict, Iterable, List, Optional, Set, Tuple

import torch.distributed as dist

from megatron.training.config import Config
from megatron.training.initialize import init_process_groups

from deadpool_ext.config import section
from deadpool_ext.protocol import Decision, Joining, group_key, join_key
from deadpool_ext.rank import regroup
from deadpool_ext.sockets import (
    open_descriptors,
    peer_of,
    shut_down,
    socket_descriptors,
    sockets_opened_since,
)
from deadpool_ext.state.mirror import MirrorGroups
from deadpool_ext.topology import BuddyMap
from deadpool_ext.wire import control_sockets


class Generation:
    """The connections and NCCL groups of the generation this process holds
    or is building. Thread-safe: the heartbeat thread may release it while
    the main thread builds or uses it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.number: Optional[int] = None
        self._baseline: Set[int] = set()  # sockets open before it began (or last released)
        self._at_built = 0  # its connections once every group existed (events)
        self._building = False
        self._done = False  # released since it began (it is built again only anew)
        self._groups: List[weakref.ref] = []
        # Who shut the generation's connections down, and how many (events).
        self.released: Optional[dict] = None
        self._last_released: Set[int] = set()  # inodes of the last release
        # Groups made while recording (--deadpool-rebuild-groups changed), by
        # group_key: the group and the sockets it connected.
        self._made: Dict[str, Tuple[weakref.ref, frozenset]] = {}
        self._held = False  # the main thread keeps some groups: no release of all
        self._carried: Set[int] = set()  # the sockets of groups carried over
        self._released_all = False
        # Its connections once built, inode -> descriptor: what the heartbeat
        # thread looks at for a peer whose host acknowledges nothing.
        self._built_connections: Dict[int, int] = {}

    def begin(self, number: int, keep: Collection[str] = ()) -> None:
        """Before the generation's first connection (its store) is opened.
        ``keep``: group keys of the last generation that carry over, with
        their connections (a later release shuts them down too)."""
        with self._lock:
            carried = {k: v for k, v in self._made.items() if k in keep and v[0]() is not None}
            carried_sockets = set().union(*(v[1] for v in carried.values()))
            self.number, self._building = number, True
            self._baseline = set(socket_descriptors()) - carried_sockets
            self._carried = carried_sockets
            self._groups, self._at_built, self._built_connections = [], 0, {}
            self.released, self._done = None, False
            self._made, self._held, self._released_all = carried, False, False

    def record(self, key: str, group, sockets: Iterable[int]) -> None:
        with self._lock:
            self._made[key] = (weakref.ref(group), frozenset(sockets))

    def made(self) -> Dict[str, object]:
        """The recorded groups still alive, by group_key."""
        with self._lock:
            entries = list(self._made.items())
        return {k: v[0]() for k, v in entries if v[0]() is not None}

    def sockets_of(self, keys: Collection[str]) -> Set[int]:
        """The sockets the groups of ``keys`` connected."""
        with self._lock:
            return set().union(*(self._made[k][1] for k in keys if k in self._made))

    def kept_group(self, key: str):
        """The group of ``key`` carried over from the last generation, if any."""
        with self._lock:
            entry = self._made.get(key)
        return None if entry is None else entry[0]()

    def hold(self, candidates: Collection[str], by: str) -> Dict[str, object]:
        """The main thread stops using the generation but may keep the groups
        of ``candidates``: every other connection is shut down now, theirs
        stay open, and the heartbeat thread's release no longer applies.
        Returns the candidates still intact (none once everything was released)."""
        with self._lock:
            if self.number is None or self._released_all:
                intact = {}
            else:
                intact = {k: self._made[k] for k in candidates if k in self._made}
                intact = {k: v for k, v in intact.items() if v[0]() is not None}
            self._held = True
        self.release(by, keep=self.sockets_of(intact))
        return {k: v[0]() for k, v in intact.items()}

    def _mine(self, open_now: dict) -> Set[int]:
        """The generation's sockets: every one this process opened since it
        began, the control plane's aside. A group may connect a pair when it
        first uses it (gloo under TORCH_GLOO_LAZY_INIT=1), so the set may grow
        while the generation trains: only a release knows it whole."""
        known, pending = control_sockets(open_now)
        return set(open_now) - self._baseline - known - pending

    def built(self, groups: Iterable[object] = ()) -> None:
        """Every group of the generation exists: keep them, to abort the
        NCCL ones at release, and count the connections made so far."""
        with self._lock:
            if not self._building:
                return
            open_now = socket_descriptors()
            mine = self._mine(open_now)
            self._at_built = len(mine - self._carried)
            self._built_connections = {inode: open_now[inode] for inode in mine}
            self._groups = [weakref.ref(g) for g in groups]
            self._building = False

    def connections(self) -> Dict[int, int]:
        """inode -> descriptor of the connections the built generation made
        (none before it is built, or once released)."""
        with self._lock:
            return dict(self._built_connections)

    def size(self) -> dict:
        """What building the generation made in this process: the groups it
        is a member of, the groups it took part in creating (every rank
        calls ``new_group`` for every group) and the sockets it opened while
        building them. A rebuild's cost grows with these (docs/scale.md)."""
        with self._lock:
            held = len({id(ref()) for ref in self._groups if ref() is not None})
            connections = self._at_built
        return {"groups_held": held, "groups_created": groups_created(), "connections": connections}

    @contextlib.contextmanager
    def exclusive(self):
        """No release runs meanwhile: the main thread destroys the groups of
        a half-built generation (a failure during its rebuild), which the
        heartbeat thread may be releasing again, aborting its NCCL groups."""
        with self._lock:
            yield

    def release_if_older(self, newer: int, by: str, keep: Collection[int] = frozenset()) -> int:
        """Release this generation (but the sockets in ``keep``) if it is
        older than ``newer`` and the main thread does not hold it (``hold``)."""
        with self._lock:
            if self.number is None or self.number >= newer or self._done or self._held:
                return 0
            return self._release_locked(by, frozenset(keep))

    def release(self, by: str, keep: Collection[int] = frozenset()) -> int:
        """Shut every connection of the generation down (but the sockets in
        ``keep``) and abort its NCCL groups (but those owning them); returns
        the number of connections shut down. Idempotent: a second release
        shuts down what the groups connected since."""
        with self._lock:
            if self.number is None:
                return 0
            return self._release_locked(by, frozenset(keep))

    def _release_locked(self, by: str, keep: frozenset) -> int:
        """NCCL groups are aborted first, then the sockets are shut down:
        NCCL's own connections are among them, and a communicator whose
        sockets close under it fails in its own threads. Under the lock, so
        that the main thread's tear-down (which releases before it destroys
        the groups) never destroys a group while it is being aborted."""
        kept_groups = {id(v[0]()) for v in self._made.values() if v[1] & keep}
        self._built_connections = {}
        groups = [ref() for ref in self._groups] + nccl_groups()
        started = time.monotonic()
        aborted = abort_nccl({id(g): g for g in groups if id(g) not in kept_groups}.values())
        abort_ms = round((time.monotonic() - started) * 1e3, 1)
        self._groups = [ref for ref in self._groups if id(ref()) in kept_groups]
        open_now = socket_descriptors()
        known, pending = control_sockets(open_now)
        inodes = set(open_now) - self._baseline - known - pending - keep
        count = sum(shut_down(open_now[i]) for i in inodes)
        # What a control connect under way spared is looked at again next
        # time (and the heartbeat thread's release comes again for it).
        self._baseline = set(open_now) - keep - pending
        if inodes:  # a second release finds nothing new
            self._last_released = set(inodes)
        self._done = not self._building and not keep and not pending
        self._released_all = self._released_all or not keep
        if (count or aborted) and self.released is None:
            self.released = {"by": by, "connections": count, "open": len(inodes)}
            if aborted:  # what the events show of an NCCL release
                self.released.update(nccl_groups_aborted=aborted, abort_ms=abort_ms)
        return count

    def open_connections(self) -> List[dict]:
        """The TCP connections this process has open now, and whether the
        last release knew them (for the report of a rank it did not free)."""
        with self._lock:
            known = set(self._last_released)
        found = []
        for inode, fd in sorted(socket_descriptors().items()):
            peer = peer_of(fd)
            if peer is not None:
                found.append({"inode": inode, "peer": peer, "released": inode in known})
        return found


@contextlib.contextmanager
def recording_groups(
    generation: Generation,
    kept: Collection[str] = (),
    enabled: bool = True,
    aside: Optional[regroup.SetAside] = None,
):
    """While megatron-core and the mirror make a generation's groups: name
    each by its group_key, note the sockets it connected (a release can then
    spare a kept group's), and hand back the group carried over for each
    key in ``kept`` instead of making it (every rank skips the same ones, so
    the groups made keep one order and torch's names everywhere). Torch has
    no hook on group creation and megatron-core calls
    ``torch.distributed.new_group``; the wrapper is in place for the call alone.
    Not ``enabled``: groups are made as they always are. ``aside``: the
    carried-over groups as the last generation set them aside, registered
    in this one's world first; yields how many."""
    put_back = regroup.put_back(aside, generation.number)
    if not enabled:
        yield put_back
        return
    make = dist.new_group
    seen: Dict[Tuple[int, ...], int] = {}

    def new_group(*args, **kwargs):
        ranks = kwargs["ranks"] if "ranks" in kwargs else (args[0] if args else None)
        if ranks is None:
            return make(*args, **kwargs)
        members = tuple(sorted(ranks))
        key = group_key(members, seen.get(members, 0))
        seen[members] = seen.get(members, 0) + 1
        if key in kept:
            group = generation.kept_group(key)
            return dist.GroupMember.NON_GROUP_MEMBER if group is None else group
        before = open_descriptors() if dist.get_rank() in members else None
        group = make(*args, **kwargs)
        if before is not None:
            generation.record(key, group, sockets_opened_since(before))
        return group

    dist.new_group = new_group
    try:
        yield put_back
    finally:
        dist.new_group = make


def records_groups(config: Config) -> bool:
    """Whether a rank names and records its groups as they are made, so
    that a hot swap may keep some (--deadpool-rebuild-groups changed)."""
    return section(config).deadpool_rebuild_groups == "changed"


def groups_created() -> Optional[int]:
    """Groups this process took part in creating since its default group
    (torch's own count, private: None where a torch lacks it)."""
    return getattr(dist.distributed_c10d._world, "group_count", None)


def nccl_groups() -> List[object]:
    """Every NCCL group this process has, from torch's registry of groups
    (private): those made while a generation was still being built too,
    which ``built`` has not seen yet."""
    registry = getattr(dist.distributed_c10d._world, "pg_map", {})
    return [g for g in list(registry) if _backend(g) == "nccl"]


def _backend(group) -> Optional[str]:
    try:
        return group._get_backend_name()
    except (AttributeError, RuntimeError):
        return None


def abort_nccl(groups: Iterable[Optional[object]]) -> int:
    """ncclCommAbort for every NCCL group still alive: kernels waiting on a
    lost peer return, and the next use of the group raises. Returns how
    many it aborted."""
    aborted = 0
    for group in groups:
        if group is None or not isinstance(group, dist.ProcessGroup):
            continue
        try:
            if group._get_backend_name() == "nccl":
                group.abort()
                aborted += 1
        except RuntimeError:
            pass  # already aborted, or torn down meanwhile
    return aborted


class FailureAnnounced(RuntimeError):
    """The coordinator started a new generation (some rank was lost)."""


def enter_generation(ctx, config, decision: Decision, rank: int, world_size: int) -> None:
    """Everyone arrives (a store barrier, so a failure now is seen by
    polling), then generation N's default group under its own prefix."""
    ctx.post(Joining(gen=decision.gen, rank=rank, slot=ctx.slot))
    while ctx.get(join_key(decision.gen)) is None:
        if ctx.current()["gen"] != decision.gen:
            raise FailureAnnounced("another failure before the rebuild")
        time.sleep(0.01)
    open_default_group(ctx, config, decision.gen, rank, world_size, keep=decision.kept)


def open_default_group(
    ctx, config, gen: int, rank: int, world_size: int, keep: Collection[str] = ()
) -> None:
    """Generation ``gen``'s default group (the one place a real one is made):
    its rendezvous under its own prefix, on a store connection the
    generation owns, so that releasing the generation frees a rank waiting
    there for a peer that died. Megatron's groups and the mirror's pairs
    follow; ``keep``: the groups of the last generation that carry over."""
    p = config.parallel
    ctx.generation.begin(gen, keep)
    dist.init_process_group(
        p.distributed_backend,
        store=dist.PrefixStore(f"gen{gen}/", ctx.generation_store()),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes),
    )


def open_fake_world(rank: int, world_size: int) -> None:
    """A world whose collectives do nothing, for a warm spare to build its
    model and optimizer for a position before it can join the real one.
    torch ships the "fake" backend under torch.testing; nothing else gives
    megatron-core a group of the right size without peers."""
    import torch.testing._internal.distributed.fake_pg as fake_pg

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


def open_training_groups(config: Config, buddies: Optional[BuddyMap]) -> MirrorGroups:
    """Megatron's groups (megatron-core's parallel state) and the mirror's,
    in the generation whose default group exists; returns the mirror's."""
    init_process_groups(config)
    return open_mirror_groups(config, buddies)


def open_mirror_groups(config: Config, buddies: Optional[BuddyMap]) -> MirrorGroups:
    """The two-rank groups only mirror traffic uses, {rank, buddy} and
    {owner, rank}: mirror traffic never interleaves with training
    collectives, and a rank connects to two peers, not to the whole job (a
    rebuild's cost grows with each group's members: docs/scale.md).
    Collective: every rank creates every pair, in owner order (torch names
    a group by how many the process made before it, so only the members
    creating it would give the two ends of a pair different names in a
    ring). gloo for host-memory mirrors, NCCL for device-memory ones; in a
    spare's fake world they are fake too, until the real ones replace them.
    ``buddies`` None: a job shrunk to one replica, no pairs."""
    if buddies is None:
        return MirrorGroups(None, None)
    dp = section(config)
    backend = "nccl" if dp.deadpool_mirror_memory == "device" else "gloo"
    if dist.get_backend() == "fake":
        backend = None
    timeout = datetime.timedelta(seconds=dp.deadpool_mirror_timeout)
    pairs: Dict[Tuple[int, int], object] = {}
    for owner in sorted(buddies.buddy):
        pair = mirror_pair(owner, buddies.buddy[owner])
        if pair not in pairs:
            pairs[pair] = dist.new_group(list(pair), backend=backend, timeout=timeout)
    me = dist.get_rank()
    return MirrorGroups(
        pairs[mirror_pair(me, buddies.buddy[me])], pairs[mirror_pair(buddies.owner[me], me)]
    )


def mirror_pair(owner: int, buddy: int) -> Tuple[int, int]:
    return (owner, buddy) if owner < buddy else (buddy, owner)


def position_groups(grid, holders: Set[int]) -> Tuple[Optional[object], object]:
    """Gloo groups of this rank's (tp, pp) position in ``grid`` (the new
    world): its ranks that held state before, and all of them. Collective:
    every rank creates every position's groups, in the same order."""
    me = dist.get_rank()
    mine_holders, mine_all = None, None
    for pp in range(grid.pp):
        for tp in range(grid.tp):
            ranks = [grid.rank(tp, d, pp) for d in range(grid.dp)]
            kept = [r for r in ranks if r in holders]
            group = dist.new_group(ranks, backend="gloo")
            kept_group = group if kept == ranks else dist.new_group(kept, backend="gloo")
            if me in ranks:
                mine_all = group
                mine_holders = kept_group if me in kept else None
    return mine_holders, mine_all
