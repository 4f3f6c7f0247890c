"""Checks of the pipeline schedule: the layers' split between pipeline
stages (even, uneven, or --pipeline-model-parallel-layout's), and the
interleaved schedule's virtual stages."""

from typing import Optional

from megatron.training.config import Config
from megatron.training.flags.refusal import ConfigError, require, require_with
from megatron.training.schedule import interleaving_problem_at


def check_layer_layout(config: Config) -> None:
    """--pipeline-model-parallel-layout: the only split given, read as
    megatron-core reads it, its layers those of the model, the MTP layers on
    the last pipeline rank (the one that also reads labels here)."""
    p, m = config.parallel, config.model
    layout = p.pipeline_model_parallel_layout
    if layout is None:
        return
    others = [
        flag
        for flag, given in (
            ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage),
            ("--num-virtual-stages-per-pipeline-rank", p.num_virtual_stages_per_pipeline_rank),
            ("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers),
            (
                "--account-for-embedding-in-pipeline-split",
                p.account_for_embedding_in_pipeline_split,
            ),
            ("--account-for-loss-in-pipeline-split", p.account_for_loss_in_pipeline_split),
        )
        if given
    ]
    require(
        not others,
        f"--pipeline-model-parallel-layout says where every layer goes: drop {', '.join(others)}",
    )
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        parsed = PipelineParallelLayerLayout(layout, p.pipeline_model_parallel_size)
        mtp_elsewhere = parsed.validate_layer_layout(m.num_layers, m.mtp_num_layers)
    except AssertionError as error:
        raise ConfigError(f"--pipeline-model-parallel-layout {layout!r}: {error}") from None
    require(
        not mtp_elsewhere,
        f"--pipeline-model-parallel-layout {layout!r} puts MTP layers (m) on a pipeline rank "
        "before the last: put them in the last rank's stage, with the loss (L)",
    )


def check_virtual_stages(config: Config) -> None:
    """Megatron-LM's rules for the interleaved schedule's flags, then the
    schedule's own (checked now, not at the first iteration)."""
    _check_virtual_stage_flags(config)
    if config.virtual_pipeline_model_parallel_size is not None:
        _check_interleaved_schedule(config)


