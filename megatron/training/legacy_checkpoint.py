"""Loading Megatron-LM's legacy checkpoints, ``--ckpt-format torch``.

On disk, as Megatron-LM writes them::

    {load}/latest_checkpointed_iteration.txt     the iteration, or "release"
    {load}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/
        model_optim_rng.pt   from data-parallel rank 0 of each (tp, pp) position:
                             args, checkpoint_version, iteration, model (the
                             stage's state_dict), optimizer (its state_dict()),
                             opt_param_scheduler, rng_state (a list, one entry
                             per data-parallel rank or just one),
                             num_floating_point_operations_so_far
        distrib_optim.pt     with the distributed optimizer: the position's
                             main parameters and Adam moments, gathered on
                             data-parallel rank 0 (DistributedOptimizer.
                             save_parameter_state)

The ``_{pp:03d}`` suffix is there when PP > 1. Megatron-LM detects a
checkpoint's format from its directory, and so does ``--load`` here:
``load_checkpoint`` loads a legacy checkpoint itself and hands any other to
``checkpointing.load_checkpoint`` (the trainer calls it; checkpointing.py
cannot call this module, which imports it). Such a checkpoint is cut for one
TP and PP: it loads at that layout only (any DP). ``--save`` with
``--ckpt-format torch`` writes it (``files_to_save`` here, the staging and
agreement in saving.py), in the foreground as Megatron-LM does.
"""

import contextlib
import os
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model

from megatron.training import checkpointing
from megatron.training.checkpointing import CheckpointError, Loaded
from megatron.training.config import Config
from megatron.training.optimizer_layout import (
    init_adam_state,
    inner_optimizers,
    restore_adam_steps,
)
from megatron.training.rank_state import load_scheduler

MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"


def is_legacy(directory: str) -> bool:
    """Megatron-LM's test: not torch_dist, and per-rank ``mp_rank_0*`` entries."""
    if not os.path.isdir(directory) or dist_checkpointing.check_is_distributed_checkpoint(
        directory
    ):
        return False
    return any(name.startswith("mp_rank_0") for name in os.listdir(directory))


def rank_dir(directory: str, tp_rank: int, pp_rank: int, pipeline_parallel: bool) -> str:
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pipeline_parallel else "")
    return os.path.join(directory, name)


