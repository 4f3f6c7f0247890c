"""The one entrance for loading a checkpoint in either of Megatron-LM's formats; what a save holds.

Megatron-LM's own format, ``--ckpt-format torch_dist``, goes through
megatron-core's ``dist_checkpointing`` (no format of ours).

Loading: the trainer finds the save (checkpoint_files.py: the tracker, the
format told from the directory) and hands it to ``load_checkpoint``, which
decides what is restored as Megatron-LM does (--no-load-optim,
--no-load-rng, --finetune, a release), has the format's reader put the
tensors back (torch_dist here, the legacy torch format in
legacy_checkpoint.py), restores what both formats hold alike (RNG, Adam's
steps, the scheduler) and returns the progress.

On disk, as Megatron-LM writes it (so checkpoints go both ways)::

    {save}/latest_checkpointed_iteration.txt     the iteration, or "release"
    {save}/iter_{iteration:07d}/common.pt         what every rank holds alike
                               .metadata, __{rank}_{n}.distcp   the shards
                               metadata.json      written last: the save is whole

The state is Megatron-LM's: ``args`` (a flat Namespace with Megatron-LM's
names), ``checkpoint_version`` 3.0, ``iteration``, ``model`` (the model's
sharded state dict), ``optimizer`` (the optimizer's, ``dp_reshardable`` or,
with --dist-ckpt-optim-fully-reshardable, ``fully_reshardable``),
``opt_param_scheduler``, ``rng_state`` (one object per (pp, tp) position)
and ``num_floating_point_operations_so_far``. Each data-parallel replica's
tensors are written once: every shard by one rank, spread over the
data-parallel group (--ckpt-fully-parallel-save, the default).

A save (megatron/training/saving.py) goes to a staging directory, is
fsynced, and only then takes its name ``iter_N`` and the tracker names it
(both replaced atomically): a save cut off at any point leaves the previous
checkpoint the one loaded, and one that cannot be written is reported
while training goes on. Loading
reshards across TP, PP and DP (the model always; the optimizer across DP,
or across all three when it was saved fully reshardable).
"""

import argparse
import dataclasses
import functools
import io
import os
import pickle
import queue
import tempfile
import random
import shutil
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.serialization import _CONTENT_METADATA_KEY as CONTENT_METADATA
from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron.training import legacy_checkpoint
from megatron.training.checkpoint_files import (
    CheckpointError,
    Found,
    SaveContents,
    checkpoint_dir,
    read_tracker,
    saved_in,
    torch_dist_args,
)
from megatron.training.config import SECTIONS, TRACKER, Config
from megatron.training.optimizer_layout import init_adam_state, restore_adam_steps
from megatron.training.rank_state import load_scheduler

CHECKPOINT_VERSION = 3.0
# What must agree between a checkpoint and the run that loads it.
MODEL_SHAPE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "padded_vocab_size",
    "num_experts",
)


@dataclasses.dataclass
class Loaded:
    """What a loaded checkpoint puts back beside the model and optimizer."""

    iteration: int
    consumed_samples: int
    floating_point_operations: float


