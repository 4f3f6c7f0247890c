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
  4. joins generation N: default group, megatron's groups and the mirror
     group, and re-points its objects to them (``regroup.attach``);
  5. restores: survivors from their own snapshot of R, a spare from the
     copy its buddy holds (sent over the mirror group, checksum verified);
     the parameters are rebuilt from the shards, then training goes on
     at R, redoing at most the interrupted iteration.

A failure during any of this sends every survivor back to step 1 for the
next generation. A spare joins at step 4, with a model it built for its
position against a fake world (no collectives), re-pointed the same way.
"""

import os
import sys
import time
from typing import Optional

import torch.distributed as dist

from megatron.training.initialize import init_process_groups
from megatron.training.log import get_logger
from megatron.training.training import Trainer, _LogWindow, build_trainer

from deadpool_ext import regroup, resize
from deadpool_ext.config import section
from deadpool_ext.control import STUCK_REPORT_TIMEOUTS
from deadpool_ext.generation import FailureAnnounced, enter_generation
from deadpool_ext.hook import mirror_backend
from deadpool_ext.mirror import MirrorError, new_mirror_group
from deadpool_ext.plan import Decision
from deadpool_ext.restore import restore_snapshot

ABORT_EXIT_CODE = 3
RELEASED_EXIT_CODE = 4  # a shrink dropped this rank's replica: become a spare
MIRROR_ROLE = "deadpool_mirror"


# What a failed collective, a lost buddy or an announcement raises.
RECOVERABLE = (RuntimeError, MirrorError, ConnectionError, TimeoutError)


class Recovery:
    def __init__(self, ctx, trainer: Trainer, mirror_hook, recovery_hook, builders=None):
        """builders: (model_provider, forward_step, make_hooks), what a shrink
        needs to build this rank's objects again for a smaller world."""
        self.ctx = ctx
        self.builders = builders
        self.slots = None  # GroupSlots while the groups are down
        self.injector = None
        self.completed = False  # the loop reached --train-iters
        self.adopt(trainer, mirror_hook, recovery_hook)

    def adopt(self, trainer: Trainer, mirror_hook, recovery_hook) -> None:
        """Train with these objects from now on (at start, and after a shrink)."""
        self.trainer, self.config = trainer, trainer.config
        self.mirror_hook, self.recovery_hook = mirror_hook, recovery_hook
        self.logger = get_logger(trainer.runtime.rank)
        timeout = section(self.config).deadpool_heartbeat_timeout
        self.ctx.stuck_after_s = STUCK_REPORT_TIMEOUTS * timeout
        self.ctx.on_stuck = self._report_stuck
        self._check_between_microbatches()
        if self.injector is not None:
            self.recovery_hook.injector = self.injector
            install_fault_points(trainer, self)

    def _check_between_microbatches(self) -> None:
        """A survivor computing its own microbatches would notice a failure
        only at its next collective with the lost ranks (for a pipeline
        stage, at the end of backward): look at the announced generation
        before every microbatch's forward instead."""
        forward_step, ctx = self.trainer.forward_step, self.ctx

        def forward_unless_announced(data_iterator, model):
            # A grow waits for the iteration boundary (RecoveryHook.before_step).
            if ctx.failure_announced() and not ctx.grow_announced():
                raise FailureAnnounced(f"the coordinator announced generation "
                                       f"{ctx.latest['gen']}")
            return forward_step(data_iterator, model)

        self.trainer.forward_step = forward_unless_announced

    def _report_stuck(self, gen: int, stacks: str) -> None:
        """The heartbeat thread saw generation ``gen`` announced and released
        this rank's connections, yet the main thread still trains: say where
        it is (the coordinator has it killed a heartbeat timeout later)."""
        self.emit("stuck", for_gen=gen, stacks=stacks, released=self.ctx.generation.released,
                  release_error=self.ctx.release_error,
                  connections=self.ctx.generation.open_connections())
        self.logger.error("deadpool: generation %d was announced %.0f s ago and this rank "
                          "has not stopped training; its threads:\n%s", gen,
                          self.ctx.stuck_after_s, stacks)

    @property
    def mirror(self):
        return self.mirror_hook.mirror

    @property
    def events(self):
        return self.mirror_hook.events

    def roots(self) -> dict:
        return {"state": self.trainer.state, "mirror": self.mirror}

    def emit(self, event: str, **fields) -> None:
        self.events.emit(event, gen=self.ctx.gen, iteration=self.trainer.progress.iteration,
                         **fields)

    # ----- the loop -----
    def train(self) -> None:
        while True:
            error = self._train_until_failure()
            if error is None:
                break
            if self.recover(error).action == "checkpoint":
                self.save_and_stop()
                return
        if self.completed:  # not stopped early by a signal or an exit flag (saved then)
            self.trainer.wrap_up()
        self.trainer.finish()

    def save_and_stop(self) -> None:
        """Spares ran out under --deadpool-on-spares-exhausted checkpoint:
        the survivors hold every shard; save them and end without training on."""
        start = time.monotonic()
        self.trainer.save()
        directory = self.config.checkpoint.save
        self.emit("checkpoint_saved", directory=directory,
                  data_parallel_size=self.config.data_parallel_size,
                  ms=round((time.monotonic() - start) * 1e3, 1))
        self.trainer.finish()  # closes the event log
        self.logger.error("deadpool: no spare left; saved iteration %d to %s and stopped. "
                          "Resubmit with --load %s when nodes are back (any data-parallel "
                          "size, the same TP and PP).", self.trainer.progress.iteration,
                          directory, directory)

    def _train_until_failure(self) -> Optional[str]:
        try:
            self.completed = self.trainer.loop()
            return None
        except RECOVERABLE as error:
            # Only the text leaves this block: the traceback's frames hold
            # references to the old groups.
            return f"{type(error).__name__}: {str(error)[:300]}"

    # ----- survivor -----
    def recover(self, error: str, after_gen: Optional[int] = None) -> Decision:
        """Until a generation after ``after_gen`` (default: this one) resumes;
        returns its decision."""
        self.ctx.state = "recovering"
        self.emit("failure_seen", error=error)
        self.logger.warning("stopped after iteration %d: %s", self.trainer.progress.iteration,
                            error)
        after_gen = self.ctx.gen if after_gen is None else after_gen
        while True:
            self.tear_down()
            decision = self.report_and_wait(after_gen)
            if decision.action == "abort":
                self.stop(decision)
            if self.ctx.slot in decision.released:
                self.release(decision)
            try:
                if decision.action in ("shrink", "grow", "checkpoint"):
                    resize.resize(self, decision)
                else:
                    self.rebuild(decision)
                    self.restore(decision)
                return decision
            except RECOVERABLE as failure:
                message = f"{type(failure).__name__}: {str(failure)[:300]}"
            after_gen = decision.gen
            self.emit("failure_seen", error=message, during="recovery")

    def tear_down(self) -> None:
        start = time.monotonic()
        if self.mirror is not None and self.ctx.grow_announced():
            # Nobody is lost: let the boundary's snapshot reach the buddy,
            # so a grow redoes no iteration.
            self._mirror_step("drain", self.mirror.wait_idle)
        # Shut this generation's connections down (the heartbeat thread may
        # have done it already): every peer blocked on this rank, and the
        # mirror's exchange, fail at once instead of waiting on sockets
        # that forked processes or live objects keep open.
        self.ctx.generation.release(by="tear_down")
        if self.mirror is not None:
            self._mirror_step("halt", self.mirror.halt)
        if self.slots is None:
            # No local may hold a group (detach checks that none is left alive).
            self.slots = regroup.detach(
                self.roots(), {} if self.mirror is None else {MIRROR_ROLE: self.mirror.group})
        else:
            regroup.reset()
        self.emit("groups_torn_down", ms=round((time.monotonic() - start) * 1e3, 1),
                  released=self.ctx.generation.released)

    def generation_built(self) -> None:
        """Every group of the generation exists: fix the set of connections
        a release shuts down (NCCL groups among them are aborted)."""
        groups = list(regroup.groups_by_role().values())
        if self.mirror is not None:
            groups.append(self.mirror.group)
        self.ctx.generation.built(groups)

    def _mirror_step(self, name: str, step) -> None:
        try:
            step()
        except MirrorError as error:
            self.emit(f"mirror_{name}_failed", error=str(error))

    def report_and_wait(self, after_gen: int) -> Decision:
        """Report for the newest generation until its decision comes."""
        timeout = max(120.0, 10 * section(self.config).deadpool_heartbeat_timeout)
        ctx = self.ctx
        ctx.wait(lambda: ctx.current()["gen"] > after_gen, timeout, "the coordinator to "
                 "announce a new generation")
        while True:
            gen = ctx.current()["gen"]
            mirror = self.mirror
            ctx.post(kind="report", gen=gen, rank=self.trainer.runtime.rank, slot=ctx.slot,
                     own=mirror.iterations("own") if mirror else [],
                     held=mirror.iterations("held") if mirror else [])
            self.emit("reported", for_gen=gen)
            if self.injector is not None:
                self.injector.at("recovery")
            while ctx.current()["gen"] == gen:
                decision = ctx.decision(gen)
                if decision is not None:
                    self.emit("decision_received", for_gen=gen, action=decision.action,
                              rollback_to=decision.rollback_to)
                    return decision
                time.sleep(0.02)

    def stop(self, decision: Decision) -> None:
        self.emit("stopping", reason=decision.reason)
        self.logger.error("deadpool: the job stops: %s. Resume from the last --save "
                          "checkpoint with more spare nodes.", decision.reason)
        self.events.close()
        sys.stdout.flush()
        os._exit(ABORT_EXIT_CODE)

    def release(self, decision: Decision) -> None:
        """This rank's replica leaves the job (a shrink): exit, and the agent
        starts a warm spare in this slot."""
        self.emit("released", for_gen=decision.gen, reason="its replica was dropped")
        self.events.close()
        sys.stdout.flush()
        os._exit(RELEASED_EXIT_CODE)

    # ----- the new generation -----
    def enter_generation(self, decision: Decision, rank: int, world_size: int) -> None:
        enter_generation(self.ctx, self.config, decision, rank, world_size)

    def rebuild(self, decision: Decision) -> None:
        start = time.monotonic()
        self.enter_generation(decision, self.trainer.runtime.rank, self.config.world_size)
        init_process_groups(self.config)
        group = new_mirror_group(mirror_backend(self.config),
                                 section(self.config).deadpool_mirror_timeout)
        regroup.attach(self.roots(), self.slots, {MIRROR_ROLE: group})
        self.slots = None
        self.generation_built()
        self.ctx.gen = decision.gen
        self.emit("groups_rebuilt", ms=round((time.monotonic() - start) * 1e3, 1))

    def restore(self, decision: Decision) -> None:
        start = time.monotonic()
        rank, mirror, R = self.trainer.runtime.rank, self.mirror, decision.rollback_to
        requests = []
        for lost in decision.from_buddy:  # the buddy sends its copy to the new process
            if mirror.owner == lost and rank != lost:
                held = mirror.held[mirror.find("held", R)]
                requests.append(dist.isend(held, lost, group=mirror.group))
        if rank in decision.from_buddy:
            source, index = "buddy", 0
            requests.append(dist.irecv(mirror.own[0], mirror.buddy, group=mirror.group))
        else:
            source, index = "own", mirror.find("own", R)
        for request in requests:
            request.wait()
        restore_snapshot(self.trainer, self.mirror_hook.layout, mirror.own[index], iteration=R)
        mirror.resume(index)
        self.resume_at(decision)
        self.emit("state_restored", source=source, rollback_to=R,
                  ms=round((time.monotonic() - start) * 1e3, 1))
        self.logger.info("deadpool: generation %d, resuming at iteration %d (state from %s)",
                         decision.gen, R + 1, source)


    def resume_at(self, decision: Decision) -> None:
        """Training goes on from the rollback iteration: forget the redone
        iterations' metrics and tell the coordinator."""
        R = decision.rollback_to
        if self.trainer.metrics is not None:
            self.trainer.metrics.rewind(R)
        self.trainer.window = _LogWindow()
        self.ctx.iteration = R
        self.ctx.post(kind="resumed", gen=decision.gen, rank=self.trainer.runtime.rank)
        self.recovery_hook.recovered_at = time.monotonic()


