"""Every iteration, send this rank's shard snapshot to its buddy and keep
the snapshot its owner sends, off the training's critical path.

One worker thread per rank runs the jobs in order: pack (CPU; on GPU the
main thread queues the copy on a side stream), seal with a checksum, then one
send to the buddy and one receive from the owner, each on a two-rank
process group of the pair's own (``MirrorGroups``), so mirror traffic
never interleaves with training collectives and a rank connects to its
buddy and its owner only, not to the whole job. The
snapshot of iteration t is taken before its forward and exchanged while
forward and backward run; step t waits until that exchange is done, so the
buddies always hold the state survivors would roll back to (at most one
iteration behind).

Buffers: two own snapshots (the last two iteration starts, so survivors can
roll back to whichever one the buddies hold) and two held ones (the last
verified snapshot is never the one being received into, so the buddy always
holds a whole snapshot of iteration t or t-1, never a torn one).

Two modes (--deadpool-mirror-mode). ``state`` sends the whole snapshot
every iteration. ``grad`` sends it once (at the start and after every
recovery), then only the last step's gradients (``replay``): the buddy
advances its replica by the owner's step, and its seal must give the
owner's checksum. A second, tiny message goes back the other way with the
verdict; on a mismatch both sides fall back to a whole snapshot at the next
iteration, and the held copy stays the last one that matched.

A mismatch is also a check for silent data corruption (``raise_on_divergence``,
under deadpool-launch): the buddy first verifies the replica it replayed from
against its seal. A replica that fails it was corrupted in the buddy's memory
(verdict ``CORRUPT_COPY``: a whole snapshot next, training goes on). One that
passes means the owner's step and the replay disagree: the owner drops its
snapshot of that iteration and raises ``SilentCorruption`` before its next
step, and every rank redoes the step from the iteration before. The redo is
the third opinion: when the owner seals that iteration again, the same
checksum as its first result means the replay was wrong, another means its
first step was (event ``sdc_resolved``).
"""

import queue
import threading
import time
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from deadpool_ext.state import replay
from deadpool_ext.state import snapshot as snap
from deadpool_ext.state.digest import SilentCorruption
from deadpool_ext.events import EventLog


class MirrorError(RuntimeError):
    """The mirror stopped (a buddy was lost or a snapshot arrived corrupted)."""


# How long a halt waits for the worker thread once the generation's
# connections are shut down. Its exchange then fails within milliseconds,
# unless gloo had queued part of a send for a busy socket: such a send is
# never failed when its connection closes (gloo's pair fails the waits of
# pending and posted operations, not of unbound sends in its transmit
# queue), and waits out the group's timeout. The thread is then abandoned.
HALT_GRACE_S = 2.0
# The verdict message (grad mode) travels with its own tag.
VERDICT_TAG = 1
MATCHED, DIVERGED, CORRUPT_COPY = 1, 2, 3
REPLAY_CHECK, COPY_CHECK = "mirror-replay", "mirror-copy"


def send_and_receive(operations: list, tag: int = 0) -> None:
    """Point-to-point operations (isend or irecv, tensor, peer, group), all
    done when this returns. Those on one group are posted as one batch:
    NCCL runs a group's operations in order on one stream, so in a ring of
    two (buddy and owner one peer, one group) a send issued before the
    receive on both sides would wait for a receive queued behind the
    other's send. Batched, they pair up (megatron-core's pipeline batches
    for the same reason). ``operations`` is emptied once they are posted: a
    wait that never returns (a thread a halt abandons) must hold no group,
    since a recovery drops every reference to the old ones."""
    groups = {id(group) for _, _, _, group in operations}
    if len(operations) > 1 and len(groups) == 1:
        group = operations[0][3]
        try:
            requests = dist.batch_isend_irecv(
                [dist.P2POp(op, t, peer, group=g, tag=tag) for op, t, peer, g in operations]
            )
        except BaseException:
            # An operation that fails inside torch's coalescing block (NCCL's:
            # the group aborted meanwhile) leaves the group in torch's record
            # of coalescing groups, which would keep it alive for good.
            dist.distributed_c10d._world.pg_coalesce_state.pop(group, None)
            raise
        finally:
            del group
    else:
        requests = [op(t, peer, group=group, tag=tag) for op, t, peer, group in operations]
    operations.clear()
    for request in requests:
        request.wait()