# ----- what is saved -----
def sharding_metadata(config: Config) -> dict:
    """How model and optimizer describe their shards (Megatron-LM's choices);
    saved as the checkpoint's content metadata, and read back from it on load."""
    optim_type = (
        "fully_reshardable"
        if config.checkpoint.dist_ckpt_optim_fully_reshardable
        else "dp_reshardable"
    )
    return {
        "distrib_optim_sharding_type": optim_type,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def checkpoint_args(config: Config, progress) -> argparse.Namespace:
    """Megatron-LM's ``args``: every flag by its Megatron-LM name, plus what
    Megatron-LM derives and reads back on load. Plain values only: Megatron-LM
    loads common.pt with ``weights_only=True``."""
    values = {}
    for name in SECTIONS:
        values.update(dataclasses.asdict(getattr(config, name)))
    values.update(
        world_size=config.world_size,
        data_parallel_size=config.data_parallel_size,
        padded_vocab_size=config.run.padded_vocab_size,
        iteration=progress.iteration,
        consumed_train_samples=progress.consumed_samples,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        use_dist_ckpt=True,
        context_parallel_size=1,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
    )
    return argparse.Namespace(**values)


def rng_states() -> List[dict]:
    """This rank's RNG states under Megatron-LM's keys, in its one-entry list
    (data-parallel peers draw alike)."""
    return [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
    ]


def rng_object() -> ShardedObject:
    """The RNG states as one object per (pp, tp) position: data-parallel
    peers draw alike, so one of them is saved (under --deadpool-sample-rng
    they end an iteration in different states, which the next microbatch's
    reseed overwrites: nothing draws before it)."""
    ps = parallel_state
    return ShardedObject(
        "rng_state",
        rng_states(),
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def set_rng(states: list) -> None:
    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def model_keys(chunks: int) -> List[str]:
    """Megatron-LM's keys of the model in a checkpoint: ``model``, or with
    virtual pipeline stages ``model0``, ``model1``, ... (one per chunk).
    Their tensors are named by global layer in torch_dist, so a checkpoint
    loads at any number of virtual stages."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def sharded_state(state, metadata: dict, loading: bool, optim: bool, rng: bool) -> dict:
    """Model, optimizer and RNG as sharded state dicts under Megatron-LM's keys."""
    out = {
        key: chunk.sharded_state_dict(metadata=metadata)
        for key, chunk in zip(model_keys(len(state.model)), unwrap_model(state.model))
    }
    if optim:
        init_adam_state(state.optimizer)
        out["optimizer"] = state.optimizer.sharded_state_dict(
            out, is_loading=loading, metadata=metadata
        )
        out["opt_param_scheduler"] = state.scheduler.state_dict()
    if rng:
        out["rng_state"] = rng_object()
    return out


def zero_padding(tree) -> None:
    """megatron-core fills the gaps between parameters in a dp_reshardable
    bucket with ``torch.empty``: give them zeros, so that a checkpoint's bytes
    depend on the training state alone (two equal runs save equal files)."""
    if isinstance(tree, dict):
        padding = tree.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.obj is True:
            for value in tree.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
        for value in tree.values():
            zero_padding(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            zero_padding(value)


def keep_write_results_in_process() -> None:
    """dist_checkpointing collects its writers' results in a queue served by
    a spawned multiprocessing Manager, one per rank, made at the first save
    so that writer processes can report. Our writers are threads of the rank
    (saving.py): the results never leave the process. And a Manager outlives
    a rank that is killed or leaves with os._exit (DeadPool's ranks do
    both), so they would pile up on a node. An in-process queue takes its
    place."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_strategy(config: Config):
    """megatron-core's torch_dist strategy; with --ckpt-assume-constant-structure
    it keeps its plan (and the fully parallel wrapper its distribution) for
    the saves after the first, as long as the same object is used."""
    constant = config.checkpoint.ckpt_assume_constant_structure
    strategy = get_default_save_sharded_strategy("torch_dist")
    strategy.use_cached_ckpt_structure = constant
    if config.checkpoint.ckpt_fully_parallel_save:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelSaveStrategyWrapper(strategy, group, do_cache_distribution=constant)
    return strategy


# ----- save -----
# Megatron-LM's key of the rerun state machine's state (saved when it asks
# for a checkpoint to resume from), and the name of its sharded object.
RERUN_KEY, RERUN_SHARDS = "rerun_state_machine", "rerun_state_machine_state"


def state_to_save(config: Config, progress, state, rerun: Optional[dict] = None) -> dict:
    """Collective (the optimizer gathers its sharding). The whole state a
    save writes, under Megatron-LM's keys, with its content metadata;
    ``rerun``: megatron-core's rerun state machine's, where it has one."""
    c = config.checkpoint
    keep_write_results_in_process()
    metadata = sharding_metadata(config)
    state_dict = {
        "args": checkpoint_args(config, progress),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "num_floating_point_operations_so_far": progress.floating_point_operations,
        **sharded_state(state, metadata, False, not c.no_save_optim, not c.no_save_rng),
    }
    if rerun is not None:
        state_dict[RERUN_KEY] = rerun
    zero_padding(state_dict.get("optimizer"))
    state_dict[CONTENT_METADATA] = _clean_metadata_for_serialization(metadata)
    return state_dict


def legacy_files_to_save(directory: str, config: Config, progress, state, rerun=None) -> dict:
    """Collective over each data-parallel group (the distributed optimizer's
    state is gathered on its rank 0). The files of Megatron-LM's legacy
    format (--ckpt-format torch, legacy_checkpoint.py) this rank writes into
    ``directory`` (path -> object for torch.save): data-parallel rank 0 of
    each (TP, PP) position writes its position's, the others none."""
    c = config.checkpoint
    optimizer_state = None
    if not c.no_save_optim:
        init_adam_state(state.optimizer)
        optimizer_state = gathered_parameter_state(state.optimizer)
    ps = parallel_state
    if ps.get_data_parallel_rank() != 0:
        return {}
    folder = legacy_checkpoint.rank_dir(
        directory,
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size() > 1,
    )
    args = checkpoint_args(config, progress)
    args.use_dist_ckpt = False
    contents = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "num_floating_point_operations_so_far": progress.floating_point_operations,
    }
    chunks = unwrap_model(state.model)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        contents[key] = chunk.state_dict_for_save_checkpoint()
    if not c.no_save_optim:
        contents["optimizer"] = state.optimizer.state_dict()
        contents["opt_param_scheduler"] = state.scheduler.state_dict()
    if not c.no_save_rng:
        contents["rng_state"] = rng_states()
    if rerun is not None:
        contents[RERUN_KEY] = rerun
    files = {os.path.join(folder, legacy_checkpoint.MODEL_FILE): contents}
    if optimizer_state is not None:
        files[os.path.join(folder, legacy_checkpoint.OPTIMIZER_FILE)] = optimizer_state
    return files


def gathered_parameter_state(optimizer):
    """Collective. The distributed optimizer's main parameters and moments
    gathered on data-parallel rank 0 as ``save_parameter_state`` writes them
    (one dict, a list with several optimizers); None without it. Gathered
    over the data-parallel group itself, which serves on any backend."""
    optimizers = legacy_checkpoint.distributed_optimizers(optimizer)
    if not optimizers:
        return None
    states = [o.get_parameter_state_dp_zero(use_gloo_comm=False) for o in optimizers]
    return states[0] if len(states) == 1 else states


def publish(
    root: str, staging: str, final: str, entry: str, retain_interval: Optional[int] = None
) -> None:
    """The staged save takes its name, then the tracker names it; each step
    is atomic and durable. A checkpoint of the same iteration (a DeadPool
    rollback redoes iterations) is replaced only once the new one is whole.
    With ``retain_interval`` (--save-retain-interval) the save the tracker
    named before goes unless its iteration is a multiple of it."""
    before = read_tracker(root)
    if os.path.exists(final):
        retired = final + ".replaced"
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staging, final)
        shutil.rmtree(retired)
    else:
        os.replace(staging, final)
    fsync_path(root)
    tracker = os.path.join(root, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(entry)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)
    fsync_path(root)
    if retain_interval and before not in (None, "release", entry):
        retire(root, int(before), retain_interval)


def retire(root: str, iteration: int, retain_interval: int) -> None:
    """As Megatron-LM: an older save goes unless retained by the interval or
    a symbolic link (someone pointed at it on purpose); failing to delete
    it is no error."""
    directory = checkpoint_dir(root, str(iteration))
    if iteration % retain_interval == 0 or os.path.islink(directory):
        return
    shutil.rmtree(directory, ignore_errors=True)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----- load: the one entrance, for either format -----
def saved_args(root: str) -> Optional[argparse.Namespace]:
    """The ``args`` of the checkpoint the tracker in ``root`` names, in
    either format; None when there is none (--use-checkpoint-args)."""
    found = saved_in(root)
    if found is None:
        return None
    if found.legacy:
        return legacy_checkpoint.saved_state_of_rank_0(found.directory)["args"]
    return torch_dist_args(found.directory)


def load_checkpoint(found: Found, config: Config, state) -> Loaded:
    """Collective. The save ``found`` names, read by its format's reader
    (torch_dist here, Megatron-LM's legacy torch format in
    legacy_checkpoint.py): the model, and as the flags allow the optimizer
    with its scheduler and the RNG. Returns the progress it holds (none
    when fine-tuning or from a release)."""
    c = config.checkpoint
    optim = loads_optimizer(config, found.release)
    rng = not (c.no_load_rng or c.finetune or found.release)
    if found.legacy:
        keys = model_keys(len(state.model))
        check_saved = functools.partial(
            check_compatible, config=config, directory=found.directory, load_optim=optim
        )
        contents = legacy_checkpoint.load_legacy(
            found.directory, config, state, keys, optim, rng, check_saved
        )
    else:
        contents = load_torch_dist(found, config, state, optim, rng)
    restore_alike(contents, optim, config, state)
    if c.finetune or found.release:
        return Loaded(0, 0, 0.0)
    top = contents.top
    return Loaded(
        iteration=int(top["iteration"]),
        consumed_samples=int(getattr(top["args"], "consumed_train_samples", 0)),
        floating_point_operations=float(top.get("num_floating_point_operations_so_far", 0)),
    )


def restore_alike(contents: SaveContents, optim: bool, config: Config, state) -> None:
    """What both formats restore alike once their reader put the tensors
    back: the RNG (where read), and with the optimizer's state Adam's steps
    and the scheduler; without it, the fp32 main parameters from the loaded
    weights."""
    if contents.rng is not None:
        set_rng(contents.rng)
    if optim:
        restore_adam_steps(state.optimizer)
        load_scheduler(state.scheduler, contents.scheduler)
    elif config.training.bf16 or config.training.fp16:
        state.optimizer.reload_model_params()


def load_torch_dist(found: Found, config: Config, state, optim: bool, rng: bool) -> SaveContents:
    """Collective. Puts back the model from the torch_dist save ``found``
    names and, as ``optim`` says, the optimizer's state. Returns the rest to
    restore, the RNG states as ``rng`` says at the layout it was saved at."""
    directory, c = found.directory, config.checkpoint
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise CheckpointError(
            f"{directory} (named by {os.path.join(found.root, TRACKER)}) is no complete "
            "torch_dist checkpoint: its metadata.json is missing"
        )
    index = check_whole(directory)
    common = dist_checkpointing.load_common_state_dict(directory)
    check_compatible(common, config, directory, optim)
    same_layout = saved_layout(common) == run_layout(config)
    rng = rng and same_layout
    request = sharded_state(state, content_metadata(common, directory), True, optim, rng)
    rerun = has_rerun_state(index) and same_layout and not (c.finetune or found.release)
    if rerun:
        request[RERUN_KEY] = get_rerun_state_machine().state_dict(None, "torch_dist", force=True)
    loaded = dist_checkpointing.load(
        request, directory, load_strategy(config, directory), strict=c.dist_ckpt_strictness
    )
    if isinstance(loaded, tuple):  # return_*: the mismatched keys too
        loaded, missing, unexpected = loaded
        if dist.get_rank() == 0:
            print(
                f"checkpoint {directory}: missing keys {sorted(missing)}, "
                f"unexpected keys {sorted(unexpected)}",
                flush=True,
            )
    put_back(loaded, state, optim)
    if rerun and get_rerun_state_machine().validate_state_dict(loaded[RERUN_KEY]):
        # As Megatron-LM: the iteration that failed validation is run again from here.
        get_rerun_state_machine().load_state_dict(loaded[RERUN_KEY])
    return SaveContents(
        common,
        loaded["opt_param_scheduler"] if optim else None,
        loaded["rng_state"] if rng else None,
    )


def content_metadata(common: dict, directory: str) -> dict:
    """How the save describes its shards (sharding_metadata), for this
    run's data-parallel group."""
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if metadata is None:
        raise CheckpointError(
            f"{directory} has no content metadata: it predates megatron-core 0.14; "
            "convert it with Megatron-LM first"
        )
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def has_rerun_state(index) -> bool:
    """Whether a checkpoint's index (``.metadata``) holds the rerun state machine's state."""
    return any(key.startswith(RERUN_SHARDS) for key in index.state_dict_metadata)


def check_whole(directory: str):
    """Every shard file the index ``.metadata`` names is there and ends
    where its last item ends: a file cut short, missing, or put in from
    another save is named before anything is read. Returns the index."""
    try:
        index = FileSystemReader(directory).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{directory}/.metadata cannot be read: {error!r}") from error
    ends: Dict[str, int] = {}
    for item in index.storage_data.values():
        end = item.offset + item.length
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), end)
    wrong = []
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != end:
            wrong.append(
                f"{name} ({'missing' if size is None else f'{size} bytes'}, the index says {end})"
            )
    if not os.path.exists(os.path.join(directory, "common.pt")):
        wrong.append("common.pt (missing)")
    if wrong:
        raise CheckpointError(
            f"{directory} is not one whole save: "
            + "; ".join(wrong)
            + ". Load an older iteration (write its number into "
            f"{TRACKER}) or save again"
        )
    return index


