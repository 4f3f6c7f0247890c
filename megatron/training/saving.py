"""Writing a torch_dist checkpoint so that a failed write stops nothing,
synchronously or in the background (--async-save).

The pieces are megatron-core's (``save_preprocess``, the common strategy,
the sharded strategy's ``async_save`` plan, its finalize step, ``save_config``),
called one by one instead of through ``dist_checkpointing.save`` for one
reason: there rank 0 writes ``common.pt`` and ``metadata.json`` between
collectives, so a full disk on rank 0 leaves every other rank waiting in
the next collective for ever. Here every local write is followed by an
agreement (one all-gather of each rank's error), so all ranks learn of a
failed write together, the staged directory is dropped, the previous
checkpoint stays the one the tracker names, and training goes on.

Only storage errors (``OSError``: disk full, quota, permissions, a file
too large) make a save fail this way. An error of a collective is a
peer's failure and goes up as it is; anything else is a bug.

The shard files are written by threads of this process, not by the
forked processes megatron-core's writer starts: a background write must
not fork a process that holds communicator threads, and its results then
stay in the process (see ``checkpointing.keep_write_results_in_process``).
A background write works on a copy of the tensors taken when the save
starts (megatron-core's staging copies device tensors to host memory and
leaves host tensors as they are, which training would change under it);
the copy is the memory an async save costs, one shard per rank.
"""

import dataclasses
import os
import queue
import shutil
import threading
import time
import traceback
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint import CheckpointException

from megatron.training import checkpointing
from megatron.training.checkpoint_files import checkpoint_dir, iteration_dir, read_tracker
from megatron.training.checkpointing import fsync_path

STAGING_SUFFIX = ".partial"


@dataclasses.dataclass
class Outcome:
    """A finished save: its directory, or why it was not written."""

    iteration: int
    directory: str
    errors: List[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.errors


def agree(error: Optional[BaseException]) -> List[str]:
    """Collective: every rank's failure of the step just taken, empty when
    all succeeded."""
    mine = None if error is None else describe(error)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [e for e in everyone if e]


def describe(error: BaseException) -> Optional[str]:
    """One line per failure. megatron-core's finalize raises the same
    CheckpointException on every rank, with each rank's write error in the
    coordinator's copy (empty in the others')."""
    if isinstance(error, CheckpointException):
        failures = [f"rank {rank}: {cause!r}" for rank, (cause, _) in error.failures.items()]
        return "; ".join(failures) or None
    return f"rank {dist.get_rank()}: {error!r}"


def attempt(step, *args) -> Optional[OSError]:
    """Runs a local storage step; its storage error, traceback printed."""
    try:
        step(*args)
    except OSError as error:
        traceback.print_exc()
        return error
    return None


def on_rank_0(step, *args) -> None:
    if dist.get_rank() == 0:
        step(*args)


def fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fsync_path(path)
    fsync_path(directory)


def fresh_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)  # a save cut off before
    os.makedirs(path)


def write_common(common: dict, directory: str) -> None:
    """What megatron-core's common strategy writes (``torch.save`` of the
    common state to common.pt), through a Python file: torch.save given a
    path reports a storage error as a RuntimeError of its C++ writer, given
    a file the OSError itself."""
    with open(os.path.join(directory, COMMON_STATE_FNAME), "wb") as f:
        torch.save(common, f)


def remove_all_but_the_latest(root: str) -> None:
    """Every save in ``root`` but the one its tracker names (a stale staged
    save included)."""
    if not os.path.isdir(root):
        return
    entry = read_tracker(root)
    latest = None if entry is None else os.path.basename(checkpoint_dir(root, entry))
    for name in os.listdir(root):
        if name.startswith("iter_") and name != latest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def drop_stale_results() -> None:
    """Results of a write whose save was abandoned (a recovery came first)
    must not be read as the next save's."""
    results = filesystem_async._results_queue
    while results is not None and not results.empty():
        results.get_nowait()


# ----- the shard files -----
def host_copies(buckets: list) -> list:
    """Copies of every host tensor a write bucket holds (see the module's
    docstring); device tensors were copied by megatron-core's staging."""
    return [
        (file_name, key, (data, [(item, t.clone() if t.is_cpu else t) for item, t in tensors]))
        for file_name, key, (data, tensors) in buckets
    ]


