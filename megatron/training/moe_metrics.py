"""The auxiliary losses, as Megatron-LM logs them: the MoE layers' and the
multi-token-prediction layers'.

megatron-core's
router adds each layer's load-balancing and z losses to its tracker during
the forward passes; after every iteration every rank reduces the tracker
(over pipeline and data-parallel ranks: collective) and the log line shows
each loss averaged over layers and microbatches ('load_balancing_loss',
'z_loss', ...), TensorBoard and W&B get the same names (and each layer's
with --moe-per-layer-logging). The MTP layers (on the last pipeline stage)
add each microbatch's loss to a tracker of their own, averaged over the
data-parallel ranks there: 'mtp_1 loss', ... after the router's."""

from typing import Dict, List, Tuple

import torch

from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
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
    types = types if isinstance(types, list) else [types]  # not 'aux_loss' in 'seq_aux_loss'
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
    totals: Dict[str, object] = {}
    scalars = _Scalars()
    if config.moe.num_experts is not None:
        _track_router_losses(config, num_microbatches, iteration, totals, scalars)
    if config.model.mtp_num_layers is not None:
        MTPLossLoggingHelper.track_mtp_metrics(
            1 / num_microbatches, iteration, writer=scalars, total_loss_dict=totals
        )
    return {name: float(value) for name, value in totals.items()}, scalars.values


def _track_router_losses(config: Config, num_microbatches: int, iteration: int, totals, scalars):
    names = track_names(config)
    _start_tracker(names, config.model.num_layers + (config.model.mtp_num_layers or 0))
    track_moe_metrics(
        loss_scale=1 / num_microbatches,
        iteration=iteration,
        writer=scalars,
        total_loss_dict=totals,
        per_layer_logging=config.moe.moe_per_layer_logging,
        force_initialize=True,
        track_names=names,
        num_layers=config.model.num_layers,
        # the mean over the MoE layers only (the MTP layers' are MoE ones)
        moe_layer_freq=config.moe.moe_layer_freq,
        mtp_num_layers=config.model.mtp_num_layers,
    )


def _start_tracker(names: List[str], layers: int) -> None:
    """Each tracked loss's per-layer sums, as zeros where no layer of this
    stage added to them, at the size the routers make them (their layers and
    the MTP layers): the sums are then added over the pipeline stages.
    megatron-core's own start makes them without the MTP layers, and a stage
    with no MoE layer then hangs the last one's sum (or corrupts it)."""
    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:
        if name not in tracker:
            tracker[name] = dict(
                values=torch.zeros(layers, device=torch.cuda.current_device()),
                reduce_group=None,
                avg_group=None,
                reduce_group_has_dp=False,
            )


def forget() -> None:
    """Drop what validation's forward passes added to the router's tracker
    (the MTP layers add nothing outside training)."""
    clear_aux_losses_tracker()


def abandon() -> None:
    """An iteration stopped midway will be redone: drop its partial sums
    (the redone one must log what a failure-free run logs) and the process
    groups the tracker holds (a recovery replaces them)."""
    get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()
