"""Checks of the numeric precision: bf16 or fp16, and FP8 through
Transformer Engine."""

from megatron.training.config import Config
from megatron.training.flags import host
from megatron.training.flags.refusal import ignored_without, require


def check(config: Config) -> None:
    t = config.training
    require(not (t.bf16 and t.fp16), "give only one of --bf16 and --fp16")
    ignored_without("--bf16", t.bf16, [("--grad-reduce-in-bf16", t.grad_reduce_in_bf16)])


def check_fp8(config: Config) -> None:
    t, m = config.training, config.model
    set_without = ignored_without(
        "--fp8-format",
        t.fp8 is not None,
        [
            ("--fp8-recipe", t.fp8_recipe != "delayed"),
            ("--fp8-amax-history-len", t.fp8_amax_history_len != 1),
            ("--fp8-amax-compute-algo", t.fp8_amax_compute_algo != "most_recent"),
            ("--fp8-param-gather", t.fp8_param_gather),
            ("--first-last-layers-bf16", t.first_last_layers_bf16),
        ],
    )
    ignored_without(
        "--first-last-layers-bf16",
        t.first_last_layers_bf16,
        [
            ("--num-layers-at-start-in-bf16", t.num_layers_at_start_in_bf16 != 1),
            ("--num-layers-at-end-in-bf16", t.num_layers_at_end_in_bf16 != 1),
        ],
    )
    if t.fp8 is None:
        return
    on_gpu = config.parallel.distributed_backend == "nccl"
    require(
        on_gpu and host.importable("transformer_engine") and m.transformer_impl != "local",
        f"--fp8-format {t.fp8} runs Transformer Engine's FP8 layers, which need a GPU with "
        "FP8 (Hopper or newer) and the transformer_engine package: drop "
        + ", ".join(["--fp8-format"] + set_without)
        + " here",
    )
    require(
        not t.fp8_param_gather or config.parallel.use_distributed_optimizer,
        "--fp8-param-gather goes with --use-distributed-optimizer (as Megatron-LM)",
    )
