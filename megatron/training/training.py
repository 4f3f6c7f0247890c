"""A short training loop with hooks: setup, train_step, evaluate, save.

Extensions (the deadpool mirror, recovery and fault injection) plug in
through ``Hook`` methods rather than by copying the loop or replacing any
attribute of the trainer or of megatron-core's objects: the trainer itself
calls its hooks before every microbatch, before the gradient reduction,
before the parameter all-gather and around every step, and ``restart_at``
puts it back at any progress.
"""

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunMode,
    RerunState,
    get_rerun_state_machine,
)
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron.training import checkpoint_files, checkpointing, data, moe_metrics, saving
from megatron.training.config import Config
from megatron.training.arguments import ConfigError
from megatron.training.cuda_graphs import cuda_graph_hooks
from megatron.training.replica_check import replica_check_hooks
from megatron.training.fim import sentinel_ids, token_id
from megatron.training.hooks import Hook  # noqa: F401 - extensions import it from here too
from megatron.training.dashboards import Dashboards
from megatron.training.initialize import Runtime, initialize
from megatron.training.log import (
    MetricsFile,
    flops_per_iteration,
    get_logger,
    training_log_line,
    validation_log_line,
)
from megatron.training.model_setup import TrainState, chunk_ends, setup_model_and_optimizer
from megatron.training.profiling import Profiler
from megatron.training.timing import build_timers, timer_names, timer_scalars
from megatron.training.schedule import GlobalBatch
from megatron.training.signals import ExitSignalHandler
from megatron.training.tokenizer import build_tokenizer


class NothingToResume(Exception):
    """--exit-on-missing-checkpoint and no checkpoint to load: the run ends
    before its first iteration, with exit code 0 as Megatron-LM's does."""