def read(path: str, mmap: bool = False) -> dict:
    """A Megatron-LM ``.pt`` file, read as Megatron-LM reads it (torch's
    safe loader, megatron-core's safe globals registered on import)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # torch raises several types for a bad file
        raise CheckpointError(f"{path} cannot be read: {error}") from error


def saved_state_of_rank_0(directory: str) -> dict:
    """The first position's file, whose ``args`` tell the saved layout
    (Megatron-LM's find_checkpoint_rank_0); its tensors are not read."""
    candidates = [rank_dir(directory, 0, 0, pp) for pp in (False, True)]
    for candidate in candidates:
        path = os.path.join(candidate, MODEL_FILE)
        if os.path.isfile(path):
            return read(path, mmap=True)
    names = " or ".join(os.path.join(c, MODEL_FILE) for c in candidates)
    raise CheckpointError(
        f"{directory} is a legacy (--ckpt-format torch) checkpoint without {names}"
    )


def check_layout(saved_args, config: Config, directory: str) -> None:
    """Its TP and PP must be this run's: the files hold each rank's cut."""
    saved = (saved_args.tensor_model_parallel_size, saved_args.pipeline_model_parallel_size)
    run = checkpointing.run_layout(config)
    if saved != run:
        raise CheckpointError(
            f"{directory} is a legacy --ckpt-format torch checkpoint saved at TP {saved[0]} "
            f"and PP {saved[1]}; this run is at TP {run[0]} and PP {run[1]}, and such a "
            "checkpoint loads only at the TP and PP it was saved at. Run at "
            f"--tensor-model-parallel-size {saved[0]} --pipeline-model-parallel-size "
            f"{saved[1]}; or convert it to this layout with Megatron-LM's tools/checkpoint "
            "(convert.py, --target-tensor-parallel-size/--target-pipeline-parallel-size); or "
            f"load it once at TP {saved[0]} and PP {saved[1]} and save it as torch_dist "
            "(the default here, with --dist-ckpt-optim-fully-reshardable to take the "
            "optimizer to another TP and PP)"
        )
    saved_vpp = getattr(saved_args, "virtual_pipeline_model_parallel_size", None) or 1
    if saved_vpp != config.model_chunks:
        raise CheckpointError(
            f"{directory} is a legacy --ckpt-format torch checkpoint saved with "
            f"{saved_vpp} virtual pipeline stage(s) per pipeline rank, this run has "
            f"{config.model_chunks}: its files hold each model chunk's own layers. Run with "
            + (
                f"--num-virtual-stages-per-pipeline-rank {saved_vpp}"
                if saved_vpp > 1
                else "no virtual pipeline stages"
            )
            + ", or load it once so and save it as torch_dist (which loads at any)"
        )
    value = getattr(saved_args, "expert_model_parallel_size", None)
    if value not in (None, 1):
        raise CheckpointError(
            f"{directory} was saved with expert_model_parallel_size {value}: not supported here"
        )


def check_optimizer(saved_args, config: Config, directory: str) -> None:
    saved = bool(getattr(saved_args, "use_distributed_optimizer", False))
    if saved != config.parallel.use_distributed_optimizer:
        has = "with" if saved else "without"
        raise CheckpointError(
            f"{directory} was saved {has} --use-distributed-optimizer and this run is "
            f"not: its optimizer state does not fit. Run {has} --use-distributed-optimizer, "
            "or load the model only with --no-load-optim"
        )


def files_of_this_rank(directory: str, config: Config, load_optim: bool) -> List[str]:
    ps = parallel_state
    folder = rank_dir(
        directory,
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size() > 1,
    )
    files = [os.path.join(folder, MODEL_FILE)]
    if load_optim and config.parallel.use_distributed_optimizer:
        files.append(os.path.join(folder, OPTIMIZER_FILE))
    return files


def require_files(files: List[str]) -> None:
    """Collective: every rank raises, naming every missing file, or none does."""
    missing = [f for f in files if not os.path.isfile(f)]
    agree("missing from a legacy checkpoint: " + ", ".join(missing) if missing else None)


def agree(problem: Optional[str]) -> None:
    """Collective: if any rank found a problem, every rank raises them all (a
    rank left alone in a later collective would wait for its timeout)."""
    problems: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = sorted({p for p in problems if p})
    if found:
        raise CheckpointError("; ".join(found))


def parameter_state_problem(optimizer, path: str) -> Optional[str]:
    """Whether ``distrib_optim.pt`` fits this run's gradient buffers (read on
    data-parallel rank 0, which alone reads it): megatron-core indexes it by
    buffer and (parameter dtype, gradient dtype) and checks only the sizes."""
    optimizers = distributed_optimizers(optimizer)
    if optimizers[0].data_parallel_group.rank() != 0:
        return None
    saved = read(path, mmap=True)
    saved = saved if isinstance(saved, list) else [saved]
    for opt, state in zip(optimizers, saved):
        if "buckets_coalesced" not in state:
            return (
                f"{path} has the distributed optimizer's layout of before February 2024: "
                "convert it with Megatron-LM (--ckpt-convert-update-legacy-dist-opt-format)"
            )
        ours = [
            (dtype, opt.buffers[i].numel_unpadded)
            for i, ranges in enumerate(opt.gbuf_ranges)
            for dtype in ranges
        ]
        theirs = [
            (dtype, value["numel_unpadded"])
            for i in range(len(state) - 1)
            for dtype, value in state[i].items()
        ]
        if ours != theirs:
            return (
                f"{path} holds gradient buffers of (parameter dtype, gradient dtype, size) "
                f"{theirs}, this run has {ours}. Megatron-LM keeps --fp16 gradients in fp16 "
                "(unless --accumulate-allreduce-grads-in-fp32), this repository in fp32: "
                "load the model alone with --no-load-optim"
            )
    return None


# ----- loading -----
def load_checkpoint(root: str, config: Config, state) -> Optional[Loaded]:
    """Collective. The checkpoint the tracker in ``root`` names, in either
    format: Megatron-LM's legacy torch format here, torch_dist by
    ``checkpointing.load_checkpoint``; None when ``root`` holds none."""
    entry = checkpointing.read_tracker(root)
    directory = None if entry is None else checkpointing.checkpoint_dir(root, entry)
    if directory is not None and is_legacy(directory):
        return load(directory, entry == "release", config, state)
    return checkpointing.load_checkpoint(root, config, state)


def saved_args(root: str):
    """The ``args`` of the checkpoint the tracker in ``root`` names, in
    either format; None when there is none (--use-checkpoint-args)."""
    entry = checkpointing.read_tracker(root)
    directory = None if entry is None else checkpointing.checkpoint_dir(root, entry)
    if directory is not None and is_legacy(directory):
        return saved_state_of_rank_0(directory)["args"]
    return checkpointing.saved_args(root)


def load(directory: str, release: bool, config: Config, state) -> Loaded:
    """Collective. Restores model, optimizer, scheduler and RNG from the
    legacy checkpoint in ``directory``, under the rules of
    ``checkpointing.load_checkpoint`` (--no-load-optim, --no-load-rng,
    --finetune, release)."""
    c = config.checkpoint
    saved_args = saved_state_of_rank_0(directory)["args"]
    check_layout(saved_args, config, directory)
    load_optim = checkpointing.loads_optimizer(config, release)
    load_rng = not (c.no_load_rng or c.finetune or release)
    if load_optim:
        check_optimizer(saved_args, config, directory)
        if config.parallel.use_distributed_optimizer:
            agree(gloo_problem(state.optimizer))
    files = files_of_this_rank(directory, config, load_optim)
    require_files(files)
    saved = read(files[0])
    checkpointing.check_compatible(saved, config, directory, load_optim)
    load_model(saved, state, files[0])
    if load_optim:
        load_optimizer(saved, state, files, config)
    elif config.training.bf16 or config.training.fp16:
        state.optimizer.reload_model_params()  # main parameters from the loaded weights
    if load_rng:
        load_rng_state(saved, files[0])
    dist.barrier()
    if c.finetune or release:
        return Loaded(0, 0, 0.0)
    return Loaded(
        iteration=int(saved["iteration"]),
        consumed_samples=int(getattr(saved["args"], "consumed_train_samples", 0)),
        floating_point_operations=float(saved.get("num_floating_point_operations_so_far", 0)),
    )


@torch.no_grad()  # main parameters may be views of the model's (fp32 training)
def load_model(saved: dict, state, path: str) -> None:
    chunks = unwrap_model(state.model)
    for key, module in zip(checkpointing.model_keys(len(chunks)), chunks):
        if key not in saved:
            raise CheckpointError(f"{path} holds no {key!r} (a model chunk of this run)")
        missing, unexpected = module.load_state_dict(saved[key], strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{path} holds another model stage in {key!r}: keys missing from it "
                f"{sorted(missing)}, keys it has beyond this model's {sorted(unexpected)}"
            )


@torch.no_grad()  # the same views, written by load_parameter_state
def load_optimizer(saved: dict, state, files: List[str], config: Config) -> None:
    if "optimizer" not in saved or "opt_param_scheduler" not in saved:
        raise CheckpointError(
            f"{files[0]} holds no optimizer state (saved with --no-save-optim?): "
            "load it with --no-load-optim or --finetune"
        )
    state.optimizer.load_state_dict(saved["optimizer"])
    if config.parallel.use_distributed_optimizer:
        agree(parameter_state_problem(state.optimizer, files[1]))
        with gloo_data_parallel_groups(state.optimizer):
            state.optimizer.load_parameter_state(files[1])
    restore_adam_steps(state.optimizer)
    load_scheduler(state.scheduler, saved["opt_param_scheduler"])


def load_rng_state(saved: dict, path: str) -> None:
    if "rng_state" not in saved:
        raise CheckpointError(
            f"{path} holds no RNG state (saved with --no-save-rng?): load it with --no-load-rng"
        )
    states = saved["rng_state"]  # one entry, or one per DP rank
    if getattr(saved["args"], "data_parallel_random_init", False):
        states = [states[parallel_state.get_data_parallel_rank()]]
    checkpointing.set_rng(states)


# ----- saving -----
def files_to_save(directory: str, config: Config, progress, state, rerun=None) -> dict:
    """Collective over each data-parallel group (the distributed optimizer's
    state is gathered on its rank 0). The files this rank writes into
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
    folder = rank_dir(
        directory,
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size() > 1,
    )
    args = checkpointing.checkpoint_args(config, progress)
    args.use_dist_ckpt = False
    contents = {
        "args": args,
        "checkpoint_version": checkpointing.CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "num_floating_point_operations_so_far": progress.floating_point_operations,
    }
    chunks = unwrap_model(state.model)
    for key, chunk in zip(checkpointing.model_keys(len(chunks)), chunks):
        contents[key] = chunk.state_dict_for_save_checkpoint()
    if not c.no_save_optim:
        contents["optimizer"] = state.optimizer.state_dict()
        contents["opt_param_scheduler"] = state.scheduler.state_dict()
    if not c.no_save_rng:
        contents["rng_state"] = checkpointing.rng_states()
    if rerun is not None:
        contents[checkpointing.RERUN_KEY] = rerun
    files = {os.path.join(folder, MODEL_FILE): contents}
    if optimizer_state is not None:
        files[os.path.join(folder, OPTIMIZER_FILE)] = optimizer_state
    return files


def gathered_parameter_state(optimizer):
    """Collective. The distributed optimizer's main parameters and moments
    gathered on data-parallel rank 0 as ``save_parameter_state`` writes them
    (one dict, a list with several optimizers); None without it. Gathered
    over the data-parallel group itself, which serves on any backend."""
    optimizers = distributed_optimizers(optimizer)
    if not optimizers:
        return None
    states = [o.get_parameter_state_dp_zero(use_gloo_comm=False) for o in optimizers]
    return states[0] if len(states) == 1 else states


# ----- the gloo data-parallel group megatron-core's load_parameter_state needs -----
def gloo_problem(optimizer) -> Optional[str]:
    """DistributedOptimizer.load_parameter_state scatters over the optimizer's
    ``data_parallel_group_gloo``: gloo twins of the data-parallel groups, which
    our runs do not make (initialize.py). On a CPU the data-parallel group is
    gloo itself and serves; process groups are made in initialize.py only."""
    for o in distributed_optimizers(optimizer):
        backend = dist.get_backend(o.data_parallel_group)
        if o.data_parallel_group_gloo is None and backend != dist.Backend.GLOO:
            return (
                "megatron-core reads a legacy checkpoint's distributed optimizer state over "
                f"gloo data-parallel groups, and this run's are {backend}: load it once with "
                "--cpu and save it as torch_dist, or load the model alone with --no-load-optim"
            )
    return None


@contextlib.contextmanager
def gloo_data_parallel_groups(optimizer):
    """The data-parallel groups (gloo) as their own gloo twins, for the load."""
    lent = [o for o in distributed_optimizers(optimizer) if o.data_parallel_group_gloo is None]
    for o in lent:
        o.data_parallel_group_gloo = o.data_parallel_group
    try:
        yield
    finally:
        for o in lent:
            o.data_parallel_group_gloo = None


def distributed_optimizers(optimizer) -> list:
    return [o for o in inner_optimizers(optimizer) if isinstance(o, DistributedOptimizer)]
