"""Recovery inside a worker: tear down, report, rebuild, restore, resume.

A survivor keeps its process and memory: its model, optimizer, data, own
snapshots and the copy it holds for its owner. After a failure it

  1. halts the mirror and swaps every process group for a placeholder
     (``regroup.detach``), so its old sockets close and any peer still
     blocked on it is released;
  2. reports to the coordinator which snapshots it can restore, for the
     generation the coordinator announced;
  3. gets the decision: the rollback iteration R, and which spare takes
     which lost rank (or the reason the job must stop);
  4. joins generation N: default group, megatron's groups and the mirror's
     pair groups, and re-points its objects to them (``regroup.attach``);
  5. restores: survivors from their own snapshot of R, a spare from the
     copy its buddy holds (sent over their mirror pair group, checksum verified);
     the parameters are rebuilt from the shards, then training goes on
     at R, redoing at most the interrupted iteration.

A failure during any of this sends every survivor back to step 1 for the
next generation. A spare joins at step 4, with a model it built for its
position against a fake world (no collectives), re-pointed the same way.
"""

import time
from typing import Callable, Dict, List, NoReturn, Optional

from megatron.training.log import get_logger
from megatron.training.training import Trainer

from deadpool_ext import protocol as P
from deadpool_ext.config import section
from deadpool_ext.defaults import STUCK_REPORT_TIMEOUTS
from deadpool_ext.protocol import Action, Decision, ExitCode, Source, WorkerState, group_members
from deadpool_ext.rank import rebuild, regroup
from deadpool_ext.rank.errors import Failure, WorkerExit, classify, summary
from deadpool_ext.rank.hooks import Builders, RankHooks, RecoveryReport
from deadpool_ext.rank.generation import (
    enter_generation,
    open_fake_world,
    open_training_groups,
    recording_groups,
    records_groups,
)
from deadpool_ext.rank.restore import restore_from_mirror
from deadpool_ext.state.digest import SilentCorruption
from deadpool_ext.state.mirror import MirrorError


def peer_failure_of(
    work: Callable[[], None], on_numeric: Optional[Callable[[BaseException, str], bool]] = None
) -> Optional[str]:
    """Run ``work``: None when it returns, the failure's text when a peer
    failed (or a NaN, an Inf or a corruption was found and ``on_numeric``
    reported it: the job rolls back as from a failure); any other failure
    goes up to the worker's main."""
    try:
        work()
        return None
    except Exception as error:  # noqa: BLE001 - classified, re-raised unless recovered from
        kind = classify(error)
        if kind == Failure.NUMERIC and on_numeric is not None:
            text = peer_failure_text(error)
            if on_numeric(error, text):
                return text
            raise
        if kind != Failure.PEER:
            raise
        return peer_failure_text(error)


