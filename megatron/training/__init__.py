"""GPT training on megatron-core, and Megatron-LM's training API for scripts written against it.

This package's trainer is training.py. The API, ``from megatron.training
import pretrain, get_args, ...``, is megatron_lm.py's, imported when one of
its names is first asked for, so that parsing flags stays light.
"""

MEGATRON_LM_API = (
    "pretrain",
    "get_args",
    "get_timers",
    "get_tokenizer",
    "print_rank_0",
    "print_rank_last",
    "is_last_rank",
)


def __getattr__(name: str):
    if name in MEGATRON_LM_API:
        from megatron.training import megatron_lm

        return getattr(megatron_lm, name)
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