def write_buckets(transforms: list, buckets: list, results: queue.Queue) -> None:
    """What megatron-core's ``write_preloaded_data_multiproc`` does, with a
    thread per file instead of a process: each file's write results, or the
    first error, go to ``results`` for the finalize step."""
    local: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    threads = []
    for index, bucket in enumerate(buckets):
        done.put(index)
        thread = threading.Thread(
            target=FileSystemWriterAsync.write_preloaded_data,
            args=(transforms, index, bucket, local, done, True),
            daemon=True,
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    outcome: object = {}
    while not local.empty():
        index, written = local.get()
        if isinstance(written, Exception):
            outcome = written
            break
        outcome[index] = written
    results.put(outcome)


class Pending:
    """A save whose shard files are being written (maybe in a thread)."""

    def __init__(self, root, iteration, staging, request, backend, started, background):
        self.root, self.iteration, self.staging = root, iteration, staging
        self.request, self.backend, self.started = request, backend, started
        self.error: Optional[BaseException] = None
        self.thread = None
        if request.async_fn is None:  # nothing for this rank to write
            return
        _, _, results = request.async_fn_args  # rank, buckets (staged below), results
        transforms, _ = request.async_fn.args  # megatron-core's writer's own
        buckets = request.preload_fn()
        if background:
            buckets = host_copies(buckets)
            self.thread = threading.Thread(
                target=self._write, args=(transforms, buckets, results), daemon=True
            )
            self.thread.start()
        else:
            self._write(transforms, buckets, results)

    def _write(self, transforms, buckets, results) -> None:
        try:
            write_buckets(transforms, buckets, results)
        except Exception as error:  # noqa: BLE001 — reported by finalize on every rank
            traceback.print_exc()
            self.error = error

    @property
    def written(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait_written(self) -> None:
        if self.thread is not None:
            self.thread.join()


# ----- one save, start to end -----
def start(
    root: str, iteration: int, state_dict: dict, strategy, background: bool, validate: bool = True
):
    """Collective. Stages ``iter_N.partial``, writes common.pt and plans the
    shard files, then writes them (in a thread when ``background``).
    ``validate``: check that the shards cover every tensor once (megatron-core's
    integrity check, a collective). Returns a Pending save, or an Outcome
    when a write already failed."""
    began = time.perf_counter()
    drop_stale_results()
    staging = iteration_dir(root, iteration) + STAGING_SUFFIX
    sharded, common = save_preprocess(state_dict, validate_access_integrity=validate)

    def stage_common():
        fresh_directory(staging)
        write_common(common, staging)

    errors = agree(attempt(on_rank_0, stage_common))
    if errors:
        return failed(iteration, staging, errors, began)
    request = strategy.async_save(sharded, staging)
    backend = CheckpointingConfig(strategy.backend, strategy.version)
    return Pending(root, iteration, staging, request, backend, began, background)


def all_written(pending: Pending, blocking: bool) -> bool:
    """Collective: whether every rank's files are written."""
    if blocking:
        pending.wait_written()
        return True
    flag = torch.tensor([int(pending.written)], dtype=torch.int32)
    flag = flag.to(torch.cuda.current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def finish(pending: Pending, publish) -> Outcome:
    """Collective, once every rank's files are written: megatron-core's
    finalize (rank 0 writes ``.metadata`` from all ranks' write results),
    fsync, ``metadata.json``, then ``publish(staging, final)`` on rank 0."""
    errors = finalize(pending)
    if not errors:
        errors = agree(attempt(fsync_tree, pending.staging))
    if not errors:
        errors = agree(
            attempt(on_rank_0, finish_directory, pending.backend, pending.staging, publish)
        )
    if errors:
        return failed(pending.iteration, pending.staging, errors, pending.started)
    final = iteration_dir(pending.root, pending.iteration)
    return Outcome(pending.iteration, final, [], time.perf_counter() - pending.started)


def finish_directory(backend, staging, publish) -> None:
    save_config(backend, staging)
    fsync_path(os.path.join(staging, "metadata.json"))
    publish(staging)


def finalize(pending: Pending) -> List[str]:
    """megatron-core's finalize: the coordinator (rank 0) gathers the write
    results, writes ``.metadata`` when none failed and broadcasts whether
    any did; every rank then raises the same CheckpointingException. A
    storage error of rank 0's own ``.metadata`` write comes before that
    broadcast, so rank 0 sends it in its place and the others are released."""
    try:
        for step in pending.request.finalize_fns:
            step()
    except CheckpointException as error:
        return agree(error) or ["a shard file could not be written"]
    except OSError as error:
        traceback.print_exc()
        failure = torch.tensor([1], dtype=torch.int, device=torch.cuda.current_device())
        dist.broadcast(failure, src=0)
        return agree(error)
    return agree(pending.error)


# ----- Megatron-LM's legacy format (--ckpt-format torch) -----
def save_legacy(root: str, progress, state, config, retain_interval=None, rerun=None) -> Outcome:
    """Collective, in the foreground (Megatron-LM has no background write
    for this format). Every (TP, PP) position's files into the staged
    directory, then, as for torch_dist, an agreement on every write, and
    rank 0 names the save."""
    began = time.perf_counter()
    iteration = progress.iteration
    staging = iteration_dir(root, iteration) + STAGING_SUFFIX
    final, entry = iteration_dir(root, iteration), str(iteration)
    errors = agree(attempt(on_rank_0, fresh_directory, staging))
    if not errors:
        files = checkpointing.legacy_files_to_save(staging, config, progress, state, rerun)
        errors = agree(attempt(write_files, files))
    if not errors:
        publish = checkpointing.publish
        errors = agree(attempt(on_rank_0, publish, root, staging, final, entry, retain_interval))
    if errors:
        return failed(iteration, staging, errors, began)
    return Outcome(iteration, final, [], time.perf_counter() - began)


def write_files(files: dict) -> None:
    """Each object to its path, durably. Through a Python file: see
    write_common."""
    for path, contents in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(contents, f)
        fsync_path(path)
        fsync_path(os.path.dirname(path))


def failed(iteration: int, staging: str, errors: List[str], began: float) -> Outcome:
    on_rank_0(shutil.rmtree, staging, True)
    return Outcome(iteration, staging, errors, time.perf_counter() - began)


class Saves:
    """The run's checkpoint saves, at most one in flight. With --async-save
    the shard files are written in the background and the save ends (the
    tracker names it) at the end of the first iteration after every rank's
    files are written, as Megatron-LM finalizes its asynchronous saves.
    Each method returns the outcome of a save that ended in it, if one did."""

    def __init__(self, config, logger):
        self.config, self.logger = config, logger
        self.pending: Optional[Pending] = None
        self.retain_interval: Optional[int] = None  # of the save in flight
        # --ckpt-assume-constant-structure: the strategy that planned the
        # saves of these groups, and the groups (a recovery makes others).
        self._strategy, self._strategy_group = None, None

    def _save_strategy(self):
        """The strategy for this save, and whether it planned one before."""
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        constant = self.config.checkpoint.ckpt_assume_constant_structure
        if constant and self._strategy is not None and self._strategy_group is group:
            return self._strategy, True
        self._strategy = checkpointing.save_strategy(self.config)
        self._strategy_group = group
        return self._strategy, False

    def save(self, progress, state, root: str, keep_only_latest: bool = False, rerun=None):
        """Collective. Starts a save of ``progress.iteration`` into ``root``
        (none may be in flight); without --async-save it also ends it.
        ``keep_only_latest`` first removes all but the latest save in
        ``root`` (non-persistent checkpoints, as Megatron-LM). ``rerun``: the
        rerun state machine's state, where it asks for this save."""
        assert self.pending is None, "end the save in flight first (wait)"
        if keep_only_latest:
            on_rank_0(remove_all_but_the_latest, root)
        background = bool(self.config.checkpoint.async_save)
        c = self.config.checkpoint
        self.retain_interval = None if keep_only_latest else c.save_retain_interval
        if c.ckpt_format == "torch":
            return self.report(
                save_legacy(root, progress, state, self.config, self.retain_interval, rerun)
            )
        state_dict = checkpointing.state_to_save(self.config, progress, state, rerun)
        strategy, planned_before = self._save_strategy()
        # As Megatron-LM: a structure assumed constant is checked at its first save only.
        validate = not (planned_before and c.ckpt_assume_constant_structure)
        begun = start(root, progress.iteration, state_dict, strategy, background, validate)
        if isinstance(begun, Outcome):
            return self.report(begun)
        self.pending = begun
        if not background:
            return self.wait()
        self.logger.info(
            "checkpoint of iteration %d is being written in the background "
            "(training was held %.2f s)",
            begun.iteration,
            time.perf_counter() - begun.started,
        )
        return None

    def poll(self) -> Optional[Outcome]:
        """Collective. Ends the save in flight if every rank's files are written."""
        if self.pending is not None and all_written(self.pending, blocking=False):
            return self._end()
        return None

    def wait(self) -> Optional[Outcome]:
        """Collective. Ends the save in flight, waiting for its files."""
        if self.pending is None:
            return None
        all_written(self.pending, blocking=True)
        return self._end()

    def abandon(self) -> None:
        """Local. A recovery replaced the groups the save would end on: its
        files are left unnamed in the staging directory (the tracker still
        names the previous checkpoint; a later save of that iteration
        replaces them)."""
        if self.pending is not None:
            self.pending.wait_written()
            self.pending = None
        self._strategy = self._strategy_group = None  # planned for the groups before

    def _end(self) -> Outcome:
        pending, self.pending = self.pending, None
        root, final = pending.root, iteration_dir(pending.root, pending.iteration)
        entry = str(pending.iteration)
        retain = self.retain_interval
        return self.report(
            finish(
                pending,
                lambda staging: checkpointing.publish(root, staging, final, entry, retain),
            )
        )

    def report(self, outcome: Outcome) -> Outcome:
        if outcome.ok:
            self.logger.info("saved checkpoint %s in %.2f s", outcome.directory, outcome.seconds)
            return outcome
        root = os.path.dirname(outcome.directory)
        latest = read_tracker(root)
        self.logger.warning(
            "checkpoint of iteration %d NOT saved (%s); the latest checkpoint in %s stays %s; "
            "training goes on",
            outcome.iteration,
            "; ".join(outcome.errors),
            root,
            f"iteration {latest}" if latest else "none",
        )
        return outcome
