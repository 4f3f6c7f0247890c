"""pretrain_gpt.py's flag parser (megatron/training/arguments.py),
in-process: a minimal command line and the world size, every generated
flag (Megatron-LM's names, each accepted with its values or refused by
name), the parser's flags exactly the dataclasses', an extension's
section, a missing required flag, an unknown one told apart from
Megatron-LM's that are not here yet, and --use-checkpoint-args.
pretrain_gpt.py failing fast before any process group, and its --help, are
in tests/functional_tests/test_arguments.py. The checks the parse runs are
tests/unit_tests/training/flags/'s."""

import argparse
import dataclasses
import json
import typing

import pytest

from megatron.training import checkpointing as ckpt
from megatron.training.arguments import build_parser, flag_name, parse_args
from megatron.training.config import SECTIONS
from tools import flag_parity
from tests.unit_tests.training.command_line import (
    BASE,
    PP2,
    PP3,
    VPP2,
    _config_error,
    _names_all,
    argv,
)


def test_minimal_argv_is_valid_and_keeps_given_values():
    config = parse_args(argv(), world_size=1)
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 64, 4, 32)
    assert config.batch.micro_batch_size == 2
    assert config.training.train_iters == 10
    assert config.training.lr == pytest.approx(1e-3)
    assert config.data.mock_data is True
    assert config.world_size == 1 and config.data_parallel_size == 1


def test_world_size_comes_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = parse_args(argv("--tensor-model-parallel-size", "2"))
    assert config.world_size == 4 and config.data_parallel_size == 2
    assert config.batch.global_batch_size == 4


# --- every generated flag ------------------------------------------------------------

