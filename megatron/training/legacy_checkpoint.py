"""Reading Megatron-LM's legacy checkpoints, ``--ckpt-format torch``.

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
checkpoint's format from its directory, and so does ``--load`` here
(checkpoint_files.is_legacy): ``checkpointing.load_checkpoint``, the one
entrance for loading, hands a legacy save to ``load_legacy`` with what it
decided (what to restore, the check of the saved model), and restores what
both formats hold alike from what it hands back. Such a checkpoint is cut
for one TP and PP: it loads at that layout only (any DP). ``--save`` with
``--ckpt-format torch`` writes it in the foreground as Megatron-LM does
(checkpointing.legacy_files_to_save; saving.py stages the writes).
"""

import contextlib
import os
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model

from megatron.training.checkpoint_files import CheckpointError, SaveContents
from megatron.training.config import Config
from megatron.training.optimizer_layout import inner_optimizers

MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"


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
    run = (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
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
def load_legacy(
    directory: str,
    config: Config,
    state,
    keys: List[str],
    optim: bool,
    rng: bool,
    check_saved: Callable[[dict], None],
) -> SaveContents:
    """Collective. Puts back the model (its chunks under ``keys``) from the
    legacy save in ``directory`` and, as ``optim`` says, the optimizer's
    state; ``check_saved`` refuses a save of another model. Returns the rest
    to restore, the RNG states as ``rng`` says (checkpointing.load_checkpoint
    decides all of these, as for torch_dist)."""
    saved_args = saved_state_of_rank_0(directory)["args"]
    check_layout(saved_args, config, directory)
    if optim:
        check_optimizer(saved_args, config, directory)
        if config.parallel.use_distributed_optimizer:
            agree(gloo_problem(state.optimizer))
    files = files_of_this_rank(directory, config, optim)
    require_files(files)
    saved = read(files[0])
    check_saved(saved)
    load_model(saved, state, keys, files[0])
    if optim:
        load_optimizer(saved, state, files, config)
    rng_states = saved_rng_states(saved, files[0]) if rng else None
    dist.barrier()
    return SaveContents(saved, saved["opt_param_scheduler"] if optim else None, rng_states)


@torch.no_grad()  # main parameters may be views of the model's (fp32 training)
def load_model(saved: dict, state, keys: List[str], path: str) -> None:
    for key, module in zip(keys, unwrap_model(state.model)):
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


def saved_rng_states(saved: dict, path: str) -> list:
    """This rank's entry of the saved RNG states, as a one-entry list."""
    if "rng_state" not in saved:
        raise CheckpointError(
            f"{path} holds no RNG state (saved with --no-save-rng?): load it with --no-load-rng"
        )
    states = saved["rng_state"]  # one entry, or one per DP rank
    if getattr(saved["args"], "data_parallel_random_init", False):
        states = [states[parallel_state.get_data_parallel_rank()]]
    return states


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
