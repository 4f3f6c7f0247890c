"""megatron-core's own refusals of a run's settings, met at parse time:
its TransformerConfig built once from the parsed config, as the model
will be."""

from megatron.training.config import Config
from megatron.training.flags import host
from megatron.training.flags.gpu import gpu_features_given
from megatron.training.flags.refusal import ConfigError


def check(config: Config) -> None:
    """megatron-core's own checks of MoE, recompute, MTP, layout and FP8
    settings (its TransformerConfig), run now rather than when the model is
    built."""
    if (
        config.moe.num_experts is None
        and config.training.fp8 is None
        and config.training.recompute_granularity is None
        and config.model.mtp_num_layers is None
        and config.parallel.pipeline_model_parallel_layout is None
        and not gpu_features_given(config)
    ):
        return
    model_setup = host.import_with_megatron_core("megatron.training.model_setup")
    try:
        model_setup.transformer_config(config, on_cpu=config.parallel.distributed_backend == "gloo")
    except (ValueError, AssertionError) as error:
        raise ConfigError(f"megatron-core refuses these settings: {error}") from None
