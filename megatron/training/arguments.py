"""Command line: flags generated from the config dataclasses, then checked.

Every check here runs before any process group exists, so bad input costs
nothing and each message says which flag to change.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import typing
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.training import gpu_sharing
from megatron.training.attention import (
    attention_masked_by,
    attention_problem,
    local_attention_lacks,
)
from megatron.training.config import (
    SECTIONS,
    TRACKER,
    Config,
    DataConfig,
    GpuConfig,
    ModelConfig,
    MoEConfig,
    RunContext,
    split_numbers,
)
from megatron.training.schedule import GlobalBatch, interleaving_problem_at, schedule_in_samples


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change. A
    main that catches it ends with ``EXIT_CODE``, argparse's code for bad
    flags, as Megatron-LM's scripts do (deadpool's agents read it as
    ``ExitCode.USAGE``)."""

    EXIT_CODE = 2


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


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
    _require(not unknown, f"args_defaults names {', '.join(unknown)}: no flag here has that name")
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
    legacy = _import_with_megatron_core("megatron.training.legacy_checkpoint")
    saved = legacy.saved_args(namespace.load) if namespace.load else None
    if saved is None:
        _say(f"--use-checkpoint-args: no checkpoint in --load {namespace.load}; using the flags")
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
    _say(f"--use-checkpoint-args: from {namespace.load}: " + ", ".join(taken))


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def fill_defaults(config: Config) -> None:
    """Megatron's derived defaults, computed from the other flags."""
    m, b, t = config.model, config.batch, config.training
    if m.ffn_hidden_size is None and m.hidden_size:
        m.ffn_hidden_size = int(8 * m.hidden_size / 3 / 64) * 64 if m.swiglu else 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if not m.group_query_attention:
        m.num_query_groups = m.num_attention_heads
    if m.use_rotary_position_embeddings:  # Megatron-LM's older spelling
        m.position_embedding_type = "rope"
    if b.global_batch_size is None and b.micro_batch_size and config.data_parallel_size > 0:
        b.global_batch_size = b.micro_batch_size * config.data_parallel_size
    _require(
        (t.train_iters is None) != (t.train_samples is None),
        "give exactly one of --train-iters and --train-samples",
    )
    if t.train_samples is not None and b.global_batch_size and _ramp_is_sound(config):
        # As Megatron-LM: whole global batches (a partial last one is dropped).
        t.train_iters = GlobalBatch(config).iterations(t.train_samples)
    elif t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    if config.tokenizer.tokenizer_type is None:
        from megatron.training.tokenizer import DEFAULT_TOKENIZER_TYPE

        config.tokenizer.tokenizer_type = DEFAULT_TOKENIZER_TYPE  # as Megatron-LM's pretrain_gpt.py
    fill_moe_defaults(config)
    fill_cuda_graph_defaults(config)
    if t.recompute_activations:
        t.recompute_granularity = "selective"  # as Megatron-LM
    if t.fp16 and t.loss_scale is None and t.check_for_nan_in_loss_and_grad:
        # As Megatron-LM: an overflow is the dynamic loss scaler's signal, not an error.
        _say(
            "WARNING: setting --check-for-nan-in-loss-and-grad off: dynamic loss scaling "
            "(--fp16 without --loss-scale) reads NaNs in the gradients as overflows"
        )
        t.check_for_nan_in_loss_and_grad = False
    p = config.parallel
    if config.virtual_pipeline_model_parallel_size is None:
        p.overlap_p2p_comm = False  # as Megatron-LM: only the interleaved schedule overlaps
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        # As Megatron-LM: a warning, and sequence parallelism off.
        _say("WARNING: disabling --sequence-parallel: --tensor-model-parallel-size is 1")
        p.sequence_parallel = False
    if not _cuda_available() or config.parallel.cpu:
        config.parallel.distributed_backend = "gloo"


def fill_cuda_graph_defaults(config: Config) -> None:
    """As Megatron-LM: --external-cuda-graph is the deprecated spelling of
    --cuda-graph-impl transformer_engine, and CUDA graphs turn on Transformer
    Engine's random-state tracker."""
    g = config.gpu
    if g.external_cuda_graph:
        _require(
            g.cuda_graph_impl == "none",
            "--external-cuda-graph is deprecated: give --cuda-graph-impl transformer_engine alone",
        )
        _warn("--external-cuda-graph is deprecated: use --cuda-graph-impl transformer_engine")
        g.cuda_graph_impl = "transformer_engine"
    if g.cuda_graph_impl != "none" and not g.te_rng_tracker:
        _warn("turning --te-rng-tracker on: CUDA graphs need it (as Megatron-LM)")
        g.te_rng_tracker = True


