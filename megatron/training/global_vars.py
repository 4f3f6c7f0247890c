"""The run a script written against Megatron-LM's training API reads, by Megatron-LM's names.

megatron_lm.py sets it: Megatron-LM's ``global_vars`` names, ``get_args``,
``get_timers``, ``get_tokenizer``, and the run's megatron-core
TransformerConfig (``core_transformer_config_from_args``, which such a
script imports from ``megatron.training.arguments``, as Megatron-LM's)."""

import argparse
from typing import Optional

from megatron.training.config import Config


class _Run:
    """The run this process trains: its config (the latest a model was built
    for) and the namespace Megatron-LM's callbacks read."""

    config: Optional[Config] = None
    args: Optional[argparse.Namespace] = None
    tf_config = None  # the trainer's: the model is built with it
    tokenizer = None


def get_args() -> argparse.Namespace:
    if _Run.args is None:
        raise RuntimeError("get_args(): no run yet: megatron.training.pretrain() parses the flags")
    return _Run.args


def get_timers():
    """The trainer's timers (megatron-core's ``Timers``: ``timers(name,
    log_level=...).start()``)."""
    return getattr(_Run.tf_config, "timers", None)


def get_tokenizer():
    if _Run.config is not None and _Run.config.run.tokenizer is not None:
        return _Run.config.run.tokenizer
    return _Run.tokenizer  # a spare's, built before its trainer


def core_transformer_config_from_args(args, config_class=None):
    """megatron-core's TransformerConfig of the run, as Megatron-LM's function
    of the same name: the very one this package's trainer builds the model
    with, where its schedule hooks are (gradient reduction, loss scaling)."""
    if _Run.config is None or args is not _Run.args:
        raise RuntimeError(
            "core_transformer_config_from_args(): give it get_args(), the run's namespace"
        )
    if config_class is not None:
        raise NotImplementedError("core_transformer_config_from_args(config_class=...): not here")
    if _Run.tf_config is not None:
        return _Run.tf_config
    from megatron.training.model_setup import transformer_config

    return transformer_config(_Run.config, on_cpu=_Run.config.run.on_cpu)