def peer_failure_text(error: BaseException) -> str:
    """Only text leaves the ``except`` block (the traceback's frames hold
    the old groups): the failure and where it was raised."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = "" if frame is None else f" (at {frame.tb_frame.f_code.co_filename}:{frame.tb_lineno})"
    return summary(error) + where


class Recovery:
    def __init__(
        self, ctx, trainer: Trainer, hooks: RankHooks, builders: Optional[Builders] = None
    ):
        """``builders``: what a resize needs to build this rank's objects
        again for another world."""
        self.ctx = ctx
        self.builders = builders
        self.slots = None  # GroupSlots while the groups are down
        # --deadpool-rebuild-groups changed: between tear-down and decision,
        # the groups that may be kept (by group_key), their connections open;
        # then the kept ones, set aside from torch's registry until the next
        # generation's default group exists.
        self.intact: Optional[Dict[str, object]] = None
        self.set_aside: Optional[regroup.SetAside] = None
        self.completed = False  # the loop reached --train-iters
        self.failure_seen_at = None  # when this rank saw the failure it recovers from
        self.stage_ms = {}  # the recovery's stages, by event, as this rank timed them
        self.adopt(trainer, hooks)

    def adopt(self, trainer: Trainer, hooks: RankHooks) -> None:
        """Train with these objects from now on (at start, and after a resize)."""
        self.trainer, self.config, self.hooks = trainer, trainer.config, hooks
        self.logger = get_logger(trainer.runtime.rank)
        timeout = section(self.config).deadpool_heartbeat_timeout
        self.ctx.watch_stuck(STUCK_REPORT_TIMEOUTS * timeout, self._report_stuck)
        keeps = records_groups(self.config) and self.mirror is not None
        self.ctx.keep_groups_with(self.keepable if keeps else None)

    def _report_stuck(self, gen: int, stacks: str) -> None:
        """The heartbeat thread saw generation ``gen`` announced and released
        this rank's connections, yet the main thread still trains: say where
        it is (the coordinator has it killed a heartbeat timeout later)."""
        self.emit(
            "stuck",
            for_gen=gen,
            stacks=stacks,
            released=self.ctx.generation.released,
            release_error=self.ctx.release_error,
            connections=self.ctx.generation.open_connections(),
        )
        self.logger.error(
            "deadpool: generation %d was announced %.0f s ago and this rank "
            "has not stopped training; its threads:\n%s",
            gen,
            self.ctx.stuck_after_s,
            stacks,
        )

    @property
    def mirror(self):
        return self.hooks.mirror.mirror

    @property
    def events(self):
        return self.hooks.mirror.events

    def roots(self) -> dict:
        return {"state": self.trainer.state, "mirror": self.mirror}

    def emit(self, event: str, **fields) -> None:
        self.events.emit(
            event, gen=self.ctx.gen, iteration=self.trainer.progress.iteration, **fields
        )
        if "ms" in fields:
            self.stage_ms[event] = fields["ms"]

    # ----- the loop -----
    def train(self) -> None:
        while True:
            error = self._train_until_failure()
            if error is None:
                break
            decision = self.recover(error)
            if decision.action == Action.CHECKPOINT or decision.stop:
                self.save_and_stop(decision)
                return
        if self.completed:  # not stopped early by a signal or an exit flag (saved then)
            self.trainer.wrap_up()
        self.trainer.finish()

    def save_and_stop(self, decision: Decision) -> None:
        """Spares ran out under --deadpool-on-spares-exhausted checkpoint
        (the survivors hold every shard), or a stop was asked for: save and
        end without training on."""
        start = time.monotonic()
        directory = self.config.checkpoint.save
        if directory is None:  # a stop asked for in a job that saves nothing
            self.emit("checkpoint_skipped", reason="no --save")
            self.logger.warning("deadpool: %s; no --save: nothing saved", decision.reason)
            self.trainer.finish()
            return
        outcome = self.trainer.save(wait=True)
        self.emit(
            "checkpoint_saved" if outcome.ok else "checkpoint_failed",
            directory=directory,
            data_parallel_size=self.config.data_parallel_size,
            ms=round((time.monotonic() - start) * 1e3, 1),
        )
        self.trainer.finish()  # closes the event log
        if not outcome.ok and decision.stop:
            # The stop asked for a checkpoint: without it the job must not end well.
            why = f"iteration {self.trainer.progress.iteration} could not be saved to {directory}"
            raise WorkerExit(ExitCode.FAILED, f"{why} ({'; '.join(outcome.errors)})")
        if not outcome.ok:
            self.logger.error(
                "deadpool: no spare left and iteration %d could not be saved to %s (%s): "
                "stopped; resubmit with --load %s to go on from its latest checkpoint.",
                self.trainer.progress.iteration,
                directory,
                "; ".join(outcome.errors),
                directory,
            )
            return
        if decision.stop:
            self.logger.warning(
                "deadpool: %s: saved iteration %d to %s; --load it to go on.",
                decision.reason,
                self.trainer.progress.iteration,
                directory,
            )
            return
        self.logger.error(
            "deadpool: no spare left; saved iteration %d to %s and stopped. "
            "Resubmit with --load %s when nodes are back (any data-parallel "
            "size, the same TP and PP).",
            self.trainer.progress.iteration,
            directory,
            directory,
        )

    def _train_until_failure(self) -> Optional[str]:
        """None when training ended; the failure's text when a peer failed
        (any other failure goes up to the worker's main)."""

        def loop() -> None:
            self.completed = self.trainer.loop()

        return peer_failure_of(loop, self.report_numeric)

    def report_numeric(self, error: BaseException, text: str) -> bool:
        """This rank's loss or gradients went NaN or Inf in the iteration in
        progress, or a check found a corrupted copy: the coordinator rolls
        every rank back (or swaps the suspect, or stops; --deadpool-on-sdc).
        False when the job stops here instead (--deadpool-on-nan stop)."""
        dp = section(self.config)
        fault = dict(
            gen=self.ctx.gen,
            rank=self.trainer.runtime.rank,
            slot=self.ctx.slot,
            iteration=self.trainer.progress.iteration + 1,
            error=text,
            on_sdc=dp.deadpool_on_sdc,
        )
        if isinstance(error, SilentCorruption):
            fault.update(iteration=error.iteration, check=error.check, suspects=error.suspects)
        elif dp.deadpool_on_nan == "stop":
            return False
        self.ctx.post(P.NumericFault(**fault))
        return True

    # ----- survivor -----
    def recover(self, error: str, after_gen: Optional[int] = None) -> Decision:
        """Until a generation after ``after_gen`` (default: this one) resumes;
        returns its decision."""
        self.ctx.state = WorkerState.RECOVERING
        self.failure_seen_at, self.stage_ms = time.monotonic(), {}
        self.emit("failure_seen", error=error)
        self.logger.warning(
            "stopped after iteration %d: %s", self.trainer.progress.iteration, error
        )
        after_gen = self.ctx.gen if after_gen is None else after_gen
        while True:
            self.tear_down()
            decision = self.report_and_wait(after_gen)
            self.leave_if_declared_lost(decision)
            if decision.action == Action.ABORT:
                self.stop(decision)
            if self.ctx.slot in decision.released:
                self.release(decision)
            message = peer_failure_of(lambda: self.carry_out(decision))
            if message is None:
                return decision
            after_gen = decision.gen
            self.emit("failure_seen", error=message, during="recovery")

    def carry_out(self, decision: Decision) -> None:
        self.finish_tear_down(decision)
        if decision.action.resizes:
            start, old_rank = time.monotonic(), self.trainer.runtime.rank
            trainer, hooks = rebuild.resize(
                self.ctx, self.builders, self.trainer, self.hooks, decision
            )
            self.slots = None
            self.adopt(trainer, hooks)
            self.resized(decision, start, old_rank)
        else:
            self.rebuild(decision)
            self.restore(decision)

    def tear_down(self) -> None:
        start = time.monotonic()
        self.trainer.abandon_iteration()
        if self.mirror is not None and self.ctx.boundary_announced():
            # Nobody is lost: let the boundary's snapshot reach the buddy,
            # so a grow or a drain redoes no iteration.
            self._mirror_step("drain", self.mirror.wait_idle)
        # Shut this generation's connections down (the heartbeat thread may
        # have done it already): every peer blocked on this rank, and the
        # mirror's exchange, fail at once instead of waiting on sockets
        # that forked processes or live objects keep open. Groups that may
        # be kept stay connected until the decision.
        intact = 0
        if self.slots is None and self.may_keep_groups():
            keepable = self.keepable(self.ctx.current().get("lost", []))
            self.intact = self.ctx.generation.hold(keepable, by="tear_down")
            intact = len(self.intact)
        else:
            self.ctx.generation.release(by="tear_down")
        if self.mirror is not None:
            self._mirror_step("halt", self.mirror.halt)
        if self.slots is not None:
            self.set_aside = None  # kept groups of the failed rebuild go too
            with self.ctx.generation.exclusive():
                regroup.reset()
        elif not self.intact:
            self.intact = None
            self.slots = regroup.detach(self.roots(), self.mirror_roles())
        self.emit(
            "groups_torn_down",
            ms=round((time.monotonic() - start) * 1e3, 1),
            released=self.ctx.generation.released,
            # The groups it may keep that no release reached (none once its
            # heartbeat thread released it whole).
            groups_intact=intact,
        )

    def mirror_roles(self) -> Dict[str, object]:
        """The mirror's pair groups, by role (none without a mirror). No local
        may hold the dict while groups are detached: detach checks none of
        them is left alive."""
        return {} if self.mirror is None else self.mirror.groups.roles()

    def may_keep_groups(self) -> bool:
        """Groups are kept (``adopt`` gave the heartbeat thread ``keepable``)
        and this is a failure (a grow resizes; a drain replaces ranks that
        did not fail, whose groups then go)."""
        return self.ctx.keepable is not None and not self.ctx.boundary_announced()

    def keepable(self, lost) -> List[str]:
        """This rank's groups without a ``lost`` member, but those that carry
        point-to-point traffic (pipeline stages' sends and receives, the
        mirror's pairs): equal counts of issued operations prove only
        collectives matched, not which peer a send was for. (The heartbeat
        thread asks too.)"""
        lost = set(lost)
        roles = regroup.groups_by_role()
        p2p = {id(g) for role, g in roles.items() if role.startswith(P2P_ROLES)}
        p2p |= {id(g) for g in self.mirror.groups.roles().values()}
        return [
            key
            for key, group in self.ctx.generation.made().items()
            if not set(group_members(key)) & lost and id(group) not in p2p
        ]

    def finish_tear_down(self, decision: Decision) -> None:
        """After the decision: the groups it keeps stay (set aside for the
        next generation), every other one goes (its connections shut down
        first)."""
        if self.intact is None:
            return
        keep = {}
        if decision.action == Action.RECOVER:
            keep = {k: g for k, g in self.intact.items() if k in decision.kept}
        self.intact = None
        self.ctx.generation.release(by="rebuild", keep=self.ctx.generation.sockets_of(keep))
        self.set_aside = regroup.set_aside(keep.values())
        self.slots = regroup.detach(self.roots(), self.mirror_roles(), keep=keep.values())

    def enter_built(self, decision: Decision) -> None:
        """The decision's generation is built: this rank trains in it."""
        self.generation_built()
        self.ctx.gen = decision.gen

    def generation_built(self) -> None:
        """Every group of the generation exists: fix the set of connections
        a release shuts down (NCCL groups among them are aborted)."""
        groups = list(regroup.groups_by_role().values())
        if self.mirror is not None:
            groups += self.mirror.groups.roles().values()
        self.ctx.generation.built(groups)

    def _mirror_step(self, name: str, step) -> None:
        try:
            step()
        except MirrorError as error:
            self.emit(f"mirror_{name}_failed", error=str(error))

    def report_and_wait(self, after_gen: int) -> Decision:
        """Report for the newest generation until its decision comes."""
        dp = section(self.config)
        timeout = max(dp.deadpool_recovery_timeout, 10 * dp.deadpool_heartbeat_timeout)
        ctx = self.ctx
        ctx.wait(
            lambda: ctx.current()["gen"] > after_gen,
            timeout,
            "the coordinator to announce a new generation",
        )
        while True:
            gen = ctx.current()["gen"]
            mirror, intact = self.mirror, self.intact or {}
            ctx.post(
                P.Report(
                    gen=gen,
                    rank=self.trainer.runtime.rank,
                    slot=ctx.slot,
                    own=mirror.iterations(Source.OWN) if mirror else [],
                    held=mirror.iterations(Source.HELD) if mirror else [],
                    groups={k: g._get_sequence_number_for_group() for k, g in intact.items()},
                )
            )
            self.emit("reported", for_gen=gen, groups=len(intact))
            self.hooks.faults.at("recovery")
            while ctx.current()["gen"] == gen:
                decision = ctx.decision(gen)
                if decision is not None:
                    self.emit(
                        "decision_received",
                        for_gen=gen,
                        action=decision.action,
                        rollback_to=decision.rollback_to,
                    )
                    return decision
                time.sleep(0.02)

    def depart(self, code: ExitCode, event: str, why: str, **fields) -> NoReturn:
        """Say why in the event log, close it, and leave the job with ``code``
        (through main: WorkerExit)."""
        self.emit(event, reason=why, **fields)
        self.events.close()
        raise WorkerExit(code, why)

    def stop(self, decision: Decision) -> None:
        self.logger.error(
            "deadpool: the job stops: %s. Resume from the last --save "
            "checkpoint with more spare nodes.",
            decision.reason,
        )
        self.depart(ExitCode.ABORTED, "stopping", decision.reason)

    def leave_if_declared_lost(self, decision: Decision) -> None:
        """A decision with no place for this slot (neither a member nor
        released): it was declared lost while it lived (cut off, then
        healed), and others hold its rank. It acts on nothing of it (no
        group, no checkpoint, no copy) and leaves, as its agent does."""
        slot = self.ctx.slot
        if decision.has_place_for(slot):
            return
        why = f"generation {decision.gen} has no place for slot {slot}: it was declared lost"
        self.depart(ExitCode.FENCED, "left_declared_lost", why, for_gen=decision.gen)

    def release(self, decision: Decision) -> None:
        """This rank's replica leaves the job (a shrink): exit, and the agent
        starts a warm spare in this slot. Or its node was drained: exit, and
        the agent ends (the coordinator told it to leave)."""
        drained = self.ctx.node in decision.drained
        why = f"node {self.ctx.node} was drained" if drained else "its replica was dropped"
        self.depart(ExitCode.RELEASED, "released", why, for_gen=decision.gen)

    # ----- the new generation -----
    def rebuild(self, decision: Decision) -> None:
        """The new generation's groups, and every live object re-pointed to
        them. Its stages are timed apart: arriving waits for the slowest
        rank (a spare still building), the rest is the groups' cost."""
        marks = [time.monotonic()]
        rank, config = self.trainer.runtime.rank, self.config
        enter_generation(self.ctx, config, decision, rank, config.world_size)
        marks.append(time.monotonic())
        # Named and recorded, so that a later failure can keep groups
        # (--deadpool-rebuild-groups changed).
        recording = recording_groups(
            self.ctx.generation, decision.kept, records_groups(config), self.set_aside
        )
        with recording as kept:
            # A hot swap keeps the world, so the buddies are the ones planned at setup.
            groups = open_training_groups(config, self.hooks.mirror.buddies)
        self.set_aside = None
        marks.append(time.monotonic())
        regroup.attach(self.roots(), self.slots, groups.roles())
        self.slots = None
        self.enter_built(decision)
        marks.append(time.monotonic())
        ms = [round((b - a) * 1e3, 1) for a, b in zip(marks, marks[1:])]
        self.emit(
            "groups_rebuilt",
            ms=round((marks[-1] - marks[0]) * 1e3, 1),
            arrive_ms=ms[0],
            groups_ms=ms[1],
            attach_ms=ms[2],
            groups_kept=kept,
            **self.ctx.generation.size(),
        )

    def resized(self, decision: Decision, start: float, old_rank: Optional[int]) -> None:
        """The new world is built and restored: train in it from the rollback
        iteration. ``old_rank``: this rank's in the old world (None: a spare
        that a grow brought in)."""
        R = decision.rollback_to
        self.enter_built(decision)
        self.resume_at(decision)
        self.emit(
            "grown" if decision.action == Action.GROW else "shrunk",
            action=decision.action,
            old_rank=old_rank,
            rollback_to=R,
            dp_before=decision.old_dp,
            dp_after=decision.new_dp,
            world_size=decision.world_size,
            planned_world_size=self.config.world.planned_world_size,
            ms=round((time.monotonic() - start) * 1e3, 1),
        )
        if decision.action == Action.CHECKPOINT:
            self.logger.warning(
                "deadpool: generation %d gathered the state of %d data-parallel "
                "replicas on %d, to save iteration %d",
                decision.gen,
                decision.old_dp,
                decision.new_dp,
                R,
            )
            return
        p = self.config.parallel
        self.logger.warning(
            "deadpool: generation %d %s the job from %d to %d data-parallel "
            "replicas (launched with %d); resuming at iteration %d",
            decision.gen,
            "grew" if decision.action == Action.GROW else "shrank",
            decision.old_dp,
            decision.new_dp,
            self.config.planned_world_size
            // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size),
            R + 1,
        )

    def restore(self, decision: Decision) -> None:
        start, R = time.monotonic(), decision.rollback_to
        layout = self.hooks.mirror.layout
        source = restore_from_mirror(self.trainer, self.mirror, layout, decision.from_buddy, R)
        self.resume_at(decision)
        self.emit(
            "state_restored",
            source=source,
            rollback_to=R,
            ms=round((time.monotonic() - start) * 1e3, 1),
        )
        self.logger.info(
            "deadpool: generation %d, resuming at iteration %d (state from %s)",
            decision.gen,
            R + 1,
            source,
        )

    def resume_at(self, decision: Decision) -> None:
        """Training goes on from the rollback iteration (the restore put the
        trainer back there): forget the redone iterations' metrics and tell
        the coordinator."""
        self.trainer.forget_after(decision.rollback_to)
        self.ctx.iteration = decision.rollback_to
        self.ctx.post(
            P.Resumed(gen=decision.gen, rank=self.trainer.runtime.rank, slot=self.ctx.slot)
        )
        self.hooks.recovery.resumed(
            RecoveryReport(
                decision,
                self.config.data_parallel_size,
                self.config.world_size,
                self.failure_seen_at,
                self.stage_ms,
            )
        )


# Roles (megatron-core's parallel_state names) of groups with point-to-point traffic.
P2P_ROLES = ("_PIPELINE_MODEL_PARALLEL_GROUP",)


def prepare_spare(ctx, rank: int, config, builders: Builders, datasets) -> Recovery:
    """A warm spare readies itself for a lost rank: the model and optimizer
    for that position, built against a fake world (its collectives are
    no-ops), with every group swapped for a placeholder. It starts as soon
    as the coordinator names the likely spares, while survivors tear down."""
    start = time.monotonic()
    open_fake_world(rank, config.world_size)
    trainer, hooks = builders.build(config, ctx, datasets=datasets, joining=True)
    trainer.setup()
    rec = Recovery(ctx, trainer, hooks, builders=builders)
    if rec.mirror is None:
        raise RuntimeError("a spare cannot take a rank in a job without a mirror")
    rec.mirror.halt()
    rec.slots = regroup.detach(rec.roots(), rec.mirror.groups.roles())
    rec.emit("spare_built", rank=rank, slot=ctx.slot, ms=round((time.monotonic() - start) * 1e3, 1))
    return rec


def join(rec: Recovery, decision: Decision) -> Recovery:
    """The prepared spare enters the decision's generation and restores."""
    rec.ctx.gen = decision.gen - 1
    message = peer_failure_of(lambda: rec.carry_out(decision))
    if message is not None:
        rec.recover(message, after_gen=decision.gen)
    return rec


def join_grown(ctx, config, builders: Builders, datasets, decision: Decision) -> Recovery:
    """A spare that a grow brings in: it holds no state; its position's
    first rank sends it."""
    start = time.monotonic()
    trainer, hooks = rebuild.grow_into(ctx, config, builders, datasets, decision)
    rec = Recovery(ctx, trainer, hooks, builders=builders)
    rec.resized(decision, start, None)
    return rec