def load_strategy(config: Config, directory: str):
    strategy = get_default_load_sharded_strategy(directory)
    if config.checkpoint.ckpt_fully_parallel_load:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelLoadStrategyWrapper(strategy, group)
    return strategy


@torch.no_grad()  # main parameters may be views of the model's (fp32 training)
def put_back(loaded: dict, state, optim: bool) -> None:
    for key, chunk in zip(model_keys(len(state.model)), unwrap_model(state.model)):
        chunk.load_state_dict(loaded[key], strict=True)
    if optim:
        state.optimizer.load_state_dict(loaded["optimizer"])


def saved_layout(common: dict) -> tuple:
    args = common["args"]
    return (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)


def run_layout(config: Config) -> tuple:
    p = config.parallel
    return (p.tensor_model_parallel_size, p.pipeline_model_parallel_size)


def loads_optimizer(config: Config, release: bool) -> bool:
    """Whether a load restores the optimizer (and scheduler), as Megatron-LM decides."""
    c = config.checkpoint
    return not (c.no_load_optim or c.finetune or release)


def check_compatible(common: dict, config: Config, directory: str, load_optim: bool) -> None:
    """The model's shape must agree (any layout may differ); a TP or PP change
    needs an optimizer saved fully reshardable unless it is not loaded."""
    version = common.get("checkpoint_version")
    if version is None or version < CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{directory} has checkpoint_version {version}; this reads {CHECKPOINT_VERSION}"
        )
    args, run = common["args"], model_shape(config)
    wrong = [
        f"{k} {getattr(args, k, None)} (this run: {run[k]})"
        for k in MODEL_SHAPE
        if getattr(args, k, None) != run[k]
    ]
    if wrong:
        raise CheckpointError(
            f"{directory} holds another model: it was saved with " + ", ".join(wrong)
        )
    saved, run = saved_model_parallel_layout(common), model_parallel_layout(config)
    if saved != run and load_optim:
        metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
        if metadata.get("distrib_optim_sharding_type") == "dp_reshardable":
            raise CheckpointError(
                f"{directory} was saved at {_layout_words(saved)} with the optimizer "
                f"resharded only across data-parallel ranks; this run is at "
                f"{_layout_words(run)}: load it at the same sizes, or with --no-load-optim, "
                "or save it with --dist-ckpt-optim-fully-reshardable"
            )


