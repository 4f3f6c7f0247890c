"""The checks of the pipeline schedule (megatron/training/flags/pipeline.py),
parsed in-process: virtual stages, a pipeline layout and uneven splits as
Megatron-LM and megatron-core take or refuse them, the flags named."""

import pytest

from megatron.training.arguments import parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, argv


def test_virtual_pipeline_stages_follow_megatron_lms_rules():
    """Megatron-LM's derivation of the virtual stages and its checks, and
    megatron-core's microbatch rule checked before any process group."""
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    config = parse_args(argv(*pp2, "--num-layers-per-virtual-pipeline-stage", "1"), world_size=2)
    assert config.virtual_pipeline_model_parallel_size == 2 and config.model_chunks == 2
    assert config.parallel.overlap_p2p_comm  # Megatron-LM's default with virtual stages
    config = parse_args(argv(*pp2, "--num-virtual-stages-per-pipeline-rank", "1"), world_size=2)
    assert config.virtual_pipeline_model_parallel_size is None and config.model_chunks == 1
    assert not config.parallel.overlap_p2p_comm  # off without virtual stages, as Megatron-LM
    both = ("--num-layers-per-virtual-pipeline-stage", "1")
    both += ("--num-virtual-stages-per-pipeline-rank", "2")
    _names_all(_config_error(argv(*pp2, *both), world_size=2), *both[::2])
    message = _config_error(
        argv(*pp2, "--num-layers-per-virtual-pipeline-stage", "3"), world_size=2
    )
    _names_all(message, "--num-layers-per-virtual-pipeline-stage")
    message = _config_error(argv(*pp2, "--num-virtual-stages-per-pipeline-rank", "4"), world_size=2)
    _names_all(message, "--num-virtual-stages-per-pipeline-rank", "--num-layers")
    message = _config_error(argv("--num-virtual-stages-per-pipeline-rank", "2"))
    _names_all(message, "--pipeline-model-parallel-size")
    no_overlap = [*pp2, "--num-virtual-stages-per-pipeline-rank", "2"]
    message = _config_error(argv(*no_overlap, "--no-overlap-p2p-communication"), world_size=2)
    _names_all(message, "--no-overlap-p2p-communication", "> 2")
    group = ["--microbatch-group-size-per-virtual-pipeline-stage", "2"]
    _names_all(_config_error(argv(*pp2, *group), world_size=2), group[0])
    # 8 samples of 2 over DP 2 and PP 2: 2 microbatches per replica run;
    # over DP 4 one each does not (fewer than a pipeline's worth).
    parse_args(argv(*no_overlap), world_size=4)
    message = _config_error(argv(*no_overlap), world_size=8)
    _names_all(message, "--global-batch-size", "1 microbatch(es) per replica")
    # 6 microbatches in groups of 4 leave a last group of 2: fine; of 1: not.
    six = argv(*no_overlap, "--global-batch-size", "12", "--num-layers", "8")
    parse_args(six + ["--microbatch-group-size-per-virtual-pipeline-stage", "4"], world_size=2)
    message = _config_error(
        six + ["--microbatch-group-size-per-virtual-pipeline-stage", "5"], world_size=2
    )
    _names_all(message, "last group of 1")
    # megatron-core's fully reshardable save of a tied embedding is fixed
    # here (test_determinism_and_resume.py): the interleaved schedule takes it.
    parse_args(argv(*no_overlap, "--dist-ckpt-optim-fully-reshardable"), world_size=2)