@dataclass
class Progress:
    """Where training stands; checkpointed and restored as a whole."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    floating_point_operations: float = 0.0  # so far, as Megatron-LM counts them


@dataclass(frozen=True)
class MicrobatchPosition:
    """A training microbatch's place: its model chunk, its number among this
    rank's microbatches of the iteration, and the index of its first sample
    in the run, which is the same whichever data-parallel rank runs it
    (data.MicrobatchSampler's order)."""

    chunk: int
    number: int
    first_sample: int


@dataclass
class _LogWindow:
    """Sums since the last log line, for Megatron's interval averages."""

    iterations: int = 0
    seconds: float = 0.0
    losses: Dict[str, float] = field(default_factory=dict)
    skipped: int = 0  # Megatron-LM counts these per log interval
    nans: int = 0

    def add(self, seconds: float, losses: Dict[str, float], skipped: bool) -> None:
        self.iterations += 1
        self.seconds += seconds
        self.skipped += int(skipped)
        self.nans += int(is_nan(losses.get("lm loss")))
        for name, value in losses.items():
            self.losses[name] = self.losses.get(name, 0.0) + value


def is_nan(loss: Optional[float]) -> bool:
    return loss is not None and loss != loss


def _pair_sum(values: List[torch.Tensor]) -> torch.Tensor:
    """[sum, count] of microbatch losses: [sum, tokens] pairs, or single values."""
    stacked = torch.stack([v.detach().float().view(-1) for v in values])
    if stacked.shape[1] == 1:
        stacked = torch.cat([stacked, torch.ones_like(stacked)], dim=1)
    return stacked.sum(dim=0)


ForwardStep = Callable  # (data_iterator, model) -> (output, loss_func)


class Trainer:
    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        state: TrainState,
        forward_step: ForwardStep,
        datasets,
        hooks=(),
        joining: bool = False,
    ):
        """joining: a process joining a running job (a spare) restores its
        state from peers instead of loading, and appends to the metrics file
        it takes over."""
        self.config = config
        self.runtime = runtime
        self.state = state
        self.forward_step = forward_step
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.hooks = list(hooks)
        self.joining = joining
        # The schedules call back into the trainer, which calls its hooks.
        state.tf_config.finalize_model_grads_func = self._finalize_grads
        # The optimizer starts the chunks' all-gathers in order: the first
        # chunk's is the iteration's first.
        state.model[0].register_param_sync_hook(self._before_param_sync)
        self.progress = Progress()
        self.logger = get_logger(runtime.rank)
        self.forward_backward = get_forward_backward_func()
        self.signal_handler = (
            ExitSignalHandler().install() if config.logging.exit_signal_handler else None
        )
        self.metrics = None
        self.dashboards = None  # TensorBoard and W&B, once set up
        self.window = _LogWindow()
        self.train_iterator = None
        # The training microbatch in forward (for hooks; None outside
        # training's forward-backward), and each chunk's count so far.
        self.microbatch: Optional[MicrobatchPosition] = None
        self.stepping = False  # in the optimizer's step (before_param_sync's window)
        self._microbatches_started: Optional[List[int]] = None
        # 0, or the code the run stops with when a result failed validation
        # (megatron-core's rerun state machine: 16 resume elsewhere, 17 failed).
        self.exit_code = 0
        self.saves = saving.Saves(config, self.logger)
        self.start_time = time.time()
        self.global_batch = GlobalBatch(config)
        self._last_batch_size = None  # of the iteration before: a ramp step saves
        self.megatron_calculator = self._init_megatron_calculator()
        self.profiler = Profiler(config, runtime.rank)
        # megatron-core's schedules, gradient reduction and optimizer time
        # their parts with these (--timing-log-level).
        self.timers = state.tf_config.timers = build_timers(config)
        state.optimizer.config.timers = self.timers

    def _init_megatron_calculator(self) -> bool:
        """megatron-core's global microbatch count, which only its CUDA
        graphs read; a shrunk job's uneven quotas live in num_microbatches
        instead (not set then)."""
        b, dp = self.config.batch, self.config.data_parallel_size
        unset_num_microbatches_calculator()  # a shrunk job builds again in the same process
        if any(size % (b.micro_batch_size * dp) for size in self.global_batch.steps()):
            return False
        init_num_microbatches_calculator(
            self.runtime.rank, b.rampup_batch_size, b.global_batch_size, b.micro_batch_size, dp
        )
        return True

    # ----- hook points inside megatron-core's schedule and optimizer -----
    def _call(self, name: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, name)(self, *args)

    def _forward_step(self, data_iterator, model, **options):
        """A microbatch (training or validation): hooks around the user's
        forward step. megatron-core's combined 1F1B schedule asks for a
        schedule plan instead of the output (``return_schedule_plan``);
        hooks then see no output (that schedule is refused under --deadpool,
        whose hooks read it)."""
        self.microbatch = self._next_position(model)
        self._call("before_microbatch")
        output, loss_func = self.forward_step(data_iterator, model, **options)
        if not options.get("return_schedule_plan"):
            self._call("after_forward", output)
        return output, loss_func

    def _next_position(self, model) -> Optional[MicrobatchPosition]:
        """The position of the training microbatch about to run on ``model``
        (a chunk's microbatches run in order in every schedule); None in
        validation."""
        if self._microbatches_started is None:
            return None
        chunk = self._chunk_index(model)
        number = self._microbatches_started[chunk]
        self._microbatches_started[chunk] += 1
        slot = number * self.config.data_parallel_size + self.runtime.dp_rank
        first = self.progress.consumed_samples + slot * self.config.batch.micro_batch_size
        return MicrobatchPosition(chunk, number, first)

    def _chunk_index(self, model) -> int:
        """Which model chunk ``model`` is: a chunk, or the model inside its
        wrappers (megatron-core's combined 1F1B schedule passes that)."""
        for index, chunk in enumerate(self.state.model):
            wrapped = chunk
            while wrapped is not None:
                if wrapped is model:
                    return index
                wrapped = getattr(wrapped, "module", None)
        raise ValueError("the schedule ran a model that is none of the trainer's chunks")

    def _finalize_grads(self, *args, **kwargs):
        self._call("before_grad_reduce")
        return finalize_model_grads(*args, **kwargs)

    def _before_param_sync(self) -> None:
        """Only for the step's all-gather: a restore gathers too."""
        if self.stepping:
            self._call("before_param_sync")

    def restart_at(self, progress: Progress) -> None:
        """Go on from ``progress`` (a restored state's): read data from there."""
        self.progress = progress
        self._last_batch_size = None
        forget_interrupted_step()
        self.saves.abandon()
        self.reset_train_iterator()
        if self.dashboards is not None:
            self.dashboards.rewind(progress.iteration, progress.consumed_samples)

    def abandon_iteration(self) -> None:
        """The iteration in progress stopped midway (a peer failed) and will
        be redone from a restored state."""
        moe_metrics.abandon()
        forget_interrupted_step()

    def forget_after(self, iteration: int) -> None:
        """Iterations after ``iteration`` will be redone: drop their metrics
        lines and the log window's sums."""
        if self.metrics is not None:
            self.metrics.rewind(iteration)
        if self.dashboards is not None:  # the state is back at ``iteration`` already
            self.dashboards.rewind(iteration, self.progress.consumed_samples)
        self.window = _LogWindow()

    # ----- data -----
    @property
    def batch_size(self) -> int:
        """The global batch of the next iteration (--rampup-batch-size)."""
        return self.global_batch.at(self.progress.consumed_samples)

    @property
    def num_microbatches(self) -> int:
        """This replica's share of the next iteration's global batch."""
        return self.microbatches(self.batch_size)

    def microbatches(self, global_batch_size: int) -> int:
        """This replica's share of a global batch (uneven after a shrink)."""
        return data.microbatches_per_iteration(
            global_batch_size,
            self.config.batch.micro_batch_size,
            self.runtime.dp_rank,
            self.config.data_parallel_size,
        )

    def scale_gradients_by_quota(self) -> None:
        """DDP averages gradients over DP (x 1/DP), each replica having
        averaged its own microbatches (x 1/quota). With uneven quotas the
        global mean needs x quota/slots instead: set it on every bucket
        (quota/slots is 1/DP exactly when the quotas are even). Per-token
        loss needs nothing: gradients are summed, then divided by the
        tokens of all replicas."""
        b, dp = self.config.batch, self.config.data_parallel_size
        slots = self.batch_size // b.micro_batch_size
        if self.config.training.calculate_per_token_loss:
            return
        if slots % dp == 0 and not self.global_batch.ramps:
            return  # Megatron's own 1/DP is already exact
        factor = self.num_microbatches / slots
        for chunk in self.state.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                for bucket in buffer.buckets:
                    bucket.gradient_scaling_factor = factor

    def data_iterator(self, dataset, consumed_samples: int, training: bool = True):
        """Only the first and last pipeline stages read data. With virtual
        stages, one entry per model chunk (as the interleaved schedule
        takes them): the iterator for the chunk that is the first or last
        virtual stage, None for the others."""
        readers = [first or last for first, last in chunk_ends(len(self.state.model))]
        iterator = data.build_iterator(
            dataset if any(readers) else None,
            consumed_samples,
            self.config,
            self.runtime.dp_rank,
            self.config.data_parallel_size,
            self.runtime.on_cpu,
            ramp=training,
        )
        if len(readers) == 1:
            return iterator
        return [iterator if reads else None for reads in readers]

    def reset_train_iterator(self) -> None:
        iterator = self.data_iterator(self.train_ds, self.progress.consumed_samples)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            iterator = replayable(iterator)  # a rerun reads the iteration's microbatches again
        self.train_iterator = iterator

    # ----- checkpoints -----
    def load(self) -> None:
        c = self.config.checkpoint
        start = time.perf_counter()
        found = checkpoint_files.checkpoint_to_load(c)
        if found is None and c.pretrained_checkpoint:
            # As Megatron-LM: fine-tune from it when --load holds nothing yet.
            self.logger.info(
                "no checkpoint in --load %s: fine-tuning from --pretrained-checkpoint %s",
                c.load,
                c.pretrained_checkpoint,
            )
            c.finetune = True
            found = checkpoint_files.saved_in(c.pretrained_checkpoint)
        if found is None:
            if c.exit_on_missing_checkpoint and c.load:  # without --load it has no effect
                raise NothingToResume(
                    f"no checkpoint in --load {c.load} and --exit-on-missing-checkpoint is set"
                )
            if c.load:
                self.logger.info("no checkpoint in %s: starting from scratch", c.load)
            return
        # torch_dist, or Megatron-LM's legacy torch format (told from the directory)
        loaded = checkpointing.load_checkpoint(found, self.config, self.state)
        self.progress.iteration = loaded.iteration
        self.progress.consumed_samples = loaded.consumed_samples
        self.progress.floating_point_operations = loaded.floating_point_operations
        self.logger.info(
            "resumed from %s at iteration %d (loaded in %.2f s)",
            found.root,
            self.progress.iteration,
            time.perf_counter() - start,
        )

    def save(self, wait: bool = False, non_persistent: bool = False) -> Optional[saving.Outcome]:
        """Collective. A save that fails to write is reported and training
        goes on (saving.py). With ``wait``, an asynchronous save is ended
        too; its outcome is returned. A non-persistent save replaces the
        one before it (--non-persistent-save-interval)."""
        c = self.config.checkpoint
        if not c.save:
            return None
        self._saved(self.saves.wait())  # the one before, if still in flight
        self._call("before_save")
        root = checkpoint_files.non_persistent_dir(c, c.save) if non_persistent else c.save
        # The rerun state machine's state, when it wants the run resumed from here.
        rerun = get_rerun_state_machine().state_dict(self.train_iterator, "torch_dist")
        ended = self.saves.save(
            self.progress, self.state, root, keep_only_latest=non_persistent, rerun=rerun
        )
        return self._saved(ended or (self.saves.wait() if wait else None))

    def _saved(self, outcome: Optional[saving.Outcome]) -> Optional[saving.Outcome]:
        if outcome is not None:
            self._call("after_save", outcome)
        return outcome

    # ----- one iteration -----
    def train_step(self) -> Optional[dict]:
        """Forward, backward, optimizer step; returns this iteration's metrics,
        or None where a result failed validation and the run stops."""
        state, cfg, batch_size = self.state, self.config, self.batch_size
        if self.global_batch.ramps:
            self.scale_gradients_by_quota()
            if self.megatron_calculator:
                update_num_microbatches(self.progress.consumed_samples, consistency_check=True)
        machine = get_rerun_state_machine()
        if machine.state == RerunState.NOT_RUNNING_YET:  # not resumed to rerun an iteration
            # The machine counts from here: its messages name iteration + 1, as Megatron-LM's.
            machine.current_iteration = self.progress.iteration
        # Once, or again where a result failed validation (--rerun-mode).
        while machine.should_run_forward_backward(self.train_iterator):
            for chunk in state.model:
                chunk.zero_grad_buffer()
            state.optimizer.zero_grad()
            self._microbatches_started = [0] * len(state.model)
            try:
                losses = self.forward_backward(
                    forward_step_func=self._forward_step,
                    data_iterator=self.train_iterator,
                    model=state.model,
                    num_microbatches=self.num_microbatches,
                    seq_length=cfg.model.seq_length,
                    micro_batch_size=cfg.batch.micro_batch_size,
                    forward_only=False,
                )
            finally:
                self._microbatches_started, self.microbatch = None, None
        checkpoint, stop, code = machine.should_checkpoint_and_exit()
        if stop:
            self.stop_on_failed_validation(checkpoint, code)
            return None
        self.empty_unused_memory(level=1)
        self._call("before_optimizer_step")
        self.timers("optimizer", log_level=1).start(barrier=True)
        self.stepping = True
        try:
            update_successful, grad_norm, num_zeros = state.optimizer.step()
        finally:
            self.stepping = False
        self.timers("optimizer").stop()
        if update_successful:
            state.scheduler.step(increment=batch_size)
        self.empty_unused_memory(level=2)
        aux_losses, aux_scalars = moe_metrics.aux_losses(
            cfg, self.num_microbatches, self.progress.iteration + 1
        )
        return {
            "losses": self.reduce_losses(losses),
            "aux_losses": aux_losses,  # MoE: in the log line, after the losses
            "aux_scalars": aux_scalars,  # MoE: to the dashboards every iteration
            "grad_norm": grad_norm,
            "num_zeros": num_zeros,  # --log-num-zeros-in-grad (else None)
            "params_norm": params_l2_norm(state.model) if cfg.logging.log_params_norm else None,
            "skipped": not update_successful,
            "batch_size": batch_size,
        }

    def stop_on_failed_validation(self, checkpoint: bool, code: int) -> None:
        """As Megatron-LM: the state before the iteration saved where the rerun
        state machine asks (with --save), and the run ends with its exit code."""
        self.logger.warning(
            "result validation stops the run before iteration %d (exit code %d)",
            self.progress.iteration + 1,
            code,
        )
        if checkpoint and self.config.checkpoint.save:
            self.save(wait=True)
            self.just_saved = "persistent"
        self.exit_code = code

    def empty_unused_memory(self, level: int) -> None:
        """--empty-unused-memory-level: the CUDA allocator's cache (none on CPU)."""
        if self.config.training.empty_unused_memory_level >= level and not self.runtime.on_cpu:
            torch.cuda.empty_cache()

    def collect_garbage(self, generation: int = 2) -> None:
        """--manual-gc: Python's collector runs here, at the same point on every rank."""
        if self.config.training.manual_gc:
            gc.collect(generation)

    def reduce_losses(self, microbatch_losses: List[dict]) -> Dict[str, float]:
        """Each reported loss over the global batch (Megatron-LM's)."""
        return {n: (s[0] / s[1]).item() for n, s in self.loss_sums(microbatch_losses).items()}

    def loss_sums(self, microbatch_losses: List[dict]) -> Dict[str, torch.Tensor]:
        """Each reported loss as [sum, count] over all replicas: Megatron-LM's
        [loss sum, tokens] pairs as they are, a single value per microbatch
        as [value, 1] (so uneven quotas weigh right). Only the last pipeline
        stage has them."""
        if not parallel_state.is_pipeline_last_stage() or not microbatch_losses:
            return {}
        names = list(microbatch_losses[0])
        sums = torch.stack([_pair_sum([mb[n] for mb in microbatch_losses]) for n in names])
        # Context-parallel ranks each hold part of every sequence's tokens.
        dist.all_reduce(sums, group=data_parallel_group_with_context())
        return dict(zip(names, sums))

    # ----- validation -----
    def evaluate(self, dataset, consumed: int) -> Dict[str, float]:
        """--eval-iters global batches of ``dataset`` from sample ``consumed``."""
        cfg = self.config
        iterator = self.data_iterator(dataset, consumed, training=False)
        for chunk in self.state.model:
            chunk.eval()
        # As Megatron-LM: validation's results are checked, never rerun.
        machine = get_rerun_state_machine()
        mode = machine.get_mode()
        machine.set_mode(RerunMode.DISABLED)
        totals: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for _ in range(cfg.logging.eval_iters):
                losses = self.forward_backward(
                    forward_step_func=self._forward_step,
                    data_iterator=iterator,
                    model=self.state.model,
                    num_microbatches=self.microbatches(cfg.batch.global_batch_size),
                    seq_length=cfg.model.seq_length,
                    micro_batch_size=cfg.batch.micro_batch_size,
                    forward_only=True,
                )
                for name, pair in self.loss_sums(losses).items():
                    totals[name] = totals.get(name, 0.0) + pair
        machine.set_mode(mode)
        for chunk in self.state.model:
            chunk.train()
        if cfg.moe.num_experts is not None:
            moe_metrics.forget()  # validation's router losses are not training's
        return {name: (pair[0] / pair[1]).item() for name, pair in totals.items()}

    def maybe_validate(self, final: bool = False) -> None:
        cfg, it = self.config.logging, self.progress.iteration
        if cfg.eval_iters == 0 or self.valid_ds is None:
            return
        if not final and it % cfg.eval_interval != 0:
            return
        index = (
            self.config.training.train_iters // cfg.eval_interval
            if final
            else it // cfg.eval_interval - 1
        )
        consumed = index * cfg.eval_iters * self.config.batch.global_batch_size
        self.report_evaluation(
            self.valid_ds, consumed, f"iteration {it}" + (" on validation set" if final else "")
        )

    def test(self) -> None:
        """As Megatron-LM after training: --eval-iters batches of the test
        split from its start, reported as a validation (its tags too)."""
        if self.config.logging.eval_iters and self.test_ds is not None:
            where = f"iteration {self.progress.iteration} on test set"
            self.report_evaluation(self.test_ds, 0, where)

    def report_evaluation(self, dataset, consumed: int, where: str) -> None:
        cfg, it = self.config.logging, self.progress.iteration
        if self.config.training.manual_gc_eval:
            self.collect_garbage()
        losses = self.evaluate(dataset, consumed)
        if self.config.training.manual_gc_eval:
            self.collect_garbage(generation=0)  # what validation made
        if self.runtime.is_last_rank:
            line = validation_log_line(where, losses)
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
            self.dashboards.scalars(
                validation_scalars(losses, cfg), it, self.progress.consumed_samples
            )

    # ----- the loop -----
    def setup(self) -> None:
        if self.config.training.manual_gc:
            gc.disable()  # as Megatron-LM: collections only where collect_garbage runs
            gc.collect()
        if not self.joining:
            self.load()
        self.reset_train_iterator()
        self.metrics = MetricsFile(
            self.config.logging.metrics_file if self.runtime.is_last_rank else None,
            append=self.progress.iteration > 0 or self.joining,
        )
        p = self.progress
        self.dashboards = Dashboards(
            self.config, self.runtime.is_last_rank, (p.iteration, p.consumed_samples)
        )
        self._call("on_setup")
        self.profiler.begin()

    def train(self) -> Progress:
        self.setup()
        if self.loop():
            self.wrap_up()
        self.finish()
        return self.progress

    def wrap_up(self) -> None:
        """After the last iteration: final validation, the test split, and
        the checkpoint."""
        self.maybe_validate(final=True)
        self.test()
        if self.config.checkpoint.save and self.just_saved != "persistent":
            self.save()

    def loop(self, until: Optional[int] = None) -> bool:
        """Train up to iteration ``until`` (default --train-iters); False if
        a signal or exit flag stopped it first."""
        until = self.config.training.train_iters if until is None else until
        while self.progress.iteration < until:
            # The log line's time is the whole iteration, hooks included (as
            # Megatron-LM's interval timer); the metrics file's is the step's.
            began = time.perf_counter()
            self.save_at_a_ramp_step()
            self.profiler.before_iteration(self.progress.iteration)
            self._call("before_step")
            start = time.perf_counter()
            metrics = self.train_step()
            if metrics is None:  # a result failed validation
                return False
            metrics["seconds"] = time.perf_counter() - start
            self.advance(metrics)
            self.profiler.after_iteration(self.progress.iteration)
            self._call("after_step", metrics)
            self.window.add(
                time.perf_counter() - began,
                {**metrics["losses"], **metrics["aux_losses"]},
                metrics["skipped"],
            )
            self.record(metrics, self.window)
            interval = self.config.training.manual_gc_interval
            if interval and self.progress.iteration % interval == 0:
                self.collect_garbage()
            self._saved(self.saves.poll())
            if self.maybe_save_and_exit():
                return False
        return True

    def advance(self, metrics: dict) -> None:
        p = self.progress
        p.iteration += 1
        p.consumed_samples += metrics["batch_size"]
        p.floating_point_operations += flops_per_iteration(self.config, metrics["batch_size"])
        p.skipped_iterations += int(metrics["skipped"])
        p.nan_iterations += int(is_nan(metrics["losses"].get("lm loss")))

    def record(self, metrics: dict, window: _LogWindow) -> None:
        """Metrics file every iteration; the log line every --log-interval."""
        p, cfg = self.progress, self.config
        lr = self.state.optimizer.param_groups[0]["lr"]
        if self.runtime.is_last_rank:
            self.metrics.write(
                {
                    "iteration": p.iteration,
                    "consumed_samples": p.consumed_samples,
                    "lm_loss": metrics["losses"].get("lm loss"),
                    "grad_norm": metrics["grad_norm"],
                    "lr": lr,
                    "loss_scale": self.state.optimizer.get_loss_scale().item(),
                    "skipped": metrics["skipped"],
                    "seconds": metrics["seconds"],
                    **metrics["aux_losses"],  # MoE: the routers' losses, by Megatron-LM's names
                    **{
                        k: metrics[k]
                        for k in ("num_zeros", "params_norm")
                        if metrics[k] is not None
                    },
                }
            )
        if metrics["aux_scalars"]:  # every iteration, as Megatron-LM
            self.dashboards.scalars(metrics["aux_scalars"], p.iteration, None)
        if self.dashboards.active and p.iteration % cfg.logging.tensorboard_log_interval == 0:
            self.dashboards.scalars(
                self.iteration_scalars(metrics, lr), p.iteration, p.consumed_samples
            )
        if p.iteration % cfg.logging.log_interval == 0 or p.iteration == 1:
            self.print_log_line(metrics, window, lr)
            self.log_timers(window.iterations)
            window.__init__()
        self.maybe_validate()

    def iteration_scalars(self, metrics: dict, lr: float) -> Dict[str, float]:
        """This iteration's TensorBoard / W&B scalars, Megatron-LM's names."""
        log = self.config.logging
        values = {"learning-rate": lr, "batch-size": metrics["batch_size"]}
        values.update(metrics["losses"])
        if log.log_loss_scale_to_tensorboard:
            values["loss-scale"] = self.state.optimizer.get_loss_scale().item()
        if log.log_world_size_to_tensorboard:
            values["world-size"] = self.runtime.world_size
        if metrics["grad_norm"] is not None:
            values["grad-norm"] = metrics["grad_norm"]
        for name, key in (("num-zeros", "num_zeros"), ("params-norm", "params_norm")):
            if metrics[key] is not None:
                values[name] = metrics[key]
        if log.log_memory_to_tensorboard:
            values.update(cuda_memory_scalars())
        return values

    def print_log_line(self, metrics: dict, window: _LogWindow, lr: float) -> None:
        extra = [f for hook in self.hooks for f in hook.log_fields(self)]
        if not self.runtime.is_last_rank:
            return
        cfg, p = self.config, self.progress
        elapsed = window.seconds / max(1, window.iterations)
        tflops = None
        if cfg.logging.log_throughput:
            tflops = (
                flops_per_iteration(cfg, metrics["batch_size"])
                / elapsed
                / self.runtime.world_size
                / 1e12
            )
        losses = {n: v / window.iterations for n, v in window.losses.items()}
        if cfg.logging.log_timers_to_tensorboard and p.iteration > 1:  # as Megatron-LM
            timed = {"iteration-time": elapsed}
            timed.update({} if tflops is None else {"throughput": tflops})
            self.dashboards.scalars(timed, p.iteration, None)
        print(
            training_log_line(
                p.iteration,
                cfg.training.train_iters,
                p.consumed_samples,
                elapsed * 1000.0,
                lr,
                metrics["batch_size"],
                losses,
                self.state.optimizer.get_loss_scale().item(),
                metrics["grad_norm"],
                window.skipped,
                window.nans,
                tflops,
                extra,
                num_zeros=metrics["num_zeros"],
                params_norm=metrics["params_norm"],
            ),
            flush=True,
        )

    def log_timers(self, iterations: int) -> None:
        """After the log line, --timing-log-level's timers (the last rank
        prints; every rank takes part), per iteration of the interval."""
        log = self.config.logging
        if log.timing_log_level == 0:
            return
        if log.log_timers_to_tensorboard:
            values = timer_scalars(self.timers, log.timing_log_level, iterations)
            self.dashboards.scalars(values, self.progress.iteration, None)
        # Timers.log would say it through megatron-core's logger: printed
        # here, as Megatron-LM's log shows it.
        text = self.timers.get_all_timers_string(timer_names(log.timing_log_level), iterations)
        if self.runtime.is_last_rank and text:
            print(text, flush=True)

    just_saved = None  # after an iteration: None, "persistent" or "non-persistent"

    def save_at_a_ramp_step(self) -> None:
        """As Megatron-LM: with --save, a checkpoint before the first
        iteration of each larger batch of --rampup-batch-size."""
        size, last = self.batch_size, self._last_batch_size
        self._last_batch_size = size
        if last is not None and size != last and self.config.checkpoint.save:
            self.logger.info("batch size %d -> %d: saving", last, size)
            self.save()

    def maybe_save_and_exit(self) -> bool:
        """Interval saves; exits on SIGTERM, --exit-interval, --exit-duration."""
        c, it = self.config.checkpoint, self.progress.iteration
        self.just_saved = None
        if c.save and c.save_interval and it % c.save_interval == 0:
            self.save()
            self.just_saved = "persistent"
        elif c.save and c.non_persistent_save_interval and it % c.non_persistent_save_interval == 0:
            self.save(non_persistent=True)
            self.just_saved = "non-persistent"
        exit_now = self.should_exit()
        if exit_now and not self.just_saved:
            self.save()
            self.just_saved = "persistent"
        return exit_now

    def should_exit(self) -> bool:
        log, it = self.config.logging, self.progress.iteration
        reasons = [
            self.signal_handler is not None and self.signal_handler.received,
            log.exit_interval is not None and it % log.exit_interval == 0,
            log.exit_duration_in_mins is not None
            and time.time() - self.start_time > log.exit_duration_in_mins * 60,
        ]
        if self.signal_handler is None and log.exit_duration_in_mins is None:
            return reasons[1]  # identical on every rank: no vote needed
        # Signals and clocks differ between ranks: stop if any rank wants to.
        flag = torch.tensor([int(any(reasons))], dtype=torch.int32)
        if not self.runtime.on_cpu:
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.logger.info("exiting at iteration %d (signal, interval or duration)", it)
        return bool(flag.item())

    def finish(self) -> None:
        self.profiler.stop()
        self._saved(self.saves.wait())
        self._call("on_train_end")
        self.close_logs()
        if self.signal_handler is not None:
            self.signal_handler.restore()

    def close_logs(self) -> None:
        """The metrics file and dashboards (another process may take them over)."""
        if self.metrics is not None:
            self.metrics.close()
        if self.dashboards is not None:
            self.dashboards.close()


