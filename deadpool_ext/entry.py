"""What a training script runs once its flags are parsed: a rank with recovery, or the mirror.

The scripts are pretrain_gpt.py and any script written against Megatron-LM's
training API, whose ``megatron.training.pretrain`` finds this module as the
installed runner (setup.py's ``megatron.training.runners`` entry point:
megatron/training never imports deadpool_ext).

Under deadpool-launch the rank runs with recovery (rank/main.py); under
torchrun with ``--deadpool`` it trains with the buddy mirror only.
"""

import os

from megatron.training.arguments import ConfigError
from megatron.training.config import Config

from deadpool_ext.config import parse_args, section

__all__ = ["parse_args", "run_training"]


def run_training(config: Config, model_provider, forward_step) -> int:
    """Train; returns the exit code (a rank under deadpool-launch exits in
    rank/main.py, its own main). Raises ConfigError when deadpool-launch
    started a run without --deadpool."""
    if "DEADPOOL_SLOT" in os.environ:  # started by deadpool-launch: recovery on
        if not section(config).deadpool:
            raise ConfigError("deadpool-launch runs training with recovery: add --deadpool")
        from deadpool_ext.rank.main import run

        return run(config, model_provider, forward_step)
    from megatron.training.training import pretrain

    from deadpool_ext.rank.hooks import deadpool_hooks

    return pretrain(config, model_provider, forward_step, hooks=deadpool_hooks(config))