def prepare_spare(ctx, rank: int, config, builders, datasets) -> Recovery:
    """A warm spare readies itself for a lost rank: the model and optimizer
    for that position, built against a fake world (its collectives are
    no-ops), with every group swapped for a placeholder. It starts as soon
    as the coordinator names the likely spares, while survivors tear down."""
    import torch.testing._internal.distributed.fake_pg as fake_pg

    start = time.monotonic()
    model_provider, forward_step, make_hooks = builders
    hooks = make_hooks(config, ctx)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank,
                            world_size=config.world_size)
    trainer = build_trainer(config, model_provider, forward_step, list(hooks),
                            datasets=datasets)
    trainer.joining = True
    trainer.setup()
    rec = Recovery(ctx, trainer, *hooks, builders=builders)
    if rec.mirror is None:
        raise RuntimeError("a spare cannot take a rank in a job without a mirror")
    rec.mirror.halt()
    rec.slots = regroup.detach(rec.roots(), {MIRROR_ROLE: rec.mirror.group})
    rec.emit("spare_built", rank=rank, slot=ctx.slot,
             ms=round((time.monotonic() - start) * 1e3, 1))
    return rec


def join(rec: Recovery, decision: Decision) -> Recovery:
    """The prepared spare enters the decision's generation and restores."""
    rec.ctx.gen = decision.gen - 1
    try:
        rec.rebuild(decision)
        rec.restore(decision)
        return rec
    except RECOVERABLE as failure:
        message = f"{type(failure).__name__}: {str(failure)[:300]}"
    rec.recover(message, after_gen=decision.gen)
    return rec