def validation_scalars(losses: Dict[str, float], log) -> Dict[str, float]:
    """'lm loss validation' (and its perplexity), Megatron-LM's names."""
    values = {f"{name} validation": value for name, value in losses.items()}
    if log.log_validation_ppl_to_tensorboard:
        values.update(
            {f"{name} validation ppl": math.exp(min(20, v)) for name, v in losses.items()}
        )
    return values


def cuda_memory_scalars() -> Dict[str, float]:
    """The CUDA allocator's figures Megatron-LM writes (GPU only: checked at start)."""
    stats = torch.cuda.memory_stats()
    return {
        "mem-reserved-bytes": stats["reserved_bytes.all.current"],
        "mem-allocated-bytes": stats["allocated_bytes.all.current"],
        "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
        "mem-allocated-count": stats["allocation.all.current"],
    }


def padded_vocab_size(vocab_size: int, config: Config) -> int:
    multiple = (
        config.model.make_vocab_size_divisible_by * config.parallel.tensor_model_parallel_size
    )
    return -(-vocab_size // multiple) * multiple


def pretrain(config: Config, model_provider, forward_step: ForwardStep, hooks=()) -> int:
    """Megatron's entry point: initialize, build, train, save. Returns the
    exit code: 0, or megatron-core's rerun state machine's (--rerun-mode)."""
    trainer = build_trainer(config, model_provider, forward_step, hooks)
    try:
        trainer.train()
    except NothingToResume as stop:
        say_nothing_to_resume(stop, trainer.runtime.rank)
        return 0
    dist.barrier()
    return trainer.exit_code


def say_nothing_to_resume(stop: NothingToResume, rank: int) -> None:
    if rank == 0:
        print(f">> {stop}: exiting <<", flush=True)


def forget_interrupted_step() -> None:
    """The rerun state machine of a rank whose iteration stopped midway (a
    peer failed) still thinks it is in that iteration's run, and would
    skip the next forward-backward: it starts over."""
    machine = get_rerun_state_machine()
    if machine.state in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE):
        machine.state = RerunState.NOT_RUNNING_YET