ALL_FIELDS = [(section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _kind(annotation):
    """(base type, item type) of a field annotation: Optional[List[int]] -> (list, int)."""
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return list, typing.get_args(annotation)[0]
    return annotation, None


# A MoE model that runs on one CPU rank (no biases: see _check_moe).
MOE = ["--num-experts", "4", "--disable-bias-linear"]
SPECIAL = {
    "hidden_size": (["128"], 128, [], (), 1),
    "num_attention_heads": (["8"], 8, [], (), 1),
    "num_query_groups": (["2"], 2, ["--group-query-attention"], (), 1),
    "max_position_embeddings": (["64"], 64, [], (), 1),
    "tensor_model_parallel_size": (["2"], 2, [], (), 2),
    "pipeline_model_parallel_layout": (
        ["Ettt|tL"],
        "Ettt|tL",
        ["--pipeline-model-parallel-size", "2"],
        (),
        2,
    ),
    "pipeline_model_parallel_size": (["2"], 2, [], (), 2),
    "num_layers_per_virtual_pipeline_stage": (["1"], 1, PP2, (), 2),
    "num_virtual_stages_per_pipeline_rank": (["2"], 2, PP2, (), 2),
    "context_parallel_size": (["2"], 2, [], (), 2),
    "num_distributed_optimizer_instances": (["2"], 2, ["--use-distributed-optimizer"], (), 2),
    "cp_comm_type": (["a2a"], ["a2a"], ["--context-parallel-size", "2"], (), 2),
    "hierarchical_context_parallel_sizes": (["2"], [2], ["--context-parallel-size", "2"], (), 2),
    "decoder_first_pipeline_num_layers": (["3"], 3, PP2, (), 2),
    "decoder_last_pipeline_num_layers": (["1"], 1, PP2, (), 2),
    "microbatch_group_size_per_vp_stage": (["2"], 2, PP2 + VPP2, (), 2),
    "overlap_p2p_comm": ([], False, PP3 + VPP2, (), 3),
    "overlap_param_gather": (
        [],
        True,
        ["--use-distributed-optimizer", "--overlap-grad-reduce"],
        (),
        1,
    ),
    "overlap_param_gather_with_optimizer_step": (
        [],
        True,
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        + ["--ckpt-format", "torch"]
        + PP2
        + VPP2,
        (),
        2,
    ),
    "tokenizer_type": (["NullTokenizer"], "NullTokenizer", ["--vocab-size", "100"], (), 1),
    "vocab_size": (["1000"], 1000, [], (), 1),
    "split": (["90,8,2"], "90,8,2", [], (), 1),
    "save_interval": (["6"], 6, ["--save", "ckpt"], (), 1),
    "async_save": ([], True, ["--save", "ckpt", "--use-persistent-ckpt-worker"], (), 1),
    "result_rejected_tracker_filename": (["rejected.txt"], "rejected.txt", [], (), 1),
    "save_retain_interval": (["4"], 4, ["--save", "ckpt", "--save-interval", "2"], (), 1),
    "overlap_p2p_comm_warmup_flush": ([], True, PP3 + VPP2, (), 3),
    "rotary_percent": (["0.5"], 0.5, [], (), 1),
    "position_embedding": ([], False, ["--position-embedding-type", "rope"], (), 1),
    "attention_backend": (["local"], "local", [], (), 1),  # TE's are refused on CPU (below)
    "manual_gc_interval": (["5"], 5, ["--manual-gc"], (), 1),
    "manual_gc_eval": ([], False, ["--manual-gc"], (), 1),
    "empty_unused_memory_level": (["2"], 2, [], (), 1),
    "train_samples": (["100"], 100, [], ("--train-iters",), 1),
    "lr_decay_samples": (["60"], 60, ["--train-samples", "100"], ("--train-iters",), 1),
    "lr_warmup_samples": (["6"], 6, ["--train-samples", "100"], ("--train-iters",), 1),
    "lr_wsd_decay_samples": (["6"], 6, ["--train-samples", "100"], ("--train-iters",), 1),
    "non_persistent_save_interval": (
        ["3"],
        3,
        ["--save", "ckpt", "--non-persistent-ckpt-type", "global"],
        (),
        1,
    ),
    "exit_on_missing_checkpoint": ([], True, ["--load", "ckpt"], (), 1),
    # Dashboard flags: checked, not created, by parsing.
    "log_timers_to_tensorboard": ([], True, ["--tensorboard-dir", "tb"], (), 1),
    "log_loss_scale_to_tensorboard": ([], False, ["--tensorboard-dir", "tb"], (), 1),
    "log_validation_ppl_to_tensorboard": ([], True, ["--tensorboard-dir", "tb"], (), 1),
    "log_world_size_to_tensorboard": ([], True, ["--tensorboard-dir", "tb"], (), 1),
    "wandb_project": (["p"], "p", ["--wandb-save-dir", "wb"], (), 1),
    "wandb_exp_name": (["e"], "e", ["--wandb-project", "p", "--save", "ckpt"], (), 1),
    "wandb_save_dir": (["wb"], "wb", ["--wandb-project", "p"], (), 1),
    "wandb_entity": (["t"], "t", ["--wandb-project", "p", "--save", "ckpt"], (), 1),
    "use_checkpoint_args": ([], True, ["--load", "no-checkpoint-here"], (), 1),
    "rampup_batch_size": (
        ["2", "2", "10"],
        [2, 2, 10],
        ["--train-samples", "100", "--global-batch-size", "8"],
        ("--train-iters",),
        1,
    ),
    "decoupled_min_lr": (["1e-5"], 1e-5, ["--decoupled-lr", "1e-4"], (), 1),
    # At TP 1 turned off with a warning, as Megatron-LM; at TP 2 refused on CPU
    # (test_sequence_parallel_needs_the_norm_layers_of_te_or_apex).
    "sequence_parallel": ([], False, [], (), 1),
    # MoE flags go with --num-experts.
    "expert_model_parallel_size": (["2"], 2, ["--num-experts", "4"], (), 2),
    "expert_tensor_parallel_size": (
        ["2"],
        2,
        ["--num-experts", "4", "--disable-bias-linear"],
        (),
        2,
    ),
    "moe_router_topk": (["3"], 3, MOE, (), 1),
    "moe_pad_expert_input_to_capacity": (
        [],
        True,
        [*MOE, "--moe-expert-capacity-factor", "1.5"],
        (),
        1,
    ),
    "moe_layer_freq": (["([0]+[1]*3)"], [0, 1, 1, 1], MOE, (), 1),
    "moe_router_enable_expert_bias": (
        [],
        True,
        [*MOE, "--moe-router-score-function", "sigmoid"],
        (),
        1,
    ),
    "moe_router_group_topk": (["1"], 1, [*MOE, "--moe-router-num-groups", "2"], (), 1),
    "mtp_num_layers": (["1"], 1, ["--position-embedding-type", "rope"], (), 1),
    "moe_shared_expert_intermediate_size": (
        ["32"],
        32,
        ["--num-experts", "4", "--disable-bias-linear"],
        (),
        1,
    ),
    # Several balancing types with their coefficients; one is taken as itself.
    "moe_router_load_balancing_type": (
        ["aux_loss", "seq_aux_loss"],
        ["aux_loss", "seq_aux_loss"],
        [*MOE, "--moe-aux-loss-coeff", "1e-2", "1e-3"],
        (),
        1,
    ),
    "moe_aux_loss_coeff": (["1e-2"], 1e-2, MOE, (), 1),
    "num_experts": (["4"], 4, ["--disable-bias-linear"], (), 1),
    "grad_reduce_in_bf16": ([], True, ["--bf16"], (), 1),
    # Recompute: full takes a method and a layer count; selective, modules.
    "recompute_granularity": (
        ["full"],
        "full",
        ["--recompute-method", "block", "--recompute-num-layers", "1"],
        (),
        1,
    ),
    "recompute_method": (
        ["uniform"],
        "uniform",
        ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
        (),
        1,
    ),
    "recompute_num_layers": (
        ["2"],
        2,
        ["--recompute-granularity", "full", "--recompute-method", "uniform"],
        (),
        1,
    ),
    "recompute_modules": (
        ["core_attn", "mlp"],
        ["core_attn", "mlp"],
        ["--recompute-granularity", "selective"],
        (),
        1,
    ),
    "distribute_saved_activations": (
        [],
        True,
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "1", "--tensor-model-parallel-size", "2"],
        (),
        2,
    ),
    "profile": ([], True, ["--use-pytorch-profiler", "--tensorboard-dir", "tb"], (), 1),
    # Without their GPU feature (refused here): taken, with a warning.
    "cuda_graph_scope": (["attn", "mlp"], ["attn", "mlp"], [], (), 1),
    "offload_modules": (["core_attn"], ["core_attn"], [], (), 1),
    **{
        name: (
            values,
            expected,
            ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"],
            (),
            1,
        )
        for name, values, expected in (
            ("profile_step_start", ["3"], 3),
            ("profile_step_end", ["30"], 30),
            ("use_pytorch_profiler", [], True),
            ("profile_ranks", ["0", "1"], [0, 1]),
        )
    },
}
# Accepted by the parser, then refused with a message naming the flag.
UNSUPPORTED = {
    # Refused on CPU (no zero-centred LayerNorm in torch), where the tests run.
    "apply_layernorm_1p": ([], ()),
    # The CUDA allocator's figures: refused on CPU, where the tests run.
    "log_memory_to_tensorboard": (["--tensorboard-dir", "tb"], ()),
    "legacy_tokenizer": ([], ()),
    "ckpt_format": (["torch_dcp"], ()),
    # Gradient-accumulation fusion, which it needs, runs on a GPU only.
    "defer_embedding_wgrad_compute": ([], ()),
    # FP8 needs Transformer Engine on a GPU.
    "fp8": (["hybrid"], ()),
    "fp8_recipe": (["tensorwise", "--fp8-format", "hybrid"], ()),
    "fp8_amax_history_len": (["16", "--fp8-format", "hybrid"], ()),
    "fp8_amax_compute_algo": (["max", "--fp8-format", "hybrid"], ()),
    "fp8_param_gather": (["--fp8-format", "hybrid"], ()),
    # Transformer Engine's kernel: refused on CPU.
    "cross_entropy_fusion_impl": (["te", "--cross-entropy-loss-fusion"], ()),
    # GPU kernels (grouped GEMM; DeepEP or HybridEP): refused on CPU.
    "moe_grouped_gemm": (MOE, ()),
    # Transformer Engine's fused MoE kernels: refused on CPU.
    "moe_permute_fusion": (MOE, ()),
    "moe_router_fusion": (MOE, ()),
    "moe_token_dispatcher_type": (["flex", *MOE], ()),
    "moe_enable_deepep": (MOE, ()),
    # GPU only, with Transformer Engine: refused on CPU.
    "tp_comm_overlap": ([], ()),
    "overlap_moe_expert_parallel_comm": (MOE, ()),
    "delay_wgrad_compute": (["--overlap-moe-expert-parallel-comm", *MOE], ()),
    "ep_overlap_early_attn_memory_release": (MOE, ()),  # alone: megatron-core refuses it
    "fine_grained_activation_offloading": (["--offload-modules", "core_attn"], ()),
    "cuda_graph_impl": (["transformer_engine"], ()),
    "external_cuda_graph": ([], ()),
    "te_rng_tracker": ([], ()),
}


# Flags that go with a tokenizer type reading files: (type, the files it needs).
TOKENIZER_FILE_FLAGS = {
    "tokenizer_model": "Llama2Tokenizer",
    "vocab_file": "GPT2BPETokenizer",
    "merge_file": "GPT2BPETokenizer",
    "tokenizer_special_tokens": "Llama2Tokenizer",
    "tokenizer_sentencepiece_legacy": "Llama2Tokenizer",
    "tiktoken_pattern": "TikTokenizer",
    "tiktoken_num_special_tokens": "TikTokenizer",
    "tokenizer_hf_use_fast": "HuggingFaceTokenizer",
    "tokenizer_hf_include_special_tokens": "HuggingFaceTokenizer",
    "trust_remote_code": "HuggingFaceTokenizer",
}


def tokenizer_case(name, tmp_path):
    """(values, expected, companion argv) for a flag of TOKENIZER_FILE_FLAGS;
    the files exist (parsing checks that, not their contents), and the
    TikToken vocabulary is the 256 bytes."""
    kind = TOKENIZER_FILE_FLAGS[name]
    model = tmp_path / "some.model"
    model.write_text("")
    tiktoken = tmp_path / "tiktoken.json"
    tiktoken.write_text(
        json.dumps([{"rank": i, "token_bytes": "", "token_str": ""} for i in range(256)])
    )
    companion = {
        "Llama2Tokenizer": ["--tokenizer-model", str(model)],
        "GPT2BPETokenizer": ["--vocab-file", str(model), "--merge-file", str(model)],
        "TikTokenizer": ["--tokenizer-model", str(tiktoken), "--vocab-size", "1250"],
        "HuggingFaceTokenizer": ["--tokenizer-model", str(tmp_path)],
    }[kind]
    companion = ["--tokenizer-type", kind] + companion
    given = {
        "tokenizer_model": ([str(model)], str(model)),
        "vocab_file": ([str(model)], str(model)),
        "merge_file": ([str(model)], str(model)),
        "tokenizer_special_tokens": (["<a>", "<b>"], ["<a>", "<b>"]),
        "tiktoken_pattern": (["v1"], "v1"),
        "tiktoken_num_special_tokens": (["999"], 999),
    }
    values, expected = given.get(name, ([], True))
    return values, expected, companion


def _generic_case(f):
    kind, item = _kind(f.type)
    default = f.default if f.default is not dataclasses.MISSING else None
    if kind is bool:  # a --no-... flag turns a default of True off
        return [], not default
    if "choices" in f.metadata:
        value = next(c for c in f.metadata["choices"] if c != default)
        return [str(value)], value
    if kind is int:
        value = 6 if default is None else default + 3
        return [str(value)], value
    if kind is float:
        value = 0.25 if default is None else default + 0.5
        return [repr(value)], value
    if kind is str:
        return ["some/path"], "some/path"
    raise AssertionError(f"no test value for {f.name}: {f.type}")


@pytest.mark.parametrize("section, f", ALL_FIELDS, ids=[f.name for _, f in ALL_FIELDS])
def test_every_flag_is_accepted(section, f, tiny_prefix, tmp_path):
    flag = flag_name(f)
    name = f.name.replace("_", "-")
    # Megatron's names; Megatron turns a default of True off with --no-NAME.
    # A flag named apart from its field is Megatron-LM's (--fp8-format -> fp8).
    if flag != ("--no-" if f.default is True else "--") + name:
        assert flag in flag_parity.load_upstream(), flag
        assert flag.startswith(("--no-", "--disable-")) == (f.default is True), flag
    assert f.metadata.get("help"), f"{flag} has no help text"
    if f.name in UNSUPPORTED:
        values, drop = UNSUPPORTED[f.name]
        args = argv(flag, *values, drop=drop)
        # The parser knows the flag (no SystemExit), the check refuses it by name.
        assert getattr(build_parser(SECTIONS).parse_args(args), f.name) is not None
        _names_all(_config_error(args), flag)
        return
    if f.name == "data_path":
        values, expected, companion, drop, world = (
            [tiny_prefix],
            [tiny_prefix],
            ["--split", "1,1,1"],
            ("--mock-data",),
            1,
        )
    elif f.name == "fim_data":  # reorders real text, looked up in a vocabulary
        model = tmp_path / "some.model"
        model.write_text("")
        values, expected, drop, world = [], True, ("--mock-data",), 1
        companion = ["--data-path", tiny_prefix, "--split", "1,1,1"]
        companion += ["--tokenizer-type", "GPT2BPETokenizer"]
        companion += ["--vocab-file", str(model), "--merge-file", str(model)]
    elif f.name in TOKENIZER_FILE_FLAGS:
        values, expected, companion = tokenizer_case(f.name, tmp_path)
        drop, world = (), 1
    elif f.name == "pretrained_checkpoint":
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
        values, expected, companion, drop, world = [str(tmp_path)], str(tmp_path), [], (), 1
    elif f.name in SPECIAL:
        values, expected, companion, drop, world = SPECIAL[f.name]
    else:
        values, expected = _generic_case(f)
        companion, drop, world = [], (), 1
        if section == "moe" and f.name != "num_experts":
            companion = MOE
    drop = tuple(drop) + ((flag,) if flag in BASE and flag not in drop else ())
    config = parse_args(argv(*companion, flag, *values, drop=drop), world_size=world)
    assert getattr(getattr(config, section), f.name) == expected


def test_parser_has_exactly_the_dataclass_flags():
    parser = build_parser(SECTIONS)
    options = {o for action in parser._actions for o in action.option_strings}
    expected = {flag_name(f) for _, f in ALL_FIELDS}
    assert len(expected) == len(ALL_FIELDS), "two fields share a flag"
    # Megatron-LM's second spellings of a flag, where it has them.
    aliases = {a for _, f in ALL_FIELDS for a in f.metadata.get("aliases", ())}
    assert aliases <= set(flag_parity.load_upstream()), aliases
    assert options - {"-h", "--help"} == expected | aliases


def test_extra_section_lands_in_config_extensions_by_its_type():
    @dataclasses.dataclass(kw_only=True)
    class Extra:
        """An extension's flags."""

        my_knob: int = dataclasses.field(default=3, metadata={"help": "a knob"})

    seen = []
    config = parse_args(
        argv("--my-knob", "7"),
        extra_sections={"ext": Extra},
        extra_validators=[seen.append],
        world_size=1,
    )
    assert config.section(Extra).my_knob == 7
    assert seen == [config]
    # Parsed without it, the section has its defaults.
    assert parse_args(argv(), world_size=1).section(Extra).my_knob == 3


@pytest.mark.parametrize(
    "flag",
    [
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--seq-length",
        "--micro-batch-size",
        "--lr",
    ],
)
def test_missing_required_flag(flag):
    # A ConfigError (exit code 2 in pretrain_gpt.py), not an argparse SystemExit.
    message = _config_error(argv(drop=(flag,)))
    _names_all(message, flag)


def test_an_unknown_flag_is_told_apart_from_megatron_lms_that_are_not_here_yet():
    message = _config_error(
        argv("--num-layer", "4", "--max-seqlen-per-dp-cp-rank", "8", "--zzz")
        + ["--use-torch-fsdp2", "--enable-cuda-graph", "--decode-only-cuda-graphs"]
    )
    assert "unknown flag --num-layer: did you mean --num-layers?" in message
    assert "--max-seqlen-per-dp-cp-rank is Megatron-LM's, not supported here yet" in message
    assert "unknown flag --zzz" in message and "did you mean" not in message.split("--zzz")[1]
    # A flag of a feature that is not here: the feature and why, its flags together.
    _names_all(message, "--use-torch-fsdp2: Megatron-LM's fully sharded", "--use-distributed-opt")
    assert (
        "--enable-cuda-graph, --decode-only-cuda-graphs: Megatron-LM's megatron-core's own "
        "CUDA graphs, not built here"
    ) in message


def megatron_lm_checkpoint(root, legacy, **args):
    """A directory with only what --use-checkpoint-args reads: the tracker
    and the ``args`` (Megatron-LM's names) in common.pt, or in the first
    rank's file of a legacy (--ckpt-format torch) checkpoint."""
    import torch

    folder = root / "iter_0000004"
    name = "mp_rank_00/model_optim_rng.pt" if legacy else "common.pt"
    (folder / name).parent.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**args), "iteration": 4}, folder / name)
    (root / ckpt.TRACKER).write_text("4")
    return str(root)