def test_a_pipeline_layout_is_read_and_checked_as_megatron_core_does():
    """Its stages beyond the pipeline size are virtual stages; a layout
    megatron-core refuses is refused here, before any process group, with
    the flag named; so is any other split given with it, and MTP layers on
    a rank before the last (only the first and last ranks read data)."""
    layout = "--pipeline-model-parallel-layout"
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    config = parse_args(argv(*pp2, layout, "Et|(tt|)*4tL", num_layers=10), world_size=2)
    assert config.virtual_pipeline_model_parallel_size == 3
    assert parse_args(argv(*pp2, layout, "Ettt|tL"), world_size=2).model_chunks == 1
    for bad, words in (
        ("Ettt|ttL", "Number of decoder layers 5"),  # --num-layers 4
        ("Ett|tt|L", "must be divisible by pipeline_model_parallel_size"),
        ("tEtt|tL", "The first layer must be embedding"),
        ("Ettx|tL", "Invalid layer character: x"),
    ):
        _names_all(_config_error(argv(*pp2, layout, bad), world_size=2), layout, words)
    message = _config_error(argv(*pp2, layout, "Ettt|tL", FIRST, "3"), world_size=2)
    _names_all(message, "drop --decoder-first-pipeline-num-layers")
    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    mtp += ["--untie-embeddings-and-output-weights"]
    pp3 = ["--pipeline-model-parallel-size", "3", "--global-batch-size", "6"]
    parse_args(argv(*pp3, *mtp, layout, "Ett|t|tmL"), world_size=3)
    message = _config_error(argv(*pp3, *mtp, layout, "Ett|ttm|L"), world_size=3)
    _names_all(message, "puts MTP layers (m) on a pipeline rank before the last")


FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING = "--account-for-embedding-in-pipeline-split"
LOSS = "--account-for-loss-in-pipeline-split"
VP = "--num-virtual-stages-per-pipeline-rank"
SPLITS = [
    # (pp, layers, extra flags, accepted)
    (4, 12, [FIRST, "2", LAST, "2"], True),
    (4, 12, [FIRST, "3"], True),
    (4, 12, [FIRST, "2"], False),  # 10 over 3 middle stages
    (2, 6, [FIRST, "2", LAST, "4"], True),
    (2, 6, [FIRST, "2", LAST, "3"], False),
    (4, 8, [FIRST, "0"], False),
    (4, 12, [FIRST, "2", LAST, "2", VP, "2"], True),
    (4, 12, [FIRST, "2", VP, "2"], False),
    (4, 12, [FIRST, "3", VP, "3"], True),
    (4, 12, [FIRST, "1", VP, "2"], False),
    (4, 6, [EMBEDDING, LOSS], True),
    (4, 6, [EMBEDDING], False),
    (4, 6, [EMBEDDING, LOSS, VP, "2"], True),
    (4, 7, [EMBEDDING, VP, "2"], True),
    (4, 10, [EMBEDDING, LOSS, VP, "2"], False),
    (4, 12, [LOSS, FIRST, "3"], False),
    (4, 6, [], False),
]


@pytest.mark.parametrize("pp,layers,flags,accepted", SPLITS)
def test_pipeline_splits_are_megatron_cores(pp, layers, flags, accepted):
    """Uneven pipeline stages and the embedding and loss counted as layers:
    what parses here is what megatron-core builds, and what it refuses is
    refused before any process group with the flags named."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    line = argv(
        *flags,
        "--pipeline-model-parallel-size",
        str(pp),
        "--global-batch-size",
        "8",
        num_layers=layers,
    )
    p = ["--pipeline-model-parallel-size", "--num-layers"]
    core = dict(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    given = dict(zip(flags, flags[1:] + [None]))

    def number(flag):
        return int(given[flag]) if flag in given else None

    def core_config():
        vp = number("--num-virtual-stages-per-pipeline-rank")
        return TransformerConfig(
            **core,
            virtual_pipeline_model_parallel_size=vp if vp != 1 else None,
            num_layers_in_first_pipeline_stage=number("--decoder-first-pipeline-num-layers"),
            num_layers_in_last_pipeline_stage=number("--decoder-last-pipeline-num-layers"),
            account_for_embedding_in_pipeline_split="--account-for-embedding-in-pipeline-split"
            in given,
            account_for_loss_in_pipeline_split="--account-for-loss-in-pipeline-split" in given,
        )

    if accepted:
        parse_args(line, world_size=pp)
        core_config()  # megatron-core agrees
        return
    if flags:  # megatron-core refuses it too (it does not check an even split itself)
        with pytest.raises(ValueError):
            core_config()
    message = _config_error(line, world_size=pp)
    named = [f for f in flags if f.startswith("--") and f.split("-")[2] in ("decoder", "account")]
    _names_all(message, *(named[:1] or p[:1]))


def test_layers_not_divisible_by_pp():
    message = _config_error(argv("--pipeline-model-parallel-size", "3", num_layers=4), world_size=3)
    _names_all(message, "--num-layers", "--pipeline-model-parallel-size")