def replayable(iterator):
    """megatron-core's replaying wrapper around a data iterator (each model
    chunk's, where there are several)."""
    if isinstance(iterator, list):
        return [None if it is None else RerunDataIterator(it) for it in iterator]
    return None if iterator is None else RerunDataIterator(iterator)


def params_l2_norm(model: List[torch.nn.Module]) -> float:
    """The L2 norm of the model's parameters, each counted once (Megatron-LM's
    --log-params-norm): tensor-parallel copies and the tied output embedding
    left out, the squares summed over the model-parallel group, an MoE
    model's experts over theirs (replicas hold the same values)."""
    dense, experts = [], []
    for chunk in model:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param) or not param_is_not_shared(param):
                continue
            (dense if getattr(param, "allreduce", True) else experts).append(param)
    total = 0.0
    for params, group in (
        (dense, parallel_state.get_model_parallel_group()),
        (experts, parallel_state.get_expert_tensor_model_pipeline_parallel_group(False)),
    ):
        squares = sum((p.detach().float().pow(2).sum() for p in params), torch.zeros(()))
        squares = squares.to(torch.cuda.current_device()) if torch.cuda.is_available() else squares
        if group is not None:
            dist.all_reduce(squares, group=group)
        total += squares.item()
    return total**0.5


def data_parallel_group_with_context():
    """The data-parallel group, with the context-parallel ranks where there
    are several (the group a loss or token count is summed over)."""
    with_cp = parallel_state.get_context_parallel_world_size() > 1
    return parallel_state.get_data_parallel_group(with_context_parallel=with_cp)


