"""The checks as a whole (megatron/training/flags/checks.py), parsed
in-process, across the sections: a flag missing its companion or its GPU
is refused by name (a ConfigError whose message names the flag to
change), one Megatron-LM ignores without its companion or takes to no
effect is taken with a warning, and what megatron-core would refuse later
is refused at parse time."""

import pytest

from megatron.training.arguments import parse_args
from tests.unit_tests.training.command_line import PP2, PP3, VPP2, _config_error, _names_all, argv


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--profile"], ["--profile", "--use-pytorch-profiler"]),  # nsys: a GPU
        (["--profile", "--use-pytorch-profiler"], ["--tensorboard-dir"]),
        (
            ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"]
            + ["--profile-step-start", "5", "--profile-step-end", "5"],
            ["--profile-step-start", "--profile-step-end"],
        ),
        (["--cross-entropy-fusion-impl", "te"], ["--cross-entropy-loss-fusion"]),
        (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "--num-experts"]),
        (["--defer-embedding-wgrad-compute"], ["--defer-embedding-wgrad-compute", "> 1"]),
    ],
)
def test_a_flag_missing_its_companion_or_its_gpu_is_refused_by_name(flags, named):
    _names_all(_config_error(argv(*flags)), *named)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--profile-step-start", "3"], ["--profile-step-start", "--profile"]),
        (["--decoupled-min-lr", "1e-5"], ["--decoupled-min-lr", "--decoupled-lr"]),
        (["--grad-reduce-in-bf16"], ["--grad-reduce-in-bf16", "--bf16"]),
        (["--fp8-amax-history-len", "8"], ["--fp8-amax-history-len", "--fp8-format"]),
        (["--save-interval", "5", "--async-save"], ["--save-interval, --async-save", "--save"]),
        (["--exit-on-missing-checkpoint"], ["--exit-on-missing-checkpoint", "--load"]),
        (["--log-timers-to-tensorboard"], ["--log-timers-to-tensorboard", "--tensorboard-dir"]),
        (["--no-log-loss-scale-to-tensorboard"], ["--no-log-loss-scale-to-tensorboard"]),
        (["--moe-router-topk", "4"], ["--moe-router-topk", "--num-experts"]),
        (["--wgrad-deferral-limit", "2"], ["--wgrad-deferral-limit", "--defer-embedding"]),
        (["--cp-comm-type", "a2a"], ["--cp-comm-type", "--context-parallel-size > 1"]),
        (["--first-last-layers-bf16"], ["--first-last-layers-bf16", "--fp8-format"]),
        (
            ["--num-layers-at-end-in-bf16", "2"],
            ["--num-layers-at-end-in-bf16", "--first-last-layers-bf16"],
        ),
    ],
)
def test_a_flag_megatron_lm_ignores_without_its_companion_is_taken_with_a_warning(
    flags, named, capsys
):
    """Megatron-LM ignores these without their companion: so does this
    build, and says so (its own configs give some of them so)."""
    parse_args(argv(*flags), world_size=1)
    printed = capsys.readouterr().out
    assert "WARNING:" in printed and "no effect without" in printed
    _names_all(printed, *named)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ckpt-fully-parallel-save"], ["--ckpt-fully-parallel-save", "deprecated"]),
        (["--use-flash-attn"], ["--use-flash-attn", "legacy", "--attention-backend flash"]),
        (["--rotary-interleaved"], ["--rotary-interleaved", "--position-embedding-type rope"]),
        (
            ["--no-async-tensor-model-parallel-allreduce"],
            ["--no-async-tensor-model-parallel-allreduce", "no effect", "deprecated"],
        ),
        (
            ["--disable-async-tensor-model-parallel-allreduce"],
            ["--no-async-tensor-model-parallel-allreduce", "no effect"],
        ),
        (
            ["--save", "ckpt", "--async-save"],
            ["--async-save", "--use-persistent-ckpt-worker", "synchronous"],
        ),
    ],
)
def test_a_flag_megatron_lm_takes_to_no_effect_is_taken_with_a_warning(flags, words, capsys):
    config = parse_args(argv(*flags), world_size=1)
    printed = capsys.readouterr().out
    assert "WARNING:" in printed
    _names_all(printed, *words)
    # As Megatron-LM: an --async-save without the persistent worker is synchronous.
    assert config.checkpoint.async_save is False


@pytest.mark.parametrize(
    "flags, world, named",
    [
        (
            ["--save", "ckpt", "--save-interval", "4", "--save-retain-interval", "6"],
            1,
            ["--save-retain-interval 6", "--save-interval"],
        ),
        (["--save-retain-interval", "4"], 1, ["--save-retain-interval", "--save-interval"]),
        (
            PP2 + ["--overlap-p2p-communication-warmup-flush"],
            2,
            ["--overlap-p2p-communication-warmup-flush", "virtual stages"],
        ),
        (
            PP3
            + VPP2
            + ["--no-overlap-p2p-communication"]
            + ["--overlap-p2p-communication-warmup-flush"],
            3,
            ["--overlap-p2p-communication-warmup-flush", "--no-overlap-p2p-communication"],
        ),
        (
            ["--ddp-average-in-collective", "--calculate-per-token-loss"],
            1,
            ["--ddp-average-in-collective", "--calculate-per-token-loss"],
        ),
        (
            ["--use-flash-attn", "--deterministic-mode"],
            1,
            ["--use-flash-attn", "--deterministic-mode"],
        ),
    ],
)
def test_flags_megatron_core_would_refuse_later_are_refused_at_parse_time(flags, world, named):
    _names_all(_config_error(argv(*flags), world_size=world), *named)