class MirrorGroups(NamedTuple):
    """A rank's two mirror groups: {rank, buddy} and {owner, rank} (the
    same group where buddy and owner are one peer, a ring of two; None
    where the rank mirrors to itself)."""

    to_buddy: Optional[object]
    from_owner: Optional[object]

    def roles(self) -> dict:
        """The groups by role, for re-pointing them (``rank/regroup.py``)."""
        roles = {
            "deadpool_mirror_to_buddy": self.to_buddy,
            "deadpool_mirror_from_owner": self.from_owner,
        }
        return {role: group for role, group in roles.items() if group is not None}


class Mirror:
    def __init__(
        self,
        optimizer,
        layout: snap.ShardLayout,
        rank: int,
        buddy: int,
        owner: int,
        groups: MirrorGroups,
        events: EventLog,
        device: Optional[torch.device] = None,
        mode: str = "state",
        raise_on_divergence: bool = False,
    ):
        """device: None on CPU; on GPU the CUDA device (``allocate`` then puts
        the buffers in pinned host memory or in device memory). mode: state
        or grad (see the module doc). raise_on_divergence: a replay mismatch
        is a suspected corruption (see the module doc), not only a resync."""
        self.optimizer, self.layout = optimizer, layout
        self.rank, self.buddy, self.owner = rank, buddy, owner
        # A job shrunk to one replica: own snapshots only (for a grow).
        self.local = buddy == rank
        self.replaying = mode == "grad" and not self.local
        # Whether the buddy's replica (and ours of the owner) can advance by a
        # packet: after one whole snapshot went across, until a mismatch.
        self.send_synced = self.receive_synced = False
        self._step_groups = None  # the optimizer's parameter groups at the last step
        self._table = None  # segment table of the layout, for packets
        self.groups, self.events = groups, events
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        self.own = []
        self.held = []
        self.own_index: Optional[int] = None  # last sealed own snapshot
        self.held_index: Optional[int] = None  # last verified held snapshot
        self.error: Optional[BaseException] = None
        self.raise_on_divergence = raise_on_divergence
        self.corruption: Optional[SilentCorruption] = None  # raised before the next step
        self.disputed = {}  # iteration -> the checksum of the owner's first, doubted result
        self.last = {}  # stage timings of the last job, for the event log
        self._lock = threading.Lock()
        self._packed = threading.Event()
        self._packed.set()
        self._jobs: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._last_event = None
        self._exchange_hooks = []  # called with the iteration, in the exchange thread
        self._thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        # Each worker has its own queue: one abandoned by halt() must not
        # take the next worker's jobs.
        return threading.Thread(
            target=self._work, args=(self._jobs,), name=f"deadpool-mirror-{self.rank}", daemon=True
        )

    def _abandoned(self) -> bool:
        """In a worker thread that halt() gave up on: it must not touch the
        mirror's state any more."""
        return threading.current_thread() is not self._thread

    def register_exchange_hook(self, hook) -> None:
        """``hook(iteration)`` runs in the exchange thread before each
        exchange (where fault injection's phase=mirror fires)."""
        self._exchange_hooks.append(hook)

    def allocate(self, buffer_device: str = "cpu") -> None:
        pin = self.cuda and buffer_device == "cpu"
        where = self.device if buffer_device == "device" else "cpu"
        self.own = [snap.allocate(self.layout, where, pin) for _ in range(2)]
        self.held = [] if self.local else [snap.allocate(self.layout, where, pin) for _ in range(2)]
        if self.replaying:
            self.packets = [replay.allocate(self.layout, where, pin) for _ in range(2)]
            self.verdicts = [torch.zeros(1, dtype=torch.int64, device=where) for _ in range(2)]
        self._thread.start()

    @property
    def extra_bytes(self) -> int:
        packets = self.packets if self.replaying else []
        return sum(b.numel() for b in self.own + self.held + packets)

    def note_step(self) -> None:
        """Before the optimizer step: its parameter groups as the step will
        use them (the scheduler changes them after it), for the packet the
        next iteration sends."""
        if self.replaying:
            self._step_groups = replay.param_groups(self.optimizer)

    def resync(self) -> None:
        """The next exchange sends and receives whole snapshots (training
        objects were rebuilt or restored)."""
        self.send_synced = self.receive_synced = False
        self._table = None

    # ----- main thread -----
    def start(self, iteration: int, sidecar: dict) -> None:
        """Snapshot the state at the start of ``iteration`` (after step
        ``iteration``-1) and mirror it; returns at once."""
        self.raise_if_failed()
        index = 0 if self.own_index is None else 1 - self.own_index
        kinds = self._kinds()
        if kinds[0] == "grad":
            # Now, on the main thread: the next iteration zeroes the gradients.
            replay.pack_grads(self.optimizer, self.layout, self.packets[0])
        event = None
        if self.cuda:
            # Queue the copy behind the optimizer step on a side stream; the
            # worker waits for the event, not the main thread.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                steps = snap.pack_shard(self.optimizer, self.layout, self.own[index])
                event = torch.cuda.Event()
                event.record(self._stream)
            sidecar = dict(sidecar, steps=steps)
        else:
            self._packed.clear()
        with self._lock:
            self._pending += 1
        self._jobs.put((iteration, index, sidecar, event, kinds, self._step_groups))
        self._last_event = event

    def _kinds(self):
        """What this iteration sends to the buddy and receives from the owner:
        a whole snapshot ("state") or a packet ("grad"). Both ends of each
        direction decide alike: they reset together and change only on a
        verdict both see."""
        if not self.replaying:
            return ("state", "state")
        self.wait_idle()  # the flags are the last exchange's outcome
        return (
            "grad" if self.send_synced else "state",
            "grad" if self.receive_synced else "state",
        )

    def wait_packed(self) -> None:
        """Before the optimizer step: the shard must be copied out first."""
        if self.cuda:
            if self._last_event is not None:
                torch.cuda.current_stream(self.device).wait_event(self._last_event)
            return
        start = time.perf_counter()
        while not self._packed.wait(timeout=1.0):
            self.raise_if_failed()
        self.last["wait_ms"] = (time.perf_counter() - start) * 1e3

    def wait_idle(self) -> None:
        """Until every queued job has been sent, received and verified."""
        with self._idle:
            while self._pending and self.error is None:
                self._idle.wait(timeout=1.0)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise MirrorError(f"mirror stopped: {self.error}") from self.error

    def held_iteration(self) -> Optional[int]:
        with self._lock:
            if self.held_index is None:
                return None
            return snap.snapshot_iteration(self.held[self.held_index])

    def wait_exchanged(self) -> None:
        """Before the optimizer step: this iteration's snapshot must have
        reached the buddy (and the owner's reached us). Every step holds a
        grad-norm all-reduce over all ranks, so no rank can finish step t
        before every buddy holds snapshot t: survivors are never more than
        one iteration ahead of what the buddies hold."""
        start = time.perf_counter()
        self.wait_packed()
        self.wait_idle()
        self.last["wait_ms"] = (time.perf_counter() - start) * 1e3
        corruption, self.corruption = self.corruption, None
        if corruption is not None:
            raise corruption

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=10)

    # ----- recovery -----
    def halt(self, timeout_s: float = HALT_GRACE_S) -> None:
        """Stop the worker: drop queued jobs, let the running one finish or
        fail (the generation's connections are shut down by then). A worker
        still in its exchange after ``timeout_s`` is abandoned: it waits on
        a send gloo will never fail, and leaves no trace when it ends."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._idle:
                    self._pending -= 1
        if self._thread is None:  # abandoned by an earlier halt
            return
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            self._thread = None  # abandoned; resume() starts a new one
            with self._idle:
                self._pending = 0  # its job will never complete
                self._idle.notify_all()
            raise MirrorError(
                f"the mirror thread was still in an exchange {timeout_s} s after "
                "the generation's connections were shut down: abandoned"
            )

    def resume(self, source_index: int) -> None:
        """After a restore from own[source_index]: forget every other copy
        (a later rollback must not find a snapshot of the abandoned timeline)
        and start a fresh worker."""
        for i, buffer in enumerate(self.own + self.held):
            if i != source_index:
                snap.header(buffer)[snap.H_MAGIC] = 0
        self.own_index, self.held_index = source_index, None
        self.resync()
        self.error, self._pending, self.corruption = None, 0, None
        self._packed.set()
        self._jobs = queue.Queue()
        self._thread = self._new_thread()
        self._thread.start()

    def iterations(self, which: str) -> List[int]:
        """Iterations of the own (or held) snapshots that verify, newest first."""
        buffers, owner = (self.own, self.rank) if which == "own" else (self.held, self.owner)
        found = []
        for buffer in buffers:
            try:
                snap.verify(buffer, self.layout, owner=owner)
            except snap.SnapshotError:
                continue
            found.append(snap.snapshot_iteration(buffer))
        return sorted(set(found), reverse=True)

    def find(self, which: str, iteration: int) -> int:
        """Index of the verified own (or held) snapshot of ``iteration``."""
        buffers, owner = (self.own, self.rank) if which == "own" else (self.held, self.owner)
        for i, buffer in enumerate(buffers):
            try:
                snap.verify(buffer, self.layout, iteration=iteration, owner=owner)
                return i
            except snap.SnapshotError:
                continue
        raise MirrorError(f"no verified {which} snapshot of iteration {iteration}")

    # ----- worker thread -----
    def _work(self, jobs: "queue.Queue") -> None:
        if self.cuda:
            # A stream of its own: sealing, replay and the exchange's waits
            # would otherwise queue on the stream training computes on.
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(torch.cuda.Stream(self.device)):
                return self._serve(jobs)
        return self._serve(jobs)

    def _serve(self, jobs: "queue.Queue") -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                self._run(*job)
            except BaseException as error:  # the main thread raises it
                if self._abandoned():
                    return
                # Without its traceback: those frames hold the process group,
                # and a recovery must be able to drop every reference to it.
                self.error = MirrorError(f"{type(error).__name__}: {error}")
                self._packed.set()
                self.events.emit("mirror_failed", iteration=job[0], error=str(error))
            if self._abandoned():
                return
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            if self.error is not None:
                return

    def _run(self, iteration: int, index: int, sidecar: dict, event, kinds, groups) -> None:
        t0 = time.perf_counter()
        buffer = self.own[index]
        if event is not None:
            event.synchronize()
        else:
            sidecar = dict(sidecar, steps=snap.pack_shard(self.optimizer, self.layout, buffer))
            self._packed.set()
        t1 = time.perf_counter()
        snap.seal(buffer, self.layout, iteration, self.rank, snap.encode_sidecar(sidecar))
        self.own_index = index
        self._settle_dispute(iteration, buffer)
        t2 = time.perf_counter()
        if self.local:
            self.last.update(pack_ms=(t1 - t0) * 1e3, seal_ms=(t2 - t1) * 1e3)
            return
        target = 0 if self.held_index is None else 1 - self.held_index
        send, receive = kinds
        outgoing = buffer
        if send == "grad":
            if self._table is None:
                self._table = replay.segment_table(self.optimizer, self.layout)
            outgoing = self.packets[0]
            replay.seal_packet(
                outgoing, self.layout, buffer, replay.extras_for(self._table, groups)
            )
        incoming = self.packets[1] if receive == "grad" else self.held[target]
        for hook in self._exchange_hooks:
            hook(iteration)
        self.exchange(outgoing, incoming)
        if self._abandoned():
            return
        t3 = time.perf_counter()
        verdict = self._take(incoming, receive, iteration, target)
        if "grad" in kinds:
            self._exchange_verdicts(send, receive, verdict, iteration)
        if send == "state":  # the buddy verified it, or its mirror stopped
            self.send_synced = self.replaying
        if self._abandoned():
            return
        t4 = time.perf_counter()
        self.last.update(
            pack_ms=(t1 - t0) * 1e3,
            seal_ms=(t2 - t1) * 1e3,
            exchange_ms=(t3 - t2) * 1e3,
            verify_ms=(t4 - t3) * 1e3,
        )
        self.events.emit(
            "mirror_snapshot",
            iteration=iteration,
            buddy=self.buddy,
            owner=self.owner,
            bytes=outgoing.numel(),
            sent=send,
            received=receive,
            **{k: round(v, 3) for k, v in self.last.items()},
        )

    def _take(self, incoming: torch.Tensor, kind: str, iteration: int, target: int) -> int:
        """Verify the owner's snapshot, or advance the replica by its packet;
        the held copy moves on only to a whole, matching one. The verdict."""
        if kind == "state":
            snap.verify(incoming, self.layout, iteration=iteration, owner=self.owner)
            self.receive_synced = self.replaying
        else:
            source = self.held[self.held_index]
            try:
                replay.apply(
                    incoming,
                    source,
                    self.held[target],
                    self.layout,
                    replay.optimizer_classes(self.optimizer),
                    self.owner,
                )
            except replay.ReplayMismatch as error:
                self.receive_synced = False
                self.events.emit(
                    "mirror_diverged", iteration=iteration, owner=self.owner, error=str(error)
                )
                return self._judge_replica(source, iteration)
        with self._lock:
            self.held_index = target
        return MATCHED

    def _judge_replica(self, source: torch.Tensor, iteration: int) -> int:
        """After a replay mismatch: was the replica it started from intact?"""
        try:
            snap.verify(source, self.layout, owner=self.owner)
        except snap.SnapshotError as error:
            with self._lock:
                self.held_index = None  # nothing verified is held until the resync
            self.events.emit(
                "sdc_detected",
                check=COPY_CHECK,
                iteration=iteration,
                suspects=[self.rank],
                action="resync",
                error=f"the replica of rank {self.owner}'s shard held here: {error}",
            )
            return CORRUPT_COPY
        return DIVERGED

    def _doubt_own(self, iteration: int) -> None:
        """The buddy's replay of our step from an intact replica disagrees:
        drop our snapshot of it (a rollback must go to the one before) and
        raise before the next step."""
        buffer = self.own[self.own_index]
        self.disputed[iteration] = int(snap.header(buffer)[snap.H_CHECKSUM])
        snap.header(buffer)[snap.H_MAGIC] = 0
        self.corruption = SilentCorruption(
            REPLAY_CHECK,
            iteration,
            [self.rank],
            f"rank {self.buddy}'s replay of this rank's step from its intact replica gives "
            "another state",
        )

    def _settle_dispute(self, iteration: int, buffer: torch.Tensor) -> None:
        """The redo of a doubted step is the third opinion."""
        first = self.disputed.pop(iteration, None)
        if first is None:
            return
        same = int(snap.header(buffer)[snap.H_CHECKSUM]) == first
        self.events.emit(
            "sdc_resolved",
            check=REPLAY_CHECK,
            iteration=iteration,
            blamed=self.buddy if same else self.rank,
            why="the redo reproduced this rank's first result: the buddy's replay was wrong"
            if same
            else "the redo differs from this rank's first result: its first step was corrupt",
        )

    def _exchange_verdicts(self, send: str, receive: str, verdict: int, iteration: int) -> None:
        """Tell the owner whether its packet reproduced its state, and learn
        the same from the buddy; a mismatch means a whole snapshot next."""
        mine, theirs = self.verdicts
        operations = []
        if receive == "grad":
            mine.fill_(verdict)
            operations.append((dist.isend, mine, self.owner, self.group_with(self.owner)))
        if send == "grad":
            theirs.zero_()
            operations.append((dist.irecv, theirs, self.buddy, self.group_with(self.buddy)))
        send_and_receive(operations, tag=VERDICT_TAG)
        if send == "grad" and int(theirs.item()) != MATCHED:
            self.send_synced = False
            self.events.emit("mirror_resync", iteration=iteration, buddy=self.buddy)
            if int(theirs.item()) == DIVERGED and self.raise_on_divergence:
                self._doubt_own(iteration)

    def group_with(self, peer: int):
        """The pair group this rank shares with its buddy or its owner."""
        if peer == self.buddy:
            return self.groups.to_buddy
        if peer == self.owner:
            return self.groups.from_owner
        raise ValueError(f"rank {peer} is neither rank {self.rank}'s buddy nor its owner")

    def exchange(self, send: torch.Tensor, receive: torch.Tensor) -> None:
        """Send to the buddy and receive from the owner at the same time (in
        a ring with DP=2 they are the same peer)."""
        send_and_receive(
            [
                (dist.isend, send, self.buddy, self.group_with(self.buddy)),
                (dist.irecv, receive, self.owner, self.group_with(self.owner)),
            ]
        )