@pytest.mark.parametrize("legacy", [False, True], ids=["torch_dist", "torch"])
def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path, legacy):
    load = megatron_lm_checkpoint(
        tmp_path,
        legacy,
        num_layers=3,
        hidden_size=48,
        num_attention_heads=4,
        seq_length=32,
        add_bias_linear=False,  # Megatron-LM's dest of --disable-bias-linear
        hidden_dropout=0.0,
        tensor_model_parallel_size=2,
    )
    base = ["--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]
    base += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    # Forced flags replace the command line's, the others only fill what it left unset.
    cfg = parse_args(
        base + ["--use-checkpoint-args", "--load", load, "--seq-length", "64"], world_size=1
    )
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (3, 48, 4)
    assert m.seq_length == 64 and m.hidden_dropout == 0.0 and m.disable_bias_linear
    assert cfg.parallel.tensor_model_parallel_size == 1  # only with the mp flag
    with pytest.raises(Exception, match="missing required flags: --num-layers"):
        parse_args(base + ["--load", load], world_size=1)  # the control: not asked
    cfg = parse_args(
        base + ["--use-checkpoint-args", "--use-mp-args-from-checkpoint-args", "--load", load],
        world_size=2,
    )
    assert cfg.parallel.tensor_model_parallel_size == 2
