"""The MoE layers' auxiliary losses, as Megatron-LM logs them: megatron-core's
router adds each layer's load-balancing and z losses to its tracker during
the forward passes; after every iteration every rank reduces the tracker
(over pipeline and data-parallel ranks: collective) and the log line shows
each loss averaged over layers and microbatches ('load_balancing_loss',
'z_loss', ...), TensorBoard and W&B get the same names (and each layer's
with --moe-per-layer-logging)."""

from typing import Dict, List, Tuple

from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    track_moe_metrics,
)

from megatron.training.config import Config

# --moe-router-load-balancing-type -> the tracker's name, Megatron-LM's table.
TRACKED = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def track_names(config: Config) -> List[str]:
    moe = config.moe
    types = moe.moe_router_load_balancing_type
    names = [name for kind, name in TRACKED.items() if kind in types]
    if moe.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


class _Scalars:
    """What megatron-core hands a TensorBoard writer, kept for ours."""

    def __init__(self) -> None:
        self.values: Dict[str, float] = {}

    def add_scalar(self, name: str, value, iteration: int) -> None:
        self.values[name] = float(value)


def aux_losses(
    config: Config, num_microbatches: int, iteration: int
) -> Tuple[Dict[str, float], Dict[str, float]]:
    """This iteration's (losses for the log line, scalars for the
    dashboards), and the tracker emptied. Every rank calls it."""
    if config.moe.num_experts is None:
        return {}, {}
    totals: Dict[str, object] = {}
    scalars = _Scalars()
    track_moe_metrics(
        loss_scale=1 / num_microbatches,
        iteration=iteration,
        writer=scalars,
        total_loss_dict=totals,
        per_layer_logging=config.moe.moe_per_layer_logging,
        force_initialize=True,
        track_names=track_names(config),
        num_layers=config.model.num_layers,
    )
    return {name: float(value) for name, value in totals.items()}, scalars.values


def forget() -> None:
    """Drop what validation's forward passes added to the tracker."""
    clear_aux_losses_tracker()


def abandon() -> None:
    """An iteration stopped midway will be redone: drop its partial sums
    (the redone one must log what a failure-free run logs) and the process
    groups the tracker holds (a recovery replaces them)."""
    get_moe_layer_wise_logging_tracker().clear()