def _check_sentinels(config: Config, tokenizer, say: bool) -> None:
    """--fim-data's tokens that the vocabulary lacks take the id of an
    unknown token, as in Megatron-LM: said (``say``), not silent. A tokenizer
    with no unknown token gives them none: refused here, where Megatron-LM
    fails at the first reordered sample."""
    d = config.data
    _, missing = sentinel_ids(tokenizer, d)
    split = [d.fim_split_sample] if d.fim_split_sample else []
    lost = [t for t in missing + split if token_id(tokenizer, t)[0] is None]
    if lost:
        raise ConfigError(
            f"--fim-data: the vocabulary has no {', '.join(lost)} and the tokenizer no unknown "
            "token to stand for it: set the --fim-*-token or --fim-split-sample flags to "
            "tokens it has"
        )
    if missing and say:
        print(
            f"WARNING: --fim-data: the vocabulary has no {', '.join(missing)}: "
            "the tokenizer gives them its unknown token's id, as in Megatron-LM; "
            "set --fim-*-token to tokens it has, or use a tokenizer with FIM tokens",
            flush=True,
        )


def _print_parameter_count(model) -> None:
    """Megatron-LM's line: the parameters of each (TP, PP) position, from its
    first data-parallel replica."""
    if parallel_state.get_data_parallel_rank() != 0:
        return
    count = sum(p.nelement() for chunk in model for p in chunk.parameters())
    print(
        " > number of parameters on (tensor, pipeline) model parallel rank "
        f"({parallel_state.get_tensor_model_parallel_rank()}, "
        f"{parallel_state.get_pipeline_model_parallel_rank()}): {count}",
        flush=True,
    )


