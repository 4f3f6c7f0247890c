"""Every check a parsed config must pass before a run starts, in one order.

The order is what a user meets: the first refusal of a command line that
has several problems is always the same one.
"""

from megatron.training.config import Config
from megatron.training.flags import (
    batch,
    checkpoint,
    data,
    gpu,
    logs,
    megatron_core,
    model,
    moe,
    parallel,
    pipeline,
    precision,
    training,
)


def validate(config: Config) -> None:
    """Every check a run needs before it starts; each names what to change."""
    for check in (
        pipeline.check_layer_layout,  # first: the virtual stages follow from it
        parallel.check_gpus,
        parallel.check,
        model.check_shape,
        model.check_features,
        moe.check,
        moe.check_routing,
        model.check_multi_token_prediction,
        training.check_recompute,
        batch.check,
        pipeline.check_virtual_stages,
        pipeline.check_split,
        training.check,
        precision.check,
        training.check_determinism,
        training.check_schedule_source,
        precision.check_fp8,
        gpu.check,
        data.check,
        checkpoint.check,
        logs.check,
        # megatron-core's own, last: they import it.
        megatron_core.check,
        data.check_index,
    ):
        check(config)
