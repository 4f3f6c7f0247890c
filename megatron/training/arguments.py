"""Command line: flags generated from the config dataclasses, parsed into a checked Config.

Parsing fills the Config's derived defaults and runs every check
(megatron/training/flags/, a module per section).

Every check runs before any process group exists, so bad input costs
nothing and each message says which flag to change. Megatron-LM's scripts
import their names from here: ``parse_args`` and
``core_transformer_config_from_args``.
"""

import argparse
import dataclasses
import json
import os
import typing
from typing import Callable, Dict, List, Optional, Sequence

from megatron.training.config import SECTIONS, Config, RunContext
from megatron.training.flags import host
from megatron.training.flags.checks import validate
from megatron.training.flags.defaults import fill_defaults
from megatron.training.flags.gpu import gpu_features_given  # noqa: F401 - deadpool_ext/config.py's
from megatron.training.flags.refusal import ConfigError, flag_name, require, say
from megatron.training.flags.refusal import warn as _warn  # deadpool_ext/config.py's name for it
from megatron.training.global_vars import (  # noqa: F401 - Megatron-LM's scripts import it here
    core_transformer_config_from_args,
)


def _base_type(annotation):
    """int for Optional[int]; (list, int) for Optional[List[int]]."""
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) in (list, List):
        return list, typing.get_args(annotation)[0]
    return annotation, None