def join_grown(ctx, config, builders, datasets, decision: Decision) -> Recovery:
    """A spare that a grow brings in: it holds no state; its position's
    first rank sends it."""
    start = time.monotonic()
    trainer, hooks = resize.grow_into(ctx, config, builders, datasets, decision)
    rec = Recovery(ctx, trainer, *hooks, builders=builders)
    resize.finish(rec, decision, start, None)
    return rec


def install_fault_points(trainer: Trainer, rec: Recovery) -> None:
    """Where --deadpool-inject phases fire (the iteration is Megatron's
    1-based number of the iteration in progress)."""
    injector, state = rec.injector, trainer.state

    def current() -> int:
        return trainer.progress.iteration + 1

    forward_step = trainer.forward_step

    def forward_with_faults(data_iterator, model):
        injector.at("forward", current())
        output, loss = forward_step(data_iterator, model)
        if output.requires_grad:
            output.register_hook(lambda grad: injector.at("backward", current()) or grad)
        return output, loss

    trainer.forward_step = forward_with_faults
    finalize = state.tf_config.finalize_model_grads_func

    def finalize_with_faults(*args, **kwargs):
        injector.at("grad-reduce", current())
        return finalize(*args, **kwargs)

    state.tf_config.finalize_model_grads_func = finalize_with_faults
    for chunk in state.model:
        sync = chunk.start_param_sync

        def sync_with_faults(*args, _sync=sync, **kwargs):
            injector.at("optimizer", current())
            return _sync(*args, **kwargs)

        chunk.start_param_sync = sync_with_faults
    if rec.mirror is not None:
        rec.mirror.before_exchange = lambda iteration: injector.at("mirror", iteration + 1)