def _check_virtual_stage_flags(config: Config) -> None:
    p, layers = config.parallel, config.split_layers
    if p.pipeline_model_parallel_layout is not None:
        return  # check_layer_layout
    per_layer, stages = (
        p.num_layers_per_virtual_pipeline_stage,
        p.num_virtual_stages_per_pipeline_rank,
    )
    require(
        per_layer is None or stages is None,
        "give one of --num-layers-per-virtual-pipeline-stage and "
        "--num-virtual-stages-per-pipeline-rank, not both",
    )
    if _uneven_stages(p):
        require(
            per_layer is None,
            "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-"
            "layers (as Megatron-LM): give the virtual stages as "
            "--num-virtual-stages-per-pipeline-rank",
        )
        return  # the stages' own split is checked by check_split
    pp = p.pipeline_model_parallel_size
    if per_layer is not None:
        require(
            per_layer > 0 and (layers // pp) % per_layer == 0,
            f"--num-layers-per-virtual-pipeline-stage {per_layer} does not divide the "
            f"{layers // pp} layers of each pipeline stage (--num-layers {layers} / "
            f"--pipeline-model-parallel-size {pp}): use a divisor of {layers // pp}",
        )
    require(
        stages is None or stages > 0,
        f"--num-virtual-stages-per-pipeline-rank {stages} must be positive",
    )
    require_with(
        "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank "
        "(more than one virtual stage)",
        config.virtual_pipeline_model_parallel_size is not None,
        [
            (
                "--microbatch-group-size-per-virtual-pipeline-stage",
                p.microbatch_group_size_per_vp_stage is not None,
            )
        ],
    )


def _check_interleaved_schedule(config: Config) -> None:
    p = config.parallel
    pp, overlap = p.pipeline_model_parallel_size, p.overlap_p2p_comm
    require(
        pp > (1 if overlap else 2),
        f"the interleaved schedule (virtual pipeline stages) needs --pipeline-model-parallel-size "
        f"> {1 if overlap else 2}"
        + ("" if overlap else " with --no-overlap-p2p-communication")
        + f", not {pp}",
    )
    problem = interleaving_problem_at(config, config.data_parallel_size)
    require(
        problem is None,
        f"the interleaved schedule cannot run {problem}: give a --global-batch-size whose "
        "share per replica (in microbatches) is a multiple of the pipeline size, or set "
        "--microbatch-group-size-per-virtual-pipeline-stage",
    )


def check_split(config: Config) -> None:
    """megatron-core's rules for splitting the layers between pipeline
    stages (evenly, with first and last stages of their own size, or with
    the embedding and loss counted as layers), in the flags' words."""
    p = config.parallel
    if p.pipeline_model_parallel_layout is not None:
        return  # check_layer_layout
    problem = _uneven_split_problem(config) if _uneven_stages(p) else _even_split_problem(config)
    require(problem is None, problem or "")


def _uneven_stages(p) -> bool:
    return (
        p.decoder_first_pipeline_num_layers is not None
        or p.decoder_last_pipeline_num_layers is not None
    )


def _even_split_problem(config: Config) -> Optional[str]:
    p, layers = config.parallel, config.split_layers
    pp, vp = p.pipeline_model_parallel_size, config.model_chunks
    if layers % (pp * vp) == 0:
        return None
    counted = [
        "--account-for-" + part + "-in-pipeline-split"
        for part, on in (
            ("embedding", p.account_for_embedding_in_pipeline_split),
            ("loss", p.account_for_loss_in_pipeline_split),
        )
        if on
    ]
    what = f"--num-layers {config.model.num_layers}"
    if counted:
        what += f" + 1 for each of {', '.join(counted)}"
    over = f"--pipeline-model-parallel-size {pp}"
    if vp > 1:
        over += f" x --num-virtual-stages-per-pipeline-rank {vp}"
    return (
        f"{what} does not split evenly over {over}: make the count a multiple of "
        f"{pp * vp}, or give --decoder-first/last-pipeline-num-layers"
    )


def _uneven_split_problem(config: Config) -> Optional[str]:
    p = config.parallel
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    pp, vp = p.pipeline_model_parallel_size, config.model_chunks
    ends = {
        flag: n
        for flag, n in (
            ("--decoder-first-pipeline-num-layers", first),
            ("--decoder-last-pipeline-num-layers", last),
        )
        if n is not None
    }
    given = " ".join(f"{flag} {n}" for flag, n in ends.items())
    if p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split:
        return (
            f"{given} with --account-for-embedding-in-pipeline-split or "
            "--account-for-loss-in-pipeline-split: give the stages' sizes or let the "
            "embedding and loss count, not both"
        )
    middle_layers = config.model.num_layers - sum(ends.values())
    middle_stages = pp - len(ends)
    if middle_stages < 0:
        return f"{given} needs --pipeline-model-parallel-size {len(ends)} or more, not {pp}"
    if any(n <= 0 or n % vp for n in ends.values()):
        return (
            f"{given}: each must be a positive multiple of the {vp} virtual stage(s) per "
            "pipeline rank"
        )
    if middle_stages == 0 and middle_layers == 0:
        return None
    if middle_stages == 0 or middle_layers <= 0 or middle_layers % (middle_stages * vp):
        return (
            f"{given} leave {middle_layers} of --num-layers {config.model.num_layers} to "
            f"{middle_stages} middle pipeline stage(s)"
            + (f" x {vp} virtual stages" if vp > 1 else "")
            + ", which do not split evenly: change --num-layers or the first/last stage's layers"
        )
    return None