def fill_moe_defaults(config: Config) -> None:
    """As Megatron-LM: --num-experts 0 is a dense model; experts as wide as
    the dense MLP; expert TP as the model's TP; a single load-balancing type
    or coefficient given as itself, not as a list of one."""
    moe, p = config.moe, config.parallel
    if moe.num_experts == 0:
        moe.num_experts = None
    if moe.num_experts is not None and moe.moe_ffn_hidden_size is None:
        moe.moe_ffn_hidden_size = config.model.ffn_hidden_size
    if p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = p.tensor_model_parallel_size
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(moe, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(moe, name, value[0])


def _cuda_available() -> bool:
    """Whether a GPU is there. Where the NVIDIA driver has no device (a CPU
    machine) torch is not even imported: a refusal then takes a fraction of
    a second, not the seconds of torch's import."""
    if not _gpu_devices_present():
        return False
    import torch

    return torch.cuda.is_available()


def _gpu_devices_present() -> bool:
    """The NVIDIA driver's device files (or WSL's GPU device)."""
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def _gpu_count() -> int:
    """GPUs this process sees (a planning tool or test that parses for a GPU
    host elsewhere replaces this, with ``_cuda_available``)."""
    import torch

    return torch.cuda.device_count()


def _require_with(anchor: str, present: bool, dependents: List[Tuple[str, bool]]) -> List[str]:
    """Flags that only mean something with ``anchor``: refused when set
    (``dependents``: flag, whether set) and ``anchor`` is not given.
    Returns those set."""
    given = [flag for flag, is_set in dependents if is_set]
    _require(present or not given, f"{', '.join(given)} go with {anchor}: give it, or drop them")
    return given


def _check_latent_attention(config: Config, on_gpu: bool) -> None:
    """Multi-latent attention's rules (Megatron-LM's, and what megatron-core
    runs here); its flags mean nothing without it."""
    m = config.model
    fields = {f.name: f for f in dataclasses.fields(m)}
    sizes = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    yarn = ("rotary_scaling_factor", "mscale", "mscale_all_dim")
    _ignored_without(
        "--multi-latent-attention",
        m.multi_latent_attention,
        [(flag_name(fields[n]), getattr(m, n) != fields[n].default) for n in sizes + yarn],
    )
    _require(
        m.multi_latent_attention or m.rope_type in (None, "rope"),
        f"--rope-type {m.rope_type} is multi-latent attention's: other attention takes rope "
        "only (add --multi-latent-attention, or drop --rope-type)",
    )
    if not m.multi_latent_attention:
        return
    _require(
        not m.group_query_attention,
        "--multi-latent-attention and --group-query-attention exclude each other (MLA's keys "
        "and values come from a low-rank projection of their own): drop one",
    )
    given = [(flag_name(fields[n]), getattr(m, n)) for n in sizes]
    small = [f"{flag} {size}" for flag, size in given if size is not None and size < 1]
    _require(not small, f"{', '.join(small)}: multi-latent attention's sizes must be >= 1")
    _require(
        on_gpu or config.parallel.context_parallel_size == 1,
        "--multi-latent-attention with --context-parallel-size > 1: megatron-core's rotary "
        "embedding then pins host memory, which needs a GPU: use --context-parallel-size 1 here",
    )


def _ignored_without(anchor: str, present: bool, dependents: List[Tuple[str, bool]]) -> List[str]:
    """Flags that only mean something with ``anchor``, given without it:
    Megatron-LM ignores them, and so does this build, saying so in a
    warning (``dependents``: flag, whether set). Returns those set."""
    given = [flag for flag, is_set in dependents if is_set]
    if given and not present:
        _warn(
            f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
            f"{anchor} (Megatron-LM ignores {'it' if len(given) == 1 else 'them'} too)"
        )
    return given


def _warn(message: str) -> None:
    _say(f"WARNING: {message}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Every check a run needs before it starts; each names what to change."""
    for check in (
        _check_pipeline_layout,  # first: the virtual stages follow from it
        _check_gpus,
        _check_parallel_layout,
        _check_model_shape,
        _check_model_features,
        _check_moe,
        _check_moe_routing,
        _check_multi_token_prediction,
        _check_recompute,
        _check_batch,
        _check_virtual_pipeline,
        _check_pipeline_split,
        _check_training,
        _check_precision,
        _check_determinism,
        _check_schedule_source,
        _check_fp8,
        _check_gpu_features,
        _check_data,
        _check_checkpoint,
        _check_logging,
        # megatron-core's own, last: they import it.
        _check_with_megatron_core,
        _check_data_index,
    ):
        check(config)


def core_transformer_config_from_args(args, config_class=None):
    """Megatron-LM's name for the run's megatron-core TransformerConfig
    (a script written against its API imports it from here)."""
    from megatron.training.global_vars import core_transformer_config_from_args as build

    return build(args, config_class)


def _check_gpus(config: Config) -> None:
    """A rank per GPU, or the sharing a test job asks for (gpu_sharing.py)."""
    if config.parallel.distributed_backend != "nccl":
        return
    try:
        mode = gpu_sharing.sharing_mode()
        gpu_sharing.memory_fraction()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpu_sharing.device_index(local_ranks - 1, _gpu_count(), mode)
        if mode == gpu_sharing.MULTI_RANK:
            import torch

            gpu_sharing.nccl_environment(mode, torch.cuda.nccl.version())
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_parallel_layout(config: Config) -> None:
    p, world = config.parallel, config.world_size
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    _require(
        tp >= 1 and pp >= 1 and cp >= 1,
        "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
        "--context-parallel-size must be at least 1",
    )
    cp_words = f" x context-parallel size {cp}" if cp > 1 else ""
    _require(
        world % (tp * pp * cp) == 0,
        f"world size {world} is not divisible by tensor-parallel size {tp} x "
        f"pipeline-parallel size {pp}{cp_words} = {tp * pp * cp}: launch a multiple of "
        f"{tp * pp * cp} processes or change --tensor-model-parallel-size / "
        f"--pipeline-model-parallel-size" + (" / --context-parallel-size" if cp > 1 else ""),
    )
    _check_context_parallel(config)
    _check_optimizer_instances(config)
    _require(
        not p.overlap_param_gather or p.use_distributed_optimizer,
        "--overlap-param-gather needs --use-distributed-optimizer",
    )
    _require(
        not p.overlap_param_gather or p.overlap_grad_reduce,
        "--overlap-param-gather needs --overlap-grad-reduce",
    )
    _check_optimizer_step_overlap(config)
    _require(p.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be > 0")


def _check_optimizer_step_overlap(config: Config) -> None:
    """Megatron-LM's rules for --overlap-param-gather-with-optimizer-step: the
    first chunk's all-gather is dispatched from the optimizer's step, which
    only the distributed optimizer's overlapped all-gather of interleaved
    chunks does, and its checkpoint is Megatron-LM's torch format."""
    p, flag = config.parallel, "--overlap-param-gather-with-optimizer-step"
    if not p.overlap_param_gather_with_optimizer_step:
        return
    _require(p.use_distributed_optimizer, f"{flag} needs --use-distributed-optimizer")
    _require(p.overlap_param_gather, f"{flag} needs --overlap-param-gather")
    _require(
        config.virtual_pipeline_model_parallel_size is not None,
        f"{flag} needs the interleaved schedule: add --num-layers-per-virtual-pipeline-stage "
        "or --num-virtual-stages-per-pipeline-rank",
    )
    _require(
        config.checkpoint.ckpt_format == "torch",
        f"{flag} saves and loads only --ckpt-format torch (Megatron-LM's distributed "
        f"checkpoint does not take it yet), not {config.checkpoint.ckpt_format}",
    )


def _check_optimizer_instances(config: Config) -> None:
    """megatron-core's rules for partial distributed optimizers: each instance
    shards over an equal part of the data-parallel (and expert data-parallel)
    ranks."""
    p = config.parallel
    copies = p.num_distributed_optimizer_instances
    if copies == 1:
        return
    _require(copies > 1, f"--num-distributed-optimizer-instances {copies} must be >= 1")
    _require(
        p.use_distributed_optimizer,
        f"--num-distributed-optimizer-instances {copies} copies the distributed optimizer: "
        "add --use-distributed-optimizer",
    )
    ranks = config.data_parallel_size * p.context_parallel_size
    _require(
        ranks % copies == 0,
        f"--num-distributed-optimizer-instances {copies} does not divide the {ranks} "
        "data-parallel ranks (x context-parallel size): use a divisor of it",
    )


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _check_context_parallel(config: Config) -> None:
    """Megatron-LM's rules for context parallelism, and megatron-core's split
    of each sequence into 2 x CP chunks (a rank takes one from each end)."""
    p, m = config.parallel, config.model
    cp, kinds = p.context_parallel_size, p.cp_comm_type
    bad = [k for k in kinds if k not in CP_COMM_TYPES]
    _require(not bad, f"--cp-comm-type {' '.join(bad)}: choose from {', '.join(CP_COMM_TYPES)}")
    _require(
        len(kinds) in (1, m.num_layers),
        f"--cp-comm-type gives {len(kinds)} types: give one for all layers or one per layer "
        f"({m.num_layers})",
    )
    sizes = p.hierarchical_context_parallel_sizes
    _require(
        sizes is None or math.prod(sizes) == cp,
        f"--hierarchical-context-parallel-sizes {sizes} multiply to {math.prod(sizes or [1])}, "
        f"not --context-parallel-size {cp}",
    )
    _require(
        "a2a+p2p" not in kinds or sizes is not None,
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (as Megatron-LM)",
    )
    if cp == 1:
        return
    _require(
        m.seq_length % (2 * cp) == 0,
        f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp}: "
        "each sequence is cut into that many equal chunks",
    )


def _check_model_shape(config: Config) -> None:
    m, p = config.model, config.parallel
    tp = p.tensor_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _require(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive")
    _require(
        m.num_attention_heads % tp == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by "
        f"--tensor-model-parallel-size {tp}: choose heads as a multiple of {tp}",
    )
    _require(
        m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
        f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
        f"{m.num_attention_heads}: change one of them or set --kv-channels",
    )
    _require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by "
        f"--num-query-groups {m.num_query_groups}",
    )
    _require(
        m.num_query_groups % tp == 0,
        f"--num-query-groups {m.num_query_groups} is not divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    _require(
        m.position_embedding_type != "learned_absolute"
        or m.max_position_embeddings >= m.seq_length,
        f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
        f"{m.max_position_embeddings}: raise --max-position-embeddings",
    )
    _require(
        m.transformer_impl != "transformer_engine" or _importable("transformer_engine"),
        "--transformer-impl transformer_engine needs the transformer_engine package: "
        "install it or use --transformer-impl local",
    )


def _check_model_features(config: Config) -> None:
    m = config.model
    _check_sequence_parallel(config)
    _check_wgrad_deferral(config)
    _require(
        not (m.squared_relu and m.swiglu),
        "--squared-relu and --swiglu are two activations: give one",
    )
    _require(
        m.position_embedding or m.position_embedding_type == "rope",
        "--no-position-embedding is deprecated (as in Megatron-LM): use "
        "--position-embedding-type rope",
    )
    _require(0 < m.rotary_percent <= 1, f"--rotary-percent {m.rotary_percent} must be in (0, 1]")
    _ignored_without(
        "--position-embedding-type rope",
        m.position_embedding_type == "rope",
        [("--rotary-interleaved", m.rotary_interleaved)],
    )
    if m.use_rotary_position_embeddings:
        _warn("--use-rotary-position-embeddings is deprecated: use --position-embedding-type rope")
    if not config.parallel.async_tensor_model_parallel_allreduce:
        _warn(
            "--no-async-tensor-model-parallel-allreduce has no effect: megatron-core "
            "ignores it (deprecated in Megatron-LM)"
        )
    if m.use_flash_attn:
        _warn(
            "--use-flash-attn has no effect: Megatron-LM reads it in its legacy models only; "
            "--attention-backend flash chooses flash attention"
        )
    _check_pipeline_overlap(config)
    uses_te = _uses_transformer_engine(config)
    on_gpu = config.parallel.distributed_backend == "nccl"
    _check_latent_attention(config, on_gpu)
    _require(
        not m.apply_layernorm_1p or uses_te or (on_gpu and _importable("apex")),
        "--apply-layernorm-1p needs Transformer Engine's or Apex's LayerNorm (torch's has "
        "no zero-centred weights), on a GPU: drop it here",
    )
    _require(
        m.cross_entropy_fusion_impl == "native" or m.cross_entropy_loss_fusion,
        "--cross-entropy-fusion-impl goes with --cross-entropy-loss-fusion: add it, or drop it",
    )
    _require(
        m.cross_entropy_fusion_impl == "native" or uses_te,
        "--cross-entropy-fusion-impl te is Transformer Engine's kernel, which needs a GPU "
        "with the transformer_engine package: use native here",
    )
    problem = attention_problem(
        m.attention_backend,
        uses_te,
        on_cpu=not on_gpu,
        dropout=m.attention_dropout,
        masked_by=attention_masked_by(config),
        local_lacks=local_attention_lacks(config),
    )
    _require(problem is None, problem or "")
    p = config.parallel
    comm_given = p.cp_comm_type != ["p2p"] or p.hierarchical_context_parallel_sizes is not None
    cp_flags = [("--cp-comm-type, --hierarchical-context-parallel-sizes", comm_given)]
    _ignored_without("--context-parallel-size > 1", p.context_parallel_size > 1, cp_flags)
    if comm_given and p.context_parallel_size > 1 and not uses_te:
        _warn(
            "--cp-comm-type and --hierarchical-context-parallel-sizes choose Transformer "
            "Engine's context-parallel communication; without it (torch SDPA) keys and values "
            "are gathered from the whole context-parallel group, the same result"
        )


def _check_pipeline_overlap(config: Config) -> None:
    p = config.parallel
    _require(
        not p.overlap_p2p_comm_warmup_flush or p.overlap_p2p_comm,
        "--overlap-p2p-communication-warmup-flush goes with the interleaved schedule's "
        "overlapped sends and receives (virtual stages, without "
        "--no-overlap-p2p-communication): drop it, or give virtual stages",
    )
    _require(
        not (p.ddp_average_in_collective and config.training.calculate_per_token_loss),
        "--ddp-average-in-collective averages over the ranks, --calculate-per-token-loss "
        "divides by the batch's tokens: give one",
    )


def _check_wgrad_deferral(config: Config) -> None:
    """megatron-core's rules for --defer-embedding-wgrad-compute, checked now."""
    t, p = config.training, config.parallel
    limit = [("--wgrad-deferral-limit", t.wgrad_deferral_limit != 0)]
    _ignored_without("--defer-embedding-wgrad-compute", t.defer_embedding_wgrad_compute, limit)
    if not t.defer_embedding_wgrad_compute:
        return
    _require(
        p.pipeline_model_parallel_size > 1,
        "--defer-embedding-wgrad-compute defers to the pipeline's flush: it needs "
        "--pipeline-model-parallel-size > 1",
    )
    fused = (
        p.distributed_backend == "nccl"
        and t.gradient_accumulation_fusion
        and (_uses_transformer_engine(config) or _importable("fused_weight_gradient_mlp_cuda"))
    )
    _require(
        fused,
        "--defer-embedding-wgrad-compute needs gradient-accumulation fusion: Transformer "
        "Engine's layers or Apex's kernel, on a GPU, without --no-gradient-accumulation-fusion",
    )
    _require(t.wgrad_deferral_limit >= 0, "--wgrad-deferral-limit must be >= 0")


def _uses_transformer_engine(config: Config) -> bool:
    m = config.model
    return m.transformer_impl == "transformer_engine" or (
        m.transformer_impl == "auto"
        and config.parallel.distributed_backend == "nccl"
        and _importable("transformer_engine")
    )


def _check_sequence_parallel(config: Config) -> None:
    on_gpu = config.parallel.distributed_backend == "nccl"
    _require(
        not config.parallel.sequence_parallel
        or _uses_transformer_engine(config)
        or (on_gpu and _importable("apex")),
        "--sequence-parallel needs Transformer Engine's or Apex's norm layers (torch's "
        "LayerNorm and RMSNorm cannot gather sequence-parallel gradients), on a GPU: drop it "
        "here",
    )


def _moe_flags_given(config: Config) -> List[str]:
    """The MoE flags set away from their defaults (--num-experts aside)."""
    given = [
        flag_name(f)
        for f in dataclasses.fields(MoEConfig)
        if f.name != "num_experts" and getattr(config.moe, f.name) != f.default
    ]
    p = config.parallel
    if p.expert_model_parallel_size != 1:
        given.append("--expert-model-parallel-size")
    if p.expert_tensor_parallel_size != p.tensor_model_parallel_size:
        given.append("--expert-tensor-parallel-size")
    return given


def _check_expert_groups(config: Config) -> None:
    p = config.parallel
    etp, ep, pp = (
        p.expert_tensor_parallel_size,
        p.expert_model_parallel_size,
        p.pipeline_model_parallel_size,
    )
    _require(
        etp >= 1 and config.world_size % (etp * ep * pp) == 0,
        f"world size {config.world_size} is not divisible by expert tensor-parallel size "
        f"{etp} x expert-parallel size {ep} x pipeline-parallel size {pp}: change "
        "--expert-model-parallel-size or --expert-tensor-parallel-size",
    )


def _check_moe(config: Config) -> None:
    moe, p, m = config.moe, config.parallel, config.model
    if moe.num_experts is None:
        _require(
            p.expert_model_parallel_size == 1,
            f"--expert-model-parallel-size {p.expert_model_parallel_size} splits experts, and "
            "there are none: add --num-experts N, or drop it (as Megatron-LM)",
        )
        _ignored_without("--num-experts", False, [(f, True) for f in _moe_flags_given(config)])
        _check_expert_groups(config)  # megatron-core makes the expert groups all the same
        return
    ep, etp, tp, pp = (
        p.expert_model_parallel_size,
        p.expert_tensor_parallel_size,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
    )
    _require(moe.num_experts > 0, f"--num-experts {moe.num_experts} must be positive")
    _require(
        ep >= 1 and moe.num_experts % ep == 0,
        f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size "
        f"{ep}: each expert-parallel rank holds the same number of experts",
    )
    _require(
        1 <= moe.moe_router_topk <= moe.num_experts,
        f"--moe-router-topk {moe.moe_router_topk} must be between 1 and --num-experts "
        f"{moe.num_experts}",
    )
    _check_expert_groups(config)
    expert_dp = config.world_size // (etp * ep * pp)
    _require(
        not p.use_tp_pp_dp_mapping or pp == 1 or expert_dp == config.data_parallel_size,
        f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} needs the experts' "
        f"data-parallel size ({expert_dp}) to equal the model's ({config.data_parallel_size}) "
        "(megatron-core's rule for rank orders that do not end with the pipeline): drop "
        "--use-tp-pp-dp-mapping, or make --expert-model-parallel-size x "
        "--expert-tensor-parallel-size equal --tensor-model-parallel-size",
    )
    _require(
        tp == 1 or p.sequence_parallel,
        "MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel "
        "(megatron-core's rule)",
    )
    _require(
        m.disable_bias_linear or (etp == 1 and moe.moe_shared_expert_intermediate_size is None),
        "experts split by --expert-tensor-parallel-size > 1, and shared experts, have no "
        "biases in megatron-core: add --disable-bias-linear",
    )
    _require(
        m.disable_bias_linear or ep > 1 or etp > 1 or _uses_transformer_engine(config),
        "megatron-core's local expert layers with biases fail at expert-parallel and "
        "expert tensor-parallel size 1 (an in-place bias add on the output of an all-reduce "
        "it skips): add --disable-bias-linear, or set --expert-model-parallel-size > 1",
    )
    on_gpu = p.distributed_backend == "nccl"
    _ignored_without(
        "--moe-token-dispatcher-type flex",
        moe.moe_token_dispatcher_type == "flex",
        [("--moe-flex-dispatcher-backend", moe.moe_flex_dispatcher_backend != "deepep")],
    )
    _require(
        not moe.moe_enable_deepep or moe.moe_token_dispatcher_type == "flex",
        "--moe-enable-deepep goes with --moe-token-dispatcher-type flex (as Megatron-LM; it "
        "is deprecated: use --moe-flex-dispatcher-backend deepep)",
    )
    _require(
        moe.moe_token_dispatcher_type != "flex" or (on_gpu and _importable("deep_ep")),
        "--moe-token-dispatcher-type flex dispatches through DeepEP's or HybridEP's GPU "
        "kernels (the deep_ep package): use alltoall or allgather here",
    )
    _require(
        not moe.moe_grouped_gemm
        or (on_gpu and (_uses_transformer_engine(config) or _importable("grouped_gemm"))),
        "--moe-grouped-gemm runs Transformer Engine's or the grouped_gemm package's GPU "
        "kernel: drop it here (each expert then runs its own GEMM)",
    )
    _require(
        not moe.moe_pad_expert_input_to_capacity or moe.moe_expert_capacity_factor is not None,
        "--moe-pad-expert-input-to-capacity goes with --moe-expert-capacity-factor",
    )
    types, coeffs = moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff
    _require(
        len(types if isinstance(types, list) else [types])
        == len(coeffs if isinstance(coeffs, list) else [coeffs])
        or not isinstance(types, list),
        "--moe-router-load-balancing-type and --moe-aux-loss-coeff need as many values as "
        "each other",
    )
    _require(
        "sinkhorn" not in (types if isinstance(types, list) else [types])
        or not any(coeffs if isinstance(coeffs, list) else [coeffs]),
        "--moe-router-load-balancing-type sinkhorn balances without an auxiliary loss: "
        "drop --moe-aux-loss-coeff",
    )


def _check_moe_routing(config: Config) -> None:
    """--moe-layer-freq's pattern, and the routing flags that run Transformer
    Engine's kernels."""
    moe, layers = config.moe, config.model.num_layers
    if moe.num_experts is None:
        return  # _check_moe said what has no effect
    _ignored_without(
        "--moe-router-group-topk",
        moe.moe_router_group_topk is not None,
        [("--moe-router-num-groups", moe.moe_router_num_groups is not None)],
    )
    rate = MoEConfig.__dataclass_fields__["moe_router_bias_update_rate"].default
    _ignored_without(
        "--moe-router-enable-expert-bias",
        moe.moe_router_enable_expert_bias,
        [("--moe-router-bias-update-rate", moe.moe_router_bias_update_rate != rate)],
    )
    freq = moe.moe_layer_freq
    _require(
        not isinstance(freq, list) or len(freq) == layers,
        f"--moe-layer-freq gives {len(freq) if isinstance(freq, list) else 0} layers and "
        f"--num-layers is {layers}: give one 0 or 1 per layer",
    )
    _require(
        isinstance(freq, list) or 1 <= freq <= layers,
        f"--moe-layer-freq {freq} must be between 1 and --num-layers {layers}",
    )
    on_gpu = config.parallel.distributed_backend == "nccl"
    for flag, given in (
        ("--moe-permute-fusion", moe.moe_permute_fusion),
        ("--moe-router-fusion", moe.moe_router_fusion),
    ):
        _require(
            not given or (on_gpu and _uses_transformer_engine(config)),
            f"{flag} runs Transformer Engine's fused kernel on a GPU: drop it here (the "
            "unfused code computes the same)",
        )


def _check_multi_token_prediction(config: Config) -> None:
    m = config.model
    factor = ModelConfig.__dataclass_fields__["mtp_loss_scaling_factor"].default
    if m.mtp_num_layers is None:
        _ignored_without(
            "--mtp-num-layers",
            False,
            [("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor != factor)],
        )
        return
    _require(m.mtp_num_layers > 0, f"--mtp-num-layers {m.mtp_num_layers} must be positive")
    _require(
        m.position_embedding_type == "rope",
        "multi-token prediction needs --position-embedding-type rope (Megatron-LM's rule: "
        "its layers take no learned position embedding)",
    )
    _require(
        m.untie_embeddings_and_output_weights or config.parallel.pipeline_model_parallel_size == 1,
        "multi-token prediction on a pipeline needs --untie-embeddings-and-output-weights "
        "(as every Megatron-LM MTP config): megatron-core 0.16 keeps an unused output "
        "weight on the MTP stage with tied ones, and refuses to save it",
    )


def _check_recompute(config: Config) -> None:
    t, p = config.training, config.parallel
    # As Megatron-LM (megatron-core reads them only with a granularity).
    _ignored_without(
        "--recompute-granularity",
        t.recompute_granularity is not None,
        [
            ("--recompute-method", t.recompute_method is not None),
            ("--recompute-num-layers", t.recompute_num_layers is not None),
            ("--recompute-modules", t.recompute_modules is not None),
        ],
    )
    # Megatron-LM's own rules; megatron-core checks the rest below.
    _require(
        t.recompute_granularity != "selective" or t.recompute_method is None,
        "--recompute-method goes with --recompute-granularity full (selective recompute "
        "takes --recompute-modules): drop it",
    )
    _require(
        not t.distribute_saved_activations
        or (t.recompute_granularity == "full" and p.tensor_model_parallel_size > 1),
        "--distribute-saved-activations splits full recompute's kept inputs over the "
        "tensor-parallel group: it needs --recompute-granularity full and TP > 1",
    )


def _check_with_megatron_core(config: Config) -> None:
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
    model_setup = _import_with_megatron_core("megatron.training.model_setup")
    try:
        model_setup.transformer_config(config, on_cpu=config.parallel.distributed_backend == "gloo")
    except (ValueError, AssertionError) as error:
        raise ConfigError(f"megatron-core refuses these settings: {error}") from None


def _check_determinism(config: Config) -> None:
    """As Megatron-LM: a deterministic run uses no kernel known not to be, and
    on a GPU NCCL's all-reduce algorithm is named."""
    if not config.training.deterministic_mode:
        return
    _require(
        not config.model.cross_entropy_loss_fusion,
        "--deterministic-mode: the fused cross entropy is not deterministic: drop "
        "--cross-entropy-loss-fusion",
    )
    _require(
        not config.model.use_flash_attn,
        "--deterministic-mode: Megatron-LM refuses --use-flash-attn with it: drop one",
    )
    algorithms = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
    _require(
        config.parallel.distributed_backend != "nccl" or os.environ.get("NCCL_ALGO") in algorithms,
        f"--deterministic-mode on GPUs: set NCCL_ALGO to one of {', '.join(algorithms)} "
        f"(now {os.environ.get('NCCL_ALGO', 'unset')})",
    )


def _check_schedule_source(config: Config) -> None:
    c = config.checkpoint
    _require(
        not (c.use_checkpoint_opt_param_scheduler and c.override_opt_param_scheduler),
        "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler say opposite "
        "things: give one",
    )


def _check_fp8(config: Config) -> None:
    t, m = config.training, config.model
    set_without = _ignored_without(
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
    _ignored_without(
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
    _require(
        on_gpu and _importable("transformer_engine") and m.transformer_impl != "local",
        f"--fp8-format {t.fp8} runs Transformer Engine's FP8 layers, which need a GPU with "
        "FP8 (Hopper or newer) and the transformer_engine package: drop "
        + ", ".join(["--fp8-format"] + set_without)
        + " here",
    )
    _require(
        not t.fp8_param_gather or config.parallel.use_distributed_optimizer,
        "--fp8-param-gather goes with --use-distributed-optimizer (as Megatron-LM)",
    )


def gpu_features_given(config: Config) -> List[str]:
    """The GPU-only features of the gpu section that a run asks for, by flag."""
    g = config.gpu
    given = [
        ("--tp-comm-overlap", g.tp_comm_overlap),
        ("--overlap-moe-expert-parallel-comm", g.overlap_moe_expert_parallel_comm),
        ("--delay-wgrad-compute", g.delay_wgrad_compute),
        ("--fine-grained-activation-offloading", g.fine_grained_activation_offloading),
        (
            "--external-cuda-graph"
            if g.external_cuda_graph
            else "--cuda-graph-impl " + g.cuda_graph_impl,
            g.cuda_graph_impl != "none",
        ),
        ("--te-rng-tracker", g.te_rng_tracker and g.cuda_graph_impl == "none"),
    ]
    return [flag for flag, on in given if on]


def _check_gpu_features(config: Config) -> None:
    """Megatron-LM's rules for the gpu section, and where each runs: on a GPU
    with Transformer Engine (megatron-core checks the rest of each when it
    builds its configuration, _check_with_megatron_core)."""
    g = config.gpu
    on_gpu = config.parallel.distributed_backend == "nccl"
    given = gpu_features_given(config)
    _require(
        not given or on_gpu,
        f"{', '.join(given)}: GPU only (CUDA streams and kernels): drop it here",
    )
    # All but the MoE overlap's schedule are Transformer Engine's.
    with_te = [flag for flag in given if flag != "--overlap-moe-expert-parallel-comm"]
    _require(
        not with_te or _uses_transformer_engine(config),
        f"{', '.join(with_te)}: needs Transformer Engine (--transformer-impl "
        "transformer_engine, its package installed): drop it here",
    )
    _check_tp_comm_overlap(config)
    for flag, alone in (
        ("--delay-wgrad-compute", g.delay_wgrad_compute),
        ("--ep-overlap-early-attn-memory-release", g.ep_overlap_early_attn_memory_release),
    ):  # megatron-core refuses either alone
        _require(
            not alone or g.overlap_moe_expert_parallel_comm,
            f"{flag} goes with --overlap-moe-expert-parallel-comm",
        )
    _check_delayed_wgrad(config)
    _check_activation_offloading(config)
    _check_cuda_graphs(config)


def _check_tp_comm_overlap(config: Config) -> None:
    g = config.gpu
    defaults = GpuConfig()
    _ignored_without(
        "--tp-comm-overlap",
        g.tp_comm_overlap,
        [("--tp-comm-overlap-cfg", g.tp_comm_overlap_cfg is not None)]
        + [
            (flag_name(f), getattr(g, f.name) != getattr(defaults, f.name))
            for f in dataclasses.fields(GpuConfig)
            if f.name.startswith("tp_comm_") and f.name != "tp_comm_overlap_cfg"
        ],
    )
    if not g.tp_comm_overlap:
        return
    _require(
        config.parallel.sequence_parallel,
        "--tp-comm-overlap overlaps sequence-parallel communication: add --sequence-parallel",
    )
    cfg = g.tp_comm_overlap_cfg
    _require(
        cfg is None or os.path.isfile(cfg),
        f"--tp-comm-overlap-cfg {cfg}: no such file",
    )


def _check_delayed_wgrad(config: Config) -> None:
    """Megatron-LM's Transformer Engine versions for --delay-wgrad-compute."""
    version = _package_version("transformer_engine")
    if not config.gpu.delay_wgrad_compute or version is None:
        return
    _require(
        not config.parallel.overlap_grad_reduce or version >= (2, 8),
        "--delay-wgrad-compute with --overlap-grad-reduce needs Transformer Engine 2.8 or later",
    )
    _require(
        config.training.gradient_accumulation_fusion or version >= (2, 7),
        "--delay-wgrad-compute with --no-gradient-accumulation-fusion needs Transformer "
        "Engine 2.7 or later",
    )


def _check_activation_offloading(config: Config) -> None:
    g = config.gpu
    _ignored_without(
        "--fine-grained-activation-offloading",
        g.fine_grained_activation_offloading,
        [
            ("--offload-modules", bool(g.offload_modules)),
            (
                "--min-offloaded-tensor-size",
                g.min_offloaded_tensor_size != GpuConfig().min_offloaded_tensor_size,
            ),
        ],
    )
    if not g.fine_grained_activation_offloading:
        return
    _require(
        bool(g.offload_modules),
        "--fine-grained-activation-offloading needs --offload-modules (what to offload)",
    )
    _require(
        _importable("cuda") and _importable("pynvml"),
        "--fine-grained-activation-offloading pins each rank to its GPU's CPUs, as "
        "Megatron-LM, with the cuda-python and nvidia-ml-py packages: install them",
    )
    version = _package_version("transformer_engine")
    _require(
        version is None or version < (2, 10) or os.environ.get("NVTE_CPU_OFFLOAD_V1") == "1",
        "--fine-grained-activation-offloading with Transformer Engine 2.10 or later needs "
        "NVTE_CPU_OFFLOAD_V1=1 in the environment (else it offloads the weights too)",
    )


# --cuda-graph-scope's values (megatron-core's CudaGraphScope names, less
# full_iteration: the scope of megatron-core's own graphs, not here).
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full")


def _check_cuda_graphs(config: Config) -> None:
    g = config.gpu
    _require(
        g.cuda_graph_impl != "local",
        "--cuda-graph-impl local (megatron-core's own graphs) is not here: use transformer_engine",
    )
    bad = [scope for scope in g.cuda_graph_scope if scope not in CUDA_GRAPH_SCOPES]
    _require(
        not bad,
        f"--cuda-graph-scope {' '.join(bad)}: not a scope of Transformer Engine's graphs "
        f"(choose from {', '.join(CUDA_GRAPH_SCOPES[:-1])})",
    )
    _ignored_without(
        "--cuda-graph-impl",
        g.cuda_graph_impl != "none",
        [
            ("--cuda-graph-scope", g.cuda_graph_scope != []),
            (
                "--cuda-graph-warmup-steps",
                g.cuda_graph_warmup_steps != GpuConfig().cuda_graph_warmup_steps,
            ),
        ],
    )
    if g.cuda_graph_impl == "none":
        return
    _require(g.cuda_graph_warmup_steps >= 0, "--cuda-graph-warmup-steps must be >= 0")
    _require(
        "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        or os.environ.get("NCCL_GRAPH_REGISTER") == "0",
        "CUDA graphs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True need "
        "NCCL_GRAPH_REGISTER=0 in the environment (an illegal memory access otherwise)",
    )


def _package_version(name: str) -> Optional[Tuple[int, ...]]:
    """An installed package's version as numbers (major, minor), or None."""
    from importlib import metadata

    try:
        numbers = re.findall(r"\d+", metadata.version(name))
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(n) for n in numbers[:2])


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _check_batch(config: Config) -> None:
    b, dp = config.batch, config.data_parallel_size
    _require(b.micro_batch_size > 0, "--micro-batch-size must be positive")
    step = b.micro_batch_size * dp
    _require(
        b.global_batch_size % step == 0,
        f"--global-batch-size {b.global_batch_size} is not divisible by "
        f"--micro-batch-size {b.micro_batch_size} x data-parallel size {dp} = {step}: "
        f"use a multiple of {step}",
    )
    if b.rampup_batch_size is not None:
        _check_ramp(config)


def _check_virtual_pipeline(config: Config) -> None:
    """Megatron-LM's rules for the interleaved schedule's flags, then the
    schedule's own (checked now, not at the first iteration)."""
    _check_virtual_stage_flags(config)
    if config.virtual_pipeline_model_parallel_size is not None:
        _check_interleaved_schedule(config)


def _check_virtual_stage_flags(config: Config) -> None:
    p, layers = config.parallel, config.split_layers
    if p.pipeline_model_parallel_layout is not None:
        return  # _check_pipeline_layout
    per_layer, stages = (
        p.num_layers_per_virtual_pipeline_stage,
        p.num_virtual_stages_per_pipeline_rank,
    )
    _require(
        per_layer is None or stages is None,
        "give one of --num-layers-per-virtual-pipeline-stage and "
        "--num-virtual-stages-per-pipeline-rank, not both",
    )
    if _uneven_stages(p):
        _require(
            per_layer is None,
            "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-"
            "layers (as Megatron-LM): give the virtual stages as "
            "--num-virtual-stages-per-pipeline-rank",
        )
        return  # the stages' own split is checked by _check_pipeline_split
    pp = p.pipeline_model_parallel_size
    if per_layer is not None:
        _require(
            per_layer > 0 and (layers // pp) % per_layer == 0,
            f"--num-layers-per-virtual-pipeline-stage {per_layer} does not divide the "
            f"{layers // pp} layers of each pipeline stage (--num-layers {layers} / "
            f"--pipeline-model-parallel-size {pp}): use a divisor of {layers // pp}",
        )
    _require(
        stages is None or stages > 0,
        f"--num-virtual-stages-per-pipeline-rank {stages} must be positive",
    )
    _require_with(
        "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank "
        "(more than one virtual stage)",
        config.virtual_pipeline_model_parallel_size is not None,
        [
            (
                "--microbatch-group-size-per-virtual-pipeline-stage",
                p.microbatch_group_size_per_vp_stage is not None,
            )
        ],
    )


def _check_pipeline_layout(config: Config) -> None:
    """--pipeline-model-parallel-layout: the only split given, read as
    megatron-core reads it, its layers those of the model, the MTP layers on
    the last pipeline rank (the one that also reads labels here)."""
    p, m = config.parallel, config.model
    layout = p.pipeline_model_parallel_layout
    if layout is None:
        return
    others = [
        flag
        for flag, given in (
            ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage),
            ("--num-virtual-stages-per-pipeline-rank", p.num_virtual_stages_per_pipeline_rank),
            ("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers),
            (
                "--account-for-embedding-in-pipeline-split",
                p.account_for_embedding_in_pipeline_split,
            ),
            ("--account-for-loss-in-pipeline-split", p.account_for_loss_in_pipeline_split),
        )
        if given
    ]
    _require(
        not others,
        f"--pipeline-model-parallel-layout says where every layer goes: drop {', '.join(others)}",
    )
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        parsed = PipelineParallelLayerLayout(layout, p.pipeline_model_parallel_size)
        mtp_elsewhere = parsed.validate_layer_layout(m.num_layers, m.mtp_num_layers)
    except AssertionError as error:
        raise ConfigError(f"--pipeline-model-parallel-layout {layout!r}: {error}") from None
    _require(
        not mtp_elsewhere,
        f"--pipeline-model-parallel-layout {layout!r} puts MTP layers (m) on a pipeline rank "
        "before the last: put them in the last rank's stage, with the loss (L)",
    )


def _uneven_stages(p) -> bool:
    return (
        p.decoder_first_pipeline_num_layers is not None
        or p.decoder_last_pipeline_num_layers is not None
    )


def _check_pipeline_split(config: Config) -> None:
    """megatron-core's rules for splitting the layers between pipeline
    stages (evenly, with first and last stages of their own size, or with
    the embedding and loss counted as layers), in the flags' words."""
    p = config.parallel
    if p.pipeline_model_parallel_layout is not None:
        return  # _check_pipeline_layout
    problem = _uneven_split_problem(config) if _uneven_stages(p) else _even_split_problem(config)
    _require(problem is None, problem or "")


def _even_split_problem(config: Config) -> Optional[str]:
    p, layers = config.parallel, config.split_layers
    pp, vp = p.pipeline_model_parallel_size, config.model_chunks
    if layers % (pp * vp) == 0:
        return None
    counted = [
        "--account-for-" + part + "-in-pipeline-split"
        for part, on in (
            ("embedding", p.account_for_embedding_in_pipeline_split),
            ("loss", p.account_for_loss_in_pipeline_split),
        )
        if on
    ]
    what = f"--num-layers {config.model.num_layers}"
    if counted:
        what += f" + 1 for each of {', '.join(counted)}"
    over = f"--pipeline-model-parallel-size {pp}"
    if vp > 1:
        over += f" x --num-virtual-stages-per-pipeline-rank {vp}"
    return (
        f"{what} does not split evenly over {over}: make the count a multiple of "
        f"{pp * vp}, or give --decoder-first/last-pipeline-num-layers"
    )


def _uneven_split_problem(config: Config) -> Optional[str]:
    p = config.parallel
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    pp, vp = p.pipeline_model_parallel_size, config.model_chunks
    ends = {
        flag: n
        for flag, n in (
            ("--decoder-first-pipeline-num-layers", first),
            ("--decoder-last-pipeline-num-layers", last),
        )
        if n is not None
    }
    given = " ".join(f"{flag} {n}" for flag, n in ends.items())
    if p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split:
        return (
            f"{given} with --account-for-embedding-in-pipeline-split or "
            "--account-for-loss-in-pipeline-split: give the stages' sizes or let the "
            "embedding and loss count, not both"
        )
    middle_layers = config.model.num_layers - sum(ends.values())
    middle_stages = pp - len(ends)
    if middle_stages < 0:
        return f"{given} needs --pipeline-model-parallel-size {len(ends)} or more, not {pp}"
    if any(n <= 0 or n % vp for n in ends.values()):
        return (
            f"{given}: each must be a positive multiple of the {vp} virtual stage(s) per "
            "pipeline rank"
        )
    if middle_stages == 0 and middle_layers == 0:
        return None
    if middle_stages == 0 or middle_layers <= 0 or middle_layers % (middle_stages * vp):
        return (
            f"{given} leave {middle_layers} of --num-layers {config.model.num_layers} to "
            f"{middle_stages} middle pipeline stage(s)"
            + (f" x {vp} virtual stages" if vp > 1 else "")
            + ", which do not split evenly: change --num-layers or the first/last stage's layers"
        )
    return None


def _check_interleaved_schedule(config: Config) -> None:
    p = config.parallel
    pp, overlap = p.pipeline_model_parallel_size, p.overlap_p2p_comm
    _require(
        pp > (1 if overlap else 2),
        f"the interleaved schedule (virtual pipeline stages) needs --pipeline-model-parallel-size "
        f"> {1 if overlap else 2}"
        + ("" if overlap else " with --no-overlap-p2p-communication")
        + f", not {pp}",
    )
    problem = interleaving_problem_at(config, config.data_parallel_size)
    _require(
        problem is None,
        f"the interleaved schedule cannot run {problem}: give a --global-batch-size whose "
        "share per replica (in microbatches) is a multiple of the pipeline size, or set "
        "--microbatch-group-size-per-virtual-pipeline-stage",
    )


def _ramp_problem(config: Config) -> Optional[str]:
    """What is wrong with --rampup-batch-size START INCREMENT SAMPLES, if anything."""
    b = config.batch
    start, increment, samples = b.rampup_batch_size
    if config.training.train_samples is None:
        return (
            "--rampup-batch-size goes with --train-samples (as Megatron-LM): give the "
            "run's length in samples"
        )
    if not 0 < start < b.global_batch_size:
        return (
            f"--rampup-batch-size starts at {start}: give a start between 0 and "
            f"--global-batch-size {b.global_batch_size}, both excluded"
        )
    if increment <= 0 or (b.global_batch_size - start) % increment:
        return (
            f"--rampup-batch-size's increment {increment} must be positive and divide "
            f"--global-batch-size {b.global_batch_size} - start {start}"
        )
    if samples <= 0:
        return f"--rampup-batch-size's ramp of {samples} samples must be positive"
    return None


def _ramp_is_sound(config: Config) -> bool:
    return config.batch.rampup_batch_size is None or _ramp_problem(config) is None


def _check_ramp(config: Config) -> None:
    b, dp = config.batch, config.data_parallel_size
    problem = _ramp_problem(config)
    _require(problem is None, problem or "")
    step = b.micro_batch_size * dp
    uneven = [size for size in GlobalBatch(config).steps() if size % step]
    _require(
        not uneven,
        f"--rampup-batch-size reaches batch sizes {uneven[:4]} that --micro-batch-size "
        f"{b.micro_batch_size} x data-parallel size {dp} = {step} does not divide: use a "
        f"start and an increment that are multiples of {step}",
    )


def _check_result_validation(config: Config) -> None:
    t = config.training
    _require(t.error_injection_rate >= 0, "--error-injection-rate must be >= 0 (0: never)")
    interval = t.check_weight_hash_across_dp_replicas_interval
    _require(
        interval is None or interval > 0,
        "--check-weight-hash-across-dp-replicas-interval must be positive",
    )
    _ignored_without(
        "--rerun-mode validate_results or report_stats",
        t.rerun_mode != "disabled",
        [
            ("--error-injection-rate", t.error_injection_rate > 0),
            ("--error-injection-type", t.error_injection_type != "transient_error"),
        ],
    )
    path = t.result_rejected_tracker_filename
    _require(
        path is None or _can_append(path),
        f"--result-rejected-tracker-filename {path} cannot be appended to (its directory "
        "is missing or not writable): choose another file",
    )


def _can_append(path: str) -> bool:
    if os.path.exists(path):
        return os.path.isfile(path) and os.access(path, os.W_OK)
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


def _check_training(config: Config) -> None:
    t, log = config.training, config.logging
    _check_result_validation(config)
    _require(t.lr >= 0 and t.min_lr >= 0, "--lr and --min-lr must be non-negative")
    samples = t.train_samples is not None
    _require(
        t.train_iters > 0,
        f"--train-samples {t.train_samples} is less than one global batch "
        f"({config.batch.global_batch_size})"
        if samples
        else "--train-iters must be positive",
    )
    # As Megatron-LM: the schedule is given in iterations or in samples, not both.
    unit, other = ("samples", "iters") if samples else ("iters", "samples")
    for name, unset in (("lr_decay", None), ("lr_warmup", 0), ("lr_wsd_decay", None)):
        _require(
            getattr(t, f"{name}_{other}") == unset,
            f"--{name.replace('_', '-')}-{other} goes with --train-{other}; with "
            f"--train-{unit} give --{name.replace('_', '-')}-{unit}",
        )
    warmup_flag = f"--lr-warmup-{unit}"
    _require(
        t.lr_warmup_fraction is None or getattr(t, f"lr_warmup_{unit}") == 0,
        f"give only one of --lr-warmup-fraction and {warmup_flag}",
    )
    _require(
        t.lr_warmup_fraction is None or 0 <= t.lr_warmup_fraction < 1,
        f"--lr-warmup-fraction {t.lr_warmup_fraction} must be in [0, 1)",
    )
    steps = schedule_in_samples(config)
    _require(
        steps["warmup"] < steps["decay"],
        f"warm-up ({steps['warmup']:g} samples) must be shorter than the decay "
        f"({steps['decay']:g} samples): lower {warmup_flag} or raise --lr-decay-{unit}",
    )
    _require(
        t.lr_decay_style != "WSD" or steps["wsd"] is not None,
        f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}",
    )
    _ignored_without(
        "--decoupled-lr",
        t.decoupled_lr is not None,
        [("--decoupled-min-lr", t.decoupled_min_lr is not None)],
    )
    _require(t.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
    _require(
        t.manual_gc or (t.manual_gc_interval == 0 and t.manual_gc_eval),
        "--manual-gc-interval and --no-manual-gc-eval go with --manual-gc",
    )
    _require(log.log_interval > 0, "--log-interval must be positive")
    _require(log.eval_interval > 0, "--eval-interval must be positive")


def _check_precision(config: Config) -> None:
    t = config.training
    _require(not (t.bf16 and t.fp16), "give only one of --bf16 and --fp16")
    _ignored_without("--bf16", t.bf16, [("--grad-reduce-in-bf16", t.grad_reduce_in_bf16)])


def _check_data(config: Config) -> None:
    from megatron.training.tokenizer import check_tokenizer, unused_tokenizer_flags

    d = config.data
    _require(
        d.mock_data or d.data_path,
        "no training data: give --data-path PREFIX (made by tools/preprocess_data.py; "
        "`make data` prepares the embedded corpus) or --mock-data",
    )
    _require(not (d.mock_data and d.data_path), "give only one of --data-path and --mock-data")
    parts = split_numbers(d.split)
    _require(
        all(p.replace(".", "", 1).isdigit() for p in parts)
        and 0 < len(parts) <= 3
        and sum(float(p) for p in parts) > 0,
        f"--split {d.split!r} must be up to three non-negative numbers like 969,30,1",
    )
    for prefix in _data_prefixes(d.data_path or []):
        for suffix in (".bin", ".idx"):
            _require(
                os.path.exists(prefix + suffix),
                f"--data-path {prefix}: {prefix + suffix} does not exist; run "
                f"tools/preprocess_data.py (or `make data` for the embedded corpus)",
            )
    try:
        check_tokenizer(config.tokenizer)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.tokenizer.legacy_tokenizer:
        _warn(
            "--legacy-tokenizer has no effect here: megatron-core's "
            f"{config.tokenizer.tokenizer_type} gives the ids Megatron-LM's legacy class gives"
        )
    for flag, kinds in unused_tokenizer_flags(config.tokenizer):
        _warn(
            f"{flag} has no effect: --tokenizer-type {config.tokenizer.tokenizer_type} does "
            f"not read it, only {', '.join(kinds)} (Megatron-LM ignores it too)"
        )
    _require(d.num_workers >= 0, "--num-workers must be >= 0")
    _check_fim(config)


def _check_fim(config: Config) -> None:
    """--fim-data as Megatron-LM checks it, and what its dataset would only
    meet later (a rate out of range, fragments without their rate)."""
    from megatron.training.tokenizer import FIM_TOKENIZER_TYPES

    d, kind = config.data, config.tokenizer.tokenizer_type
    defaults = DataConfig()
    _ignored_without(
        "--fim-data",
        d.fim_data,
        [
            (flag_name(f), getattr(d, f.name) != getattr(defaults, f.name))
            for f in dataclasses.fields(DataConfig)
            if f.name.startswith("fim_") and f.name != "fim_data"
        ],
    )
    if not d.fim_data:
        return
    _require(not d.mock_data, "--fim-data reorders the text of --data-path: drop --mock-data")
    _require(
        not config.tokenizer.legacy_tokenizer,
        "--fim-data: Megatron-LM refuses it with --legacy-tokenizer: drop one",
    )
    _require(
        kind in FIM_TOKENIZER_TYPES,
        f"--fim-data looks its tokens up in the vocabulary, and --tokenizer-type {kind} has "
        f"none: use one of {', '.join(FIM_TOKENIZER_TYPES)}",
    )
    for flag, rate in (("--fim-rate", d.fim_rate), ("--fim-spm-rate", d.fim_spm_rate)):
        # Megatron-LM asserts the rate is given: 0 is refused there as well.
        _require(0 < rate <= 1, f"{flag} {rate} must be in (0, 1]")
    _require(
        d.fim_split_sample is None or d.fim_fragment_rate is not None,
        "--fim-split-sample reorders fragments with --fim-fragment-rate: give it",
    )
    _ignored_without(
        "--fim-split-sample",
        d.fim_split_sample is not None,
        [("--fim-fragment-rate", d.fim_fragment_rate is not None)],
    )
    _require(
        d.fim_split_sample is None or 0 <= d.fim_fragment_rate <= 1,
        f"--fim-fragment-rate {d.fim_fragment_rate} must be in [0, 1]",
    )


def _check_data_index(config: Config) -> None:
    """The splits and index caches megatron-core's datasets would build."""
    data = _import_with_megatron_core("megatron.training.data")
    try:
        if config.data.data_path:
            data.check_splits(config)
        for directory in data.index_cache_dirs(config):
            data.check_index_cache(directory)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _import_with_megatron_core(module: str):
    """A module of ours that imports megatron-core, imported the way a rank
    imports it (cpu_compat: without CUDA, none of the costs a CPU run never
    uses). The checks that need one run last: every other refusal comes
    before megatron-core is imported (a second or more)."""
    import importlib

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core_without_cuda()
    return importlib.import_module(module)


def _data_prefixes(data_path: List[str]) -> List[str]:
    """Prefixes of '--data-path P' or '--data-path W1 P1 W2 P2'."""
    if len(data_path) <= 1:
        return list(data_path)
    if len(data_path) % 2 == 0 and all(_is_number(w) for w in data_path[0::2]):
        return list(data_path[1::2])
    return list(data_path)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _check_checkpoint(config: Config) -> None:
    c = config.checkpoint
    _require(c.save_interval is None or c.save_interval > 0, "--save-interval must be positive")
    _check_save_retention(config)
    if c.ckpt_fully_parallel_save_deprecated:
        _warn(
            "--ckpt-fully-parallel-save is deprecated and has no effect (Megatron-LM says so "
            "too): fully parallel saves are the default; --no-ckpt-fully-parallel-save "
            "turns them off"
        )
    if c.async_save and c.save and not c.use_persistent_ckpt_worker:
        _warn(
            "--async-save without --use-persistent-ckpt-worker: saves are synchronous, as "
            "Megatron-LM makes them; add --use-persistent-ckpt-worker to write in the "
            "background"
        )
        c.async_save = False
    _ignored_without(
        "--save",
        bool(c.save),
        [
            ("--save-interval", c.save_interval is not None),
            ("--async-save", c.async_save),
            ("--non-persistent-save-interval", c.non_persistent_save_interval is not None),
        ],
    )
    _ignored_without(
        "--load", bool(c.load), [("--exit-on-missing-checkpoint", c.exit_on_missing_checkpoint)]
    )
    _require(
        c.non_persistent_save_interval is None or c.non_persistent_save_interval > 0,
        "--non-persistent-save-interval must be positive",
    )
    _require(
        c.non_persistent_save_interval is None or c.non_persistent_ckpt_type == "global",
        "--non-persistent-save-interval needs --non-persistent-ckpt-type global",
    )
    _require(
        c.non_persistent_ckpt_type in (None, "global"),
        f"--non-persistent-ckpt-type {c.non_persistent_ckpt_type} is not available here "
        "(local and in_memory need nvidia-resiliency-ext's local checkpoint manager, which "
        "DeadPool's in-memory buddy mirror replaces): use global",
    )
    _require(not c.use_checkpoint_args or c.load, "--use-checkpoint-args needs --load DIR")
    _require(
        c.pretrained_checkpoint is None
        or os.path.exists(os.path.join(c.pretrained_checkpoint, TRACKER)),
        f"--pretrained-checkpoint {c.pretrained_checkpoint} holds no checkpoint (no {TRACKER} "
        "in it): name the directory given to --save when it was written",
    )
    _require(
        c.save is None or _can_create(c.save),
        f"--save {c.save} cannot be written (a file stands in its path, or a directory "
        "on it is not writable): choose another directory",
    )
    # --load tells a checkpoint's format from its files (torch_dist, or Megatron-LM's
    # legacy torch); --ckpt-format says what --save writes.
    if c.ckpt_format == "torch" and c.save:
        _check_legacy_save(config)
    _require(
        c.ckpt_format in ("torch", "torch_dist"),
        f"--ckpt-format {c.ckpt_format} cannot be written or read here (torch_dcp and "
        "fsdp_dtensor belong to FSDP): use --ckpt-format torch_dist (the default)",
    )


def _check_legacy_save(config: Config) -> None:
    """What --save with --ckpt-format torch (Megatron-LM's per-rank files)
    cannot write here, or Megatron-LM cannot either."""
    _require(
        not config.checkpoint.async_save,
        "--async-save with --ckpt-format torch: Megatron-LM writes its legacy format in the "
        "foreground only; drop --async-save or save torch_dist (the default)",
    )
    _require(
        config.parallel.expert_model_parallel_size == 1,
        "--save with --ckpt-format torch and --expert-model-parallel-size "
        f"{config.parallel.expert_model_parallel_size}: the legacy files are written here without "
        "expert parallelism only; save torch_dist (the default)",
    )


def _check_save_retention(config: Config) -> None:
    c = config.checkpoint
    if c.save_retain_interval is None:
        return
    _require(c.save_retain_interval > 0, "--save-retain-interval must be positive")
    _require(
        c.save_interval is not None and c.save_retain_interval % c.save_interval == 0,
        f"--save-retain-interval {c.save_retain_interval} must be a multiple of "
        f"--save-interval (now {c.save_interval}): change one of them",
    )


def _check_profile(config: Config) -> None:
    log = config.logging
    if not log.profile:
        _ignored_without(
            "--profile",
            False,
            [
                ("--profile-step-start", log.profile_step_start != 10),
                ("--profile-step-end", log.profile_step_end != 12),
                ("--use-pytorch-profiler", log.use_pytorch_profiler),
                ("--profile-ranks", log.profile_ranks != [0]),
            ],
        )
        return
    _require(
        0 <= log.profile_step_start < log.profile_step_end,
        f"--profile-step-start {log.profile_step_start} must be below --profile-step-end "
        f"{log.profile_step_end} (and not negative)",
    )
    if log.use_pytorch_profiler:
        _require(
            log.tensorboard_dir is not None,
            "--use-pytorch-profiler writes its traces to --tensorboard-dir: give one",
        )
    else:
        _require(
            config.parallel.distributed_backend == "nccl",
            "--profile without --use-pytorch-profiler opens a CUDA profiler range for nsys, "
            "which needs a GPU: add --use-pytorch-profiler here (traces to --tensorboard-dir)",
        )


def _check_logging(config: Config) -> None:
    log = config.logging
    _check_profile(config)
    level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    _require(
        log.logging_level is not None or not level or level.lstrip("-").isdigit(),
        f"MEGATRON_LOGGING_LEVEL={level} is no logging level: give a number (10 DEBUG, "
        "20 INFO, 30 WARNING, 40 ERROR, 50 CRITICAL) or unset it",
    )
    _require(log.tensorboard_log_interval > 0, "--tensorboard-log-interval must be positive")
    _require(log.tensorboard_queue_size > 0, "--tensorboard-queue-size must be positive")
    dashboard = bool(log.tensorboard_dir or log.wandb_project)
    names = (
        "log_timers_to_tensorboard",
        "log_validation_ppl_to_tensorboard",
        "log_memory_to_tensorboard",
        "log_world_size_to_tensorboard",
    )
    _ignored_without(
        "--tensorboard-dir or --wandb-project",
        dashboard,
        [("--" + name.replace("_", "-"), getattr(log, name)) for name in names]
        + [("--no-log-loss-scale-to-tensorboard", not log.log_loss_scale_to_tensorboard)],
    )
    _require(
        not (dashboard and log.log_memory_to_tensorboard)
        or config.parallel.distributed_backend == "nccl",
        "--log-memory-to-tensorboard reads the CUDA allocator's statistics: there is none "
        "on CPU; drop it",
    )
    if log.tensorboard_dir:
        _require_package("tensorboard", "--tensorboard-dir")
        _require(
            _can_create(log.tensorboard_dir),
            f"--tensorboard-dir {log.tensorboard_dir} cannot be written: choose another directory",
        )
    for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
        _require(
            log.wandb_project or getattr(log, name) is None,
            f"--{name.replace('_', '-')} goes with --wandb-project NAME",
        )
    if log.wandb_project:
        from megatron.training.dashboards import wandb_directory

        _require_package("wandb", "--wandb-project")
        directory = wandb_directory(config)
        _require(
            directory is not None,
            "--wandb-project needs --wandb-save-dir DIR or --save DIR (runs go to SAVE/wandb)",
        )
        _require(
            _can_create(directory), f"W&B's directory {directory} cannot be written: choose another"
        )


def _require_package(module: str, flag: str) -> None:
    _require(
        _importable(module),
        f"{flag} needs the python package '{module}': `pip install {module}`, or drop {flag}",
    )


def _can_create(path: str) -> bool:
    """Whether ``path`` is, or can be made, a writable directory: checked up
    front, so that a save does not fail hours into a run."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