def saved_model_parallel_layout(common: dict) -> tuple:
    """TP, PP, virtual stages, EP and expert TP of a save: a distributed
    optimizer saved dp_reshardable loads only where all are the same (its
    buckets are cut per model chunk; a checkpoint from before expert
    parallelism has EP 1, expert TP = TP)."""
    args = common["args"]
    tp = args.tensor_model_parallel_size
    return saved_layout(common) + (
        getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
        getattr(args, "expert_model_parallel_size", 1),
        getattr(args, "expert_tensor_parallel_size", None) or tp,
    )


def model_parallel_layout(config: Config) -> tuple:
    p = config.parallel
    return run_layout(config) + (
        config.model_chunks,
        p.expert_model_parallel_size,
        p.expert_tensor_parallel_size,
    )


def _layout_words(layout: tuple) -> str:
    tp, pp, vpp, ep, etp = layout
    return (
        f"TP {tp}, PP {pp}, {vpp} virtual stage(s) per pipeline rank, EP {ep} and expert TP {etp}"
    )


def model_shape(config: Config) -> dict:
    m = config.model
    return {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "padded_vocab_size": config.run.padded_vocab_size,
        "num_experts": config.moe.num_experts,
    }


# ----- reading a checkpoint whole, without process groups (tests, tools) -----
def folder_of(root: str, iteration: Optional[int] = None) -> str:
    """An iteration's directory; by default the one the tracker names."""
    entry = read_tracker(root) if iteration is None else str(iteration)
    return checkpoint_dir(root, entry)


def read_whole(root: str, iteration: Optional[int] = None) -> Dict[str, object]:
    """A torch_dist checkpoint's whole state, read without process groups:
    every tensor in full under its key, every object's bytes, and the
    common state (``args`` left out: it names the run's own paths and
    layout)."""
    folder = folder_of(root, iteration)
    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(folder, whole)
        state = torch.load(whole, weights_only=False)
    common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
    common.pop("args")
    state = {k: v.getvalue() if isinstance(v, io.BytesIO) else v for k, v in state.items()}
    return {"common": common, **state}


def read_args(root: str, iteration: Optional[int] = None) -> argparse.Namespace:
    """The ``args`` a checkpoint was saved with (Megatron-LM's Namespace)."""
    return torch_dist_args(folder_of(root, iteration))