def core_attention_name(model) -> str:
    """The class that computes a built model's attention (megatron/training/
    attention.py says which a run gets), as the log shows it."""
    cores = (m for name, m in model.named_modules() if name.endswith(".core_attention"))
    return type(next(cores, None)).__name__


def build_trainer(
    config: Config,
    model_provider,
    forward_step: ForwardStep,
    hooks=(),
    datasets=None,
    joining: bool = False,
) -> Trainer:
    """Process groups, tokenizer, model, optimizer and data (unless built
    already: a warm spare builds them before it knows its place), ready to train."""
    runtime = initialize(config)
    config.run.on_cpu = runtime.on_cpu
    tokenizer = config.run.tokenizer = build_tokenizer(config.tokenizer)
    padded = config.run.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, config)
    if runtime.rank == 0:  # Megatron-LM's lines
        p = config.parallel
        print(
            f"using world size: {config.world_size}, data-parallel size: "
            f"{config.data_parallel_size}, context-parallel size: {p.context_parallel_size}, "
            "hierarchical context-parallel sizes: "
            f"{p.hierarchical_context_parallel_sizes}, tensor-model-parallel size: "
            f"{p.tensor_model_parallel_size}, pipeline-model-parallel size: "
            f"{p.pipeline_model_parallel_size}",
            flush=True,
        )
        print(
            f" > padded vocab (size: {tokenizer.vocab_size}) with "
            f"{padded - tokenizer.vocab_size} dummy tokens (new size: {padded})",
            flush=True,
        )
    state = setup_model_and_optimizer(config, model_provider, runtime.on_cpu)
    _print_parameter_count(state.model)
    if runtime.rank == 0:
        print(
            f" > core attention: {core_attention_name(state.model[0])} "
            f"(--attention-backend {config.model.attention_backend})",
            flush=True,
        )
    if datasets is None:
        if config.data.fim_data:
            _check_sentinels(config, tokenizer, say=runtime.rank == 0)
        datasets = data.build_datasets(config, tokenizer)
    hooks = [*cuda_graph_hooks(config), *hooks]
    hooks = [*replica_check_hooks(config, hooks), *hooks]
    trainer = Trainer(config, runtime, state, forward_step, datasets, hooks, joining)
    trainer.scale_gradients_by_quota()
    return trainer