def add_section_flags(parser: argparse.ArgumentParser, title: str, cls) -> None:
    """Add one flag per dataclass field, in a group named after the section."""
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        meta = f.metadata
        kind, item = _base_type(f.type)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs = {"dest": f.name, "default": default, "help": meta.get("help", "")}
        if kind is bool:  # a flag named --no-... turns a default of True off
            kwargs["action"] = "store_false" if default else "store_true"
        elif kind is list and meta.get("action") == "append":  # a repeatable flag
            kwargs.update(type=item, action="append")
        elif kind is list:
            kwargs.update(type=item, nargs=meta.get("nargs", "+"))
        elif "nargs" in meta:  # one value or several, as Megatron-LM's MoE flags
            kwargs.update(type=kind, nargs=meta["nargs"])
        else:
            kwargs["type"] = kind
        if "parse" in meta:  # a value read by a function of its own (--moe-layer-freq)
            kwargs["type"] = meta["parse"]
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        group.add_argument(flag_name(f), *meta.get("aliases", ()), **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse's refusals (an unknown flag, a bad value) as ConfigError,
    the same path as every other check: the caller says it and exits 2."""

    def error(self, message: str):
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ConfigError(unknown_flags_message(unknown, list(self._option_string_actions)))
        return namespace


# Megatron-LM's options at the tag of our megatron-core, with their defaults
# (tools/flag_parity.py reads it too).
UPSTREAM_FLAGS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "docs",
    "data",
    "megatron-lm-core_v0.16.1-flags.json",
)


def unknown_flags_message(unknown: Sequence[str], known: Sequence[str]) -> str:
    """What is wrong with each flag not taken: one of Megatron-LM's that this
    build lacks (the feature it selects and why that is not here, else its
    row in docs/megatron-lm-flags.md), or a typo of one of ours (the
    nearest), or neither. Values after them are left out."""
    import difflib

    from megatron.training.missing_features import by_feature

    try:
        with open(UPSTREAM_FLAGS) as f:
            upstream = set(json.load(f))
    except OSError:  # an installed package without the docs
        upstream = set()
    said = []
    for feature, flags in by_feature(
        u.split("=", 1)[0] for u in unknown if u.startswith("-")
    ).items():
        if feature is not None:
            said.append(f"{', '.join(flags)}: Megatron-LM's {feature.name}, {feature.why}")
            continue
        for flag in flags:
            if flag in upstream:
                said.append(
                    f"{flag} is Megatron-LM's, not supported here yet (docs/megatron-lm-flags.md)"
                )
                continue
            near = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
            said.append(f"unknown flag {flag}" + (f": did you mean {near[0]}?" if near else ""))
    return "; ".join(said) or f"unexpected arguments: {' '.join(unknown)}"


def build_parser(sections: Dict[str, type]) -> argparse.ArgumentParser:
    parser = _Parser(
        description="GPT pretraining on megatron-core (Megatron-LM flags).", allow_abbrev=False
    )
    for title, cls in sections.items():
        add_section_flags(parser, title, cls)
    return parser


def _section_from_namespace(cls, namespace):
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def _check_required(sections, namespace) -> None:
    missing = [
        flag_name(f)
        for cls in sections.values()
        for f in dataclasses.fields(cls)
        if f.metadata.get("required") and getattr(namespace, f.name) is None
    ]
    if missing:
        raise ConfigError("missing required flags: " + ", ".join(missing))


Validator = Callable[[Config], None]


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_sections: Optional[Dict[str, type]] = None,
    extra_validators: Sequence[Validator] = (),
    world_size: Optional[int] = None,
    defaults: Optional[Dict[str, object]] = None,
    extra_args_provider: Optional[Callable] = None,
) -> Config:
    """Parse flags into a Config, fill derived defaults and validate it.

    ``extra_sections`` lets an extension (deadpool) add its own dataclass of
    flags, under a title for the help; its parsed section is
    ``config.section(cls)``. ``defaults`` and ``extra_args_provider`` are
    what a script written against Megatron-LM's ``pretrain`` gives
    (megatron_lm.py): defaults by flag destination, and a function that adds
    the script's own flags to the parser (their values land in
    ``config.run.script_args``). Raises
    ConfigError with a message naming the flag to change.
    """
    extra_sections = extra_sections or {}
    sections = {**SECTIONS, **extra_sections}
    parser = build_parser(sections)
    ours = {f.name for cls in sections.values() for f in dataclasses.fields(cls)}
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    theirs = {a.dest for a in parser._actions if a.dest not in ours and a.dest != "help"}
    unknown = sorted(set(defaults or {}) - ours - theirs)
    require(not unknown, f"args_defaults names {', '.join(unknown)}: no flag here has that name")
    namespace = parser.parse_args(argv)
    _apply_script_defaults(namespace, defaults or {})
    take_checkpoint_args(namespace)
    _check_required(sections, namespace)
    parsed = {name: _section_from_namespace(cls, namespace) for name, cls in sections.items()}
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = Config(
        **{name: parsed[name] for name in SECTIONS},
        world_size=world_size,
        run=RunContext(script_args={dest: getattr(namespace, dest) for dest in theirs}),
        extensions={cls: parsed[name] for name, cls in extra_sections.items()},
    )
    fill_defaults(config)
    validate(config)
    for check in extra_validators:
        check(config)
    return config


def _apply_script_defaults(namespace: argparse.Namespace, defaults: Dict[str, object]) -> None:
    """A script's args_defaults, as Megatron-LM applies them: to the flags
    still None; a value given (or a default of this build) wins, with a
    warning where it differs."""
    for dest, value in defaults.items():
        if getattr(namespace, dest) is None:
            setattr(namespace, dest, value)
        elif getattr(namespace, dest) != value:
            _warn(f"args_defaults {dest}={value!r} not applied: it is {getattr(namespace, dest)!r}")


# --use-checkpoint-args, as Megatron-LM: (flag's dest, forced). A forced
# value replaces the command line's; the others fill only flags left unset.
# Megatron-LM's names this build has no flag for are not taken.
CHECKPOINT_ARGS = (
    ("num_layers", False),
    ("hidden_size", False),
    ("ffn_hidden_size", False),
    ("seq_length", False),
    ("num_attention_heads", False),
    ("num_query_groups", True),
    ("group_query_attention", True),
    ("kv_channels", False),
    ("max_position_embeddings", False),
    ("position_embedding_type", True),
    ("rotary_base", True),
    ("rotary_percent", True),
    ("disable_bias_linear", True),
    ("swiglu", True),
    ("untie_embeddings_and_output_weights", True),
    ("normalization", True),
    ("attention_dropout", True),
    ("hidden_dropout", True),
    ("num_experts", True),
    ("moe_ffn_hidden_size", True),
    ("moe_router_topk", True),
    ("moe_token_dispatcher_type", False),
    ("moe_router_pre_softmax", True),
    ("moe_grouped_gemm", True),
    ("moe_shared_expert_intermediate_size", True),
    ("moe_router_score_function", True),
    ("moe_router_topk_scaling_factor", True),
    ("tiktoken_pattern", True),
)


TOKENIZER_ARGS = (("tokenizer_model", True), ("tokenizer_type", True))


LAYOUT_ARGS = (
    ("tensor_model_parallel_size", True),
    ("pipeline_model_parallel_size", True),
    ("expert_model_parallel_size", True),
)


def take_checkpoint_args(namespace: argparse.Namespace) -> None:
    """--use-checkpoint-args: the model's flags from the checkpoint in --load
    (the command line's where it holds none, as Megatron-LM)."""
    if not namespace.use_checkpoint_args:
        return
    # Reading a checkpoint needs torch and megatron-core; parsing alone does not.
    checkpoints = host.import_with_megatron_core("megatron.training.checkpointing")
    saved = checkpoints.saved_args(namespace.load) if namespace.load else None
    if saved is None:
        say(f"--use-checkpoint-args: no checkpoint in --load {namespace.load}; using the flags")
        return
    if hasattr(saved, "add_bias_linear"):  # Megatron-LM's dest for --disable-bias-linear
        saved.disable_bias_linear = not saved.add_bias_linear
    table = CHECKPOINT_ARGS
    table += TOKENIZER_ARGS if namespace.use_tokenizer_model_from_checkpoint_args else ()
    table += LAYOUT_ARGS if namespace.use_mp_args_from_checkpoint_args else ()
    taken = []
    for name, forced in table:
        value = getattr(saved, name, None)
        if value is not None and (forced or getattr(namespace, name) is None):
            setattr(namespace, name, value)
            taken.append(f"{name}={value}")
    say(f"--use-checkpoint-args: from {namespace.load}: " + ", ".join(taken))
