"""Tests for megatron/training/arguments.py and its checks (flags/):
Megatron's derived defaults, every generated flag, and one test per bad
input (a ConfigError whose message names the flag to change).
pretrain_gpt.py failing fast before any process group, and its --help, are
in tests/functional_tests/test_arguments.py.
"""

import dataclasses
import json
import os
import typing

import pytest

from megatron.training.flags import host
from megatron.training.arguments import ConfigError, build_parser, flag_name, parse_args
from megatron.training.config import SECTIONS
from tools import flag_parity

BASE = {
    "--num-layers": "4",
    "--hidden-size": "64",
    "--num-attention-heads": "4",
    "--seq-length": "32",
    "--micro-batch-size": "2",
    "--train-iters": "10",
    "--lr": "1e-3",
    "--mock-data": None,
    "--tokenizer-type": "ByteLevelTokenizer",
}


def argv(*extra, drop=(), **overrides):
    """A minimal valid command line; ``overrides`` replace base values
    (num_layers=8 -> --num-layers 8), ``drop`` removes base flags, ``extra``
    is appended verbatim."""
    base = dict(BASE)
    for flag in drop:
        del base[flag]
    for name, value in overrides.items():
        base["--" + name.replace("_", "-")] = str(value)
    out = []
    for flag, value in base.items():
        out.append(flag)
        if value is not None:
            out.append(value)
    return out + list(extra)


def _write_dataset(directory, texts):
    from tools import preprocess_data

    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    prefixes = preprocess_data.main(
        ["--input", str(src), "--output-prefix", str(directory / "tiny"), "--append-eod"]
        + ["--tokenizer-type", "ByteLevelTokenizer"]
    )
    return prefixes["text"]


@pytest.fixture(scope="module")
def tiny_prefix(tmp_path_factory):
    """A real 3-document dataset (.bin/.idx) made by tools/preprocess_data.py."""
    texts = [
        "The first document, about cats.",
        "A second one, about dogs.",
        "And a third about neither.",
    ]
    return _write_dataset(tmp_path_factory.mktemp("tiny"), texts)


def _config_error(args, world_size=1):
    with pytest.raises(ConfigError) as info:
        parse_args(args, world_size=world_size)
    return str(info.value)


def _names_all(message, *flags):
    missing = [f for f in flags if f not in message]
    assert not missing, f"message does not name {missing}: {message!r}"


# --- defaults ------------------------------------------------------------------------


def test_minimal_argv_is_valid_and_keeps_given_values():
    config = parse_args(argv(), world_size=1)
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 64, 4, 32)
    assert config.batch.micro_batch_size == 2
    assert config.training.train_iters == 10
    assert config.training.lr == pytest.approx(1e-3)
    assert config.data.mock_data is True
    assert config.world_size == 1 and config.data_parallel_size == 1


@pytest.mark.parametrize(
    "hidden, heads, swiglu, expected",
    [
        (64, 4, False, 256),
        (96, 4, False, 384),
        (64, 4, True, 128),  # int(8*64/3/64)*64 = int(2.67)*64
        (100, 4, True, 256),  # int(266.7/64)*64
        (192, 4, True, 512),  # exact: 8*192/3 = 512
    ],
)
def test_ffn_hidden_size_default(hidden, heads, swiglu, expected):
    extra = ["--swiglu"] if swiglu else []
    config = parse_args(argv(*extra, hidden_size=hidden, num_attention_heads=heads), world_size=1)
    assert config.model.ffn_hidden_size == expected


def test_explicit_ffn_hidden_size_is_kept():
    config = parse_args(argv("--swiglu", "--ffn-hidden-size", "200"), world_size=1)
    assert config.model.ffn_hidden_size == 200


def test_max_position_embeddings_defaults_to_seq_length():
    config = parse_args(argv(seq_length=48), world_size=1)
    assert config.model.max_position_embeddings == 48
    config = parse_args(argv("--max-position-embeddings", "128", seq_length=48), world_size=1)
    assert config.model.max_position_embeddings == 128


@pytest.mark.parametrize(
    "world, tp, pp, mbs, dp",
    [
        (1, 1, 1, 2, 1),
        (4, 1, 1, 3, 4),
        (4, 2, 1, 2, 2),
        (8, 2, 2, 2, 2),
        (8, 1, 2, 1, 4),
    ],
)
def test_global_batch_defaults_to_micro_batch_times_dp(world, tp, pp, mbs, dp):
    config = parse_args(
        argv(
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            micro_batch_size=mbs,
        ),
        world_size=world,
    )
    assert config.data_parallel_size == dp
    assert config.batch.global_batch_size == mbs * dp


def test_explicit_global_batch_is_kept():
    config = parse_args(argv("--global-batch-size", "16"), world_size=2)
    assert config.batch.global_batch_size == 16


def test_lr_decay_iters_defaults_to_train_iters():
    assert parse_args(argv(train_iters=37), world_size=1).training.lr_decay_iters == 37
    config = parse_args(argv("--lr-decay-iters", "20", train_iters=37), world_size=1)
    assert config.training.lr_decay_iters == 20


def test_tokenizer_defaults_to_gpt2_bpe_as_megatron_lm(tmp_path):
    """Megatron-LM's pretrain_gpt.py default; it reads GPT-2's vocab.json and
    merges.txt, and says so before anything starts when they are not given."""
    _names_all(_config_error(argv(drop=("--tokenizer-type",))), "GPT2BPETokenizer", "--vocab-file")
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("{}")
    files = [
        "--vocab-file",
        str(tmp_path / "vocab.json"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
    ]
    config = parse_args(argv(*files, drop=("--tokenizer-type",)), world_size=1)
    assert config.tokenizer.tokenizer_type == "GPT2BPETokenizer"


def test_num_query_groups_follow_heads_without_gqa():
    config = parse_args(argv(num_attention_heads=8, hidden_size=64), world_size=1)
    assert config.model.num_query_groups == 8
    config = parse_args(
        argv("--group-query-attention", "--num-query-groups", "2", num_attention_heads=8),
        world_size=1,
    )
    assert config.model.num_query_groups == 2


def test_backend_is_gloo_without_cuda(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: False)
    assert parse_args(argv(), world_size=1).parallel.distributed_backend == "gloo"
    # Even when nccl is asked for explicitly: there is no GPU to run it on.
    config = parse_args(argv("--distributed-backend", "nccl"), world_size=1)
    assert config.parallel.distributed_backend == "gloo"


def test_backend_is_nccl_with_cuda_unless_cpu(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    assert parse_args(argv(), world_size=1).parallel.distributed_backend == "nccl"
    assert parse_args(argv("--cpu"), world_size=1).parallel.distributed_backend == "gloo"


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
# name -> (values after the flag, expected parsed value, companion argv, drop, world size)
# PP 2 with 2 microbatches per replica (world 2), and two virtual stages.
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
# Batched sends and receives need PP > 2: PP 3, 6 layers, 3 microbatches.
PP3 = ["--pipeline-model-parallel-size", "3", "--num-layers", "6", "--global-batch-size", "6"]
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


# --- bad input: ConfigError naming the flag ------------------------------------------


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--profile"], ["--profile", "--use-pytorch-profiler"]),  # nsys: a GPU
        (["--profile", "--use-pytorch-profiler"], ["--tensorboard-dir"]),
        (
            ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"]
            + ["--profile-step-start", "5", "--profile-step-end", "5"],
            ["--profile-step-start", "--profile-step-end"],
        ),
        (["--cross-entropy-fusion-impl", "te"], ["--cross-entropy-loss-fusion"]),
        (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "--num-experts"]),
        (["--defer-embedding-wgrad-compute"], ["--defer-embedding-wgrad-compute", "> 1"]),
    ],
)
def test_a_flag_missing_its_companion_or_its_gpu_is_refused_by_name(flags, named):
    _names_all(_config_error(argv(*flags)), *named)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--profile-step-start", "3"], ["--profile-step-start", "--profile"]),
        (["--decoupled-min-lr", "1e-5"], ["--decoupled-min-lr", "--decoupled-lr"]),
        (["--grad-reduce-in-bf16"], ["--grad-reduce-in-bf16", "--bf16"]),
        (["--fp8-amax-history-len", "8"], ["--fp8-amax-history-len", "--fp8-format"]),
        (["--save-interval", "5", "--async-save"], ["--save-interval, --async-save", "--save"]),
        (["--exit-on-missing-checkpoint"], ["--exit-on-missing-checkpoint", "--load"]),
        (["--log-timers-to-tensorboard"], ["--log-timers-to-tensorboard", "--tensorboard-dir"]),
        (["--no-log-loss-scale-to-tensorboard"], ["--no-log-loss-scale-to-tensorboard"]),
        (["--moe-router-topk", "4"], ["--moe-router-topk", "--num-experts"]),
        (["--wgrad-deferral-limit", "2"], ["--wgrad-deferral-limit", "--defer-embedding"]),
        (["--cp-comm-type", "a2a"], ["--cp-comm-type", "--context-parallel-size > 1"]),
        (["--first-last-layers-bf16"], ["--first-last-layers-bf16", "--fp8-format"]),
        (
            ["--num-layers-at-end-in-bf16", "2"],
            ["--num-layers-at-end-in-bf16", "--first-last-layers-bf16"],
        ),
    ],
)
def test_a_flag_megatron_lm_ignores_without_its_companion_is_taken_with_a_warning(
    flags, named, capsys
):
    """Megatron-LM ignores these without their companion: so does this
    build, and says so (its own configs give some of them so)."""
    parse_args(argv(*flags), world_size=1)
    printed = capsys.readouterr().out
    assert "WARNING:" in printed and "no effect without" in printed
    _names_all(printed, *named)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ckpt-fully-parallel-save"], ["--ckpt-fully-parallel-save", "deprecated"]),
        (["--use-flash-attn"], ["--use-flash-attn", "legacy", "--attention-backend flash"]),
        (["--rotary-interleaved"], ["--rotary-interleaved", "--position-embedding-type rope"]),
        (
            ["--no-async-tensor-model-parallel-allreduce"],
            ["--no-async-tensor-model-parallel-allreduce", "no effect", "deprecated"],
        ),
        (
            ["--disable-async-tensor-model-parallel-allreduce"],
            ["--no-async-tensor-model-parallel-allreduce", "no effect"],
        ),
        (
            ["--save", "ckpt", "--async-save"],
            ["--async-save", "--use-persistent-ckpt-worker", "synchronous"],
        ),
    ],
)
def test_a_flag_megatron_lm_takes_to_no_effect_is_taken_with_a_warning(flags, words, capsys):
    config = parse_args(argv(*flags), world_size=1)
    printed = capsys.readouterr().out
    assert "WARNING:" in printed
    _names_all(printed, *words)
    # As Megatron-LM: an --async-save without the persistent worker is synchronous.
    assert config.checkpoint.async_save is False


def test_the_legacy_tokenizer_is_taken_where_it_gives_the_same_ids(tmp_path, capsys):
    """--legacy-tokenizer (one of Megatron-LM's release configs): with GPT-2
    BPE the ids are the same (measured), so it is taken with a warning;
    with another type it is refused by name."""
    files = [tmp_path / "vocab.json", tmp_path / "merges.txt"]
    for f in files:
        f.write_text("")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(files[0])]
    gpt2 += ["--merge-file", str(files[1]), "--legacy-tokenizer"]
    config = parse_args(argv(*gpt2, drop=("--tokenizer-type",)), world_size=1)
    assert config.tokenizer.legacy_tokenizer
    _names_all(capsys.readouterr().out, "WARNING:", "--legacy-tokenizer has no effect")
    _names_all(_config_error(argv("--legacy-tokenizer")), "--legacy-tokenizer", "ByteLevel")


@pytest.mark.parametrize(
    "flags, world, named",
    [
        (
            ["--save", "ckpt", "--save-interval", "4", "--save-retain-interval", "6"],
            1,
            ["--save-retain-interval 6", "--save-interval"],
        ),
        (["--save-retain-interval", "4"], 1, ["--save-retain-interval", "--save-interval"]),
        (
            PP2 + ["--overlap-p2p-communication-warmup-flush"],
            2,
            ["--overlap-p2p-communication-warmup-flush", "virtual stages"],
        ),
        (
            PP3
            + VPP2
            + ["--no-overlap-p2p-communication"]
            + ["--overlap-p2p-communication-warmup-flush"],
            3,
            ["--overlap-p2p-communication-warmup-flush", "--no-overlap-p2p-communication"],
        ),
        (
            ["--ddp-average-in-collective", "--calculate-per-token-loss"],
            1,
            ["--ddp-average-in-collective", "--calculate-per-token-loss"],
        ),
        (
            ["--use-flash-attn", "--deterministic-mode"],
            1,
            ["--use-flash-attn", "--deterministic-mode"],
        ),
    ],
)
def test_flags_megatron_core_would_refuse_later_are_refused_at_parse_time(flags, world, named):
    _names_all(_config_error(argv(*flags), world_size=world), *named)


def test_the_logging_level_is_megatron_lms(monkeypatch):
    """--logging-level, else MEGATRON_LOGGING_LEVEL, sets the root logger's
    level (megatron-core's loggers follow it); a variable that is no number
    is refused before anything starts."""
    from megatron.training.initialize import logging_level

    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
    assert logging_level(parse_args(argv(), world_size=1)) == 30
    assert logging_level(parse_args(argv("--logging-level", "40"), world_size=1)) == 40
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
    _names_all(_config_error(argv()), "MEGATRON_LOGGING_LEVEL=loud")
    assert logging_level(parse_args(argv("--logging-level", "10"), world_size=1)) == 10
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL")
    assert logging_level(parse_args(argv(), world_size=1)) is None


def test_virtual_pipeline_stages_follow_megatron_lms_rules():
    """Megatron-LM's derivation of the virtual stages and its checks, and
    megatron-core's microbatch rule checked before any process group."""
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    config = parse_args(argv(*pp2, "--num-layers-per-virtual-pipeline-stage", "1"), world_size=2)
    assert config.virtual_pipeline_model_parallel_size == 2 and config.model_chunks == 2
    assert config.parallel.overlap_p2p_comm  # Megatron-LM's default with virtual stages
    config = parse_args(argv(*pp2, "--num-virtual-stages-per-pipeline-rank", "1"), world_size=2)
    assert config.virtual_pipeline_model_parallel_size is None and config.model_chunks == 1
    assert not config.parallel.overlap_p2p_comm  # off without virtual stages, as Megatron-LM
    both = ("--num-layers-per-virtual-pipeline-stage", "1")
    both += ("--num-virtual-stages-per-pipeline-rank", "2")
    _names_all(_config_error(argv(*pp2, *both), world_size=2), *both[::2])
    message = _config_error(
        argv(*pp2, "--num-layers-per-virtual-pipeline-stage", "3"), world_size=2
    )
    _names_all(message, "--num-layers-per-virtual-pipeline-stage")
    message = _config_error(argv(*pp2, "--num-virtual-stages-per-pipeline-rank", "4"), world_size=2)
    _names_all(message, "--num-virtual-stages-per-pipeline-rank", "--num-layers")
    message = _config_error(argv("--num-virtual-stages-per-pipeline-rank", "2"))
    _names_all(message, "--pipeline-model-parallel-size")
    no_overlap = [*pp2, "--num-virtual-stages-per-pipeline-rank", "2"]
    message = _config_error(argv(*no_overlap, "--no-overlap-p2p-communication"), world_size=2)
    _names_all(message, "--no-overlap-p2p-communication", "> 2")
    group = ["--microbatch-group-size-per-virtual-pipeline-stage", "2"]
    _names_all(_config_error(argv(*pp2, *group), world_size=2), group[0])
    # 8 samples of 2 over DP 2 and PP 2: 2 microbatches per replica run;
    # over DP 4 one each does not (fewer than a pipeline's worth).
    parse_args(argv(*no_overlap), world_size=4)
    message = _config_error(argv(*no_overlap), world_size=8)
    _names_all(message, "--global-batch-size", "1 microbatch(es) per replica")
    # 6 microbatches in groups of 4 leave a last group of 2: fine; of 1: not.
    six = argv(*no_overlap, "--global-batch-size", "12", "--num-layers", "8")
    parse_args(six + ["--microbatch-group-size-per-virtual-pipeline-stage", "4"], world_size=2)
    message = _config_error(
        six + ["--microbatch-group-size-per-virtual-pipeline-stage", "5"], world_size=2
    )
    _names_all(message, "last group of 1")
    # megatron-core's fully reshardable save of a tied embedding is fixed
    # here (test_determinism_and_resume.py): the interleaved schedule takes it.
    parse_args(argv(*no_overlap, "--dist-ckpt-optim-fully-reshardable"), world_size=2)


def test_a_pipeline_layout_is_read_and_checked_as_megatron_core_does():
    """Its stages beyond the pipeline size are virtual stages; a layout
    megatron-core refuses is refused here, before any process group, with
    the flag named; so is any other split given with it, and MTP layers on
    a rank before the last (only the first and last ranks read data)."""
    layout = "--pipeline-model-parallel-layout"
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    config = parse_args(argv(*pp2, layout, "Et|(tt|)*4tL", num_layers=10), world_size=2)
    assert config.virtual_pipeline_model_parallel_size == 3
    assert parse_args(argv(*pp2, layout, "Ettt|tL"), world_size=2).model_chunks == 1
    for bad, words in (
        ("Ettt|ttL", "Number of decoder layers 5"),  # --num-layers 4
        ("Ett|tt|L", "must be divisible by pipeline_model_parallel_size"),
        ("tEtt|tL", "The first layer must be embedding"),
        ("Ettx|tL", "Invalid layer character: x"),
    ):
        _names_all(_config_error(argv(*pp2, layout, bad), world_size=2), layout, words)
    message = _config_error(argv(*pp2, layout, "Ettt|tL", FIRST, "3"), world_size=2)
    _names_all(message, "drop --decoder-first-pipeline-num-layers")
    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    mtp += ["--untie-embeddings-and-output-weights"]
    pp3 = ["--pipeline-model-parallel-size", "3", "--global-batch-size", "6"]
    parse_args(argv(*pp3, *mtp, layout, "Ett|t|tmL"), world_size=3)
    message = _config_error(argv(*pp3, *mtp, layout, "Ett|ttm|L"), world_size=3)
    _names_all(message, "puts MTP layers (m) on a pipeline rank before the last")


FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING = "--account-for-embedding-in-pipeline-split"
LOSS = "--account-for-loss-in-pipeline-split"
VP = "--num-virtual-stages-per-pipeline-rank"
SPLITS = [
    # (pp, layers, extra flags, accepted)
    (4, 12, [FIRST, "2", LAST, "2"], True),
    (4, 12, [FIRST, "3"], True),
    (4, 12, [FIRST, "2"], False),  # 10 over 3 middle stages
    (2, 6, [FIRST, "2", LAST, "4"], True),
    (2, 6, [FIRST, "2", LAST, "3"], False),
    (4, 8, [FIRST, "0"], False),
    (4, 12, [FIRST, "2", LAST, "2", VP, "2"], True),
    (4, 12, [FIRST, "2", VP, "2"], False),
    (4, 12, [FIRST, "3", VP, "3"], True),
    (4, 12, [FIRST, "1", VP, "2"], False),
    (4, 6, [EMBEDDING, LOSS], True),
    (4, 6, [EMBEDDING], False),
    (4, 6, [EMBEDDING, LOSS, VP, "2"], True),
    (4, 7, [EMBEDDING, VP, "2"], True),
    (4, 10, [EMBEDDING, LOSS, VP, "2"], False),
    (4, 12, [LOSS, FIRST, "3"], False),
    (4, 6, [], False),
]


@pytest.mark.parametrize("pp,layers,flags,accepted", SPLITS)
def test_pipeline_splits_are_megatron_cores(pp, layers, flags, accepted):
    """Uneven pipeline stages and the embedding and loss counted as layers:
    what parses here is what megatron-core builds, and what it refuses is
    refused before any process group with the flags named."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    line = argv(
        *flags,
        "--pipeline-model-parallel-size",
        str(pp),
        "--global-batch-size",
        "8",
        num_layers=layers,
    )
    p = ["--pipeline-model-parallel-size", "--num-layers"]
    core = dict(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    given = dict(zip(flags, flags[1:] + [None]))

    def number(flag):
        return int(given[flag]) if flag in given else None

    def core_config():
        vp = number("--num-virtual-stages-per-pipeline-rank")
        return TransformerConfig(
            **core,
            virtual_pipeline_model_parallel_size=vp if vp != 1 else None,
            num_layers_in_first_pipeline_stage=number("--decoder-first-pipeline-num-layers"),
            num_layers_in_last_pipeline_stage=number("--decoder-last-pipeline-num-layers"),
            account_for_embedding_in_pipeline_split="--account-for-embedding-in-pipeline-split"
            in given,
            account_for_loss_in_pipeline_split="--account-for-loss-in-pipeline-split" in given,
        )

    if accepted:
        parse_args(line, world_size=pp)
        core_config()  # megatron-core agrees
        return
    if flags:  # megatron-core refuses it too (it does not check an even split itself)
        with pytest.raises(ValueError):
            core_config()
    message = _config_error(line, world_size=pp)
    named = [f for f in flags if f.startswith("--") and f.split("-")[2] in ("decoder", "account")]
    _names_all(message, *(named[:1] or p[:1]))


def test_a_deferral_limit_does_not_let_deferral_past_its_checks():
    """Given with its companion, --wgrad-deferral-limit is no reason to skip
    the companion's own rules: on a CPU the deferral is still refused."""
    flags = ["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2"]
    message = _config_error(argv(*flags, "--pipeline-model-parallel-size", "2"), world_size=2)
    _names_all(message, "--defer-embedding-wgrad-compute", "gradient-accumulation fusion")


def test_context_parallel_communication_without_te_is_said_to_gather(capsys):
    cp = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    parse_args(argv(*cp), world_size=2)
    _names_all(capsys.readouterr().out, "WARNING:", "--cp-comm-type", "gathered")


def test_partial_distributed_optimizers_follow_megatron_cores_rules():
    two = ["--num-distributed-optimizer-instances", "2"]
    _names_all(_config_error(argv(*two), world_size=2), two[0], "--use-distributed-optimizer")
    message = _config_error(argv(*two, "--use-distributed-optimizer"), world_size=3)
    _names_all(message, two[0], "does not divide the 3 data-parallel ranks")


def test_world_not_divisible_by_tp_times_pp():
    message = _config_error(argv("--tensor-model-parallel-size", "2"), world_size=3)
    _names_all(message, "--tensor-model-parallel-size", "--pipeline-model-parallel-size")
    message = _config_error(
        argv("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
        world_size=6,
    )
    _names_all(message, "--tensor-model-parallel-size", "--pipeline-model-parallel-size")


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    message = _config_error(argv("--global-batch-size", "6", micro_batch_size=2), world_size=2)
    _names_all(message, "--global-batch-size", "--micro-batch-size")
    # Divisible by the micro batch, not by micro batch x DP.
    message = _config_error(argv("--global-batch-size", "10", micro_batch_size=2), world_size=2)
    _names_all(message, "--global-batch-size", "--micro-batch-size")
    # The same with DP 1 is fine.
    assert (
        parse_args(
            argv("--global-batch-size", "10", micro_batch_size=2), world_size=1
        ).batch.global_batch_size
        == 10
    )


def test_heads_not_divisible_by_tp():
    message = _config_error(
        argv("--tensor-model-parallel-size", "3", hidden_size=96, num_attention_heads=4),
        world_size=3,
    )
    _names_all(message, "--num-attention-heads", "--tensor-model-parallel-size")


def test_layers_not_divisible_by_pp():
    message = _config_error(argv("--pipeline-model-parallel-size", "3", num_layers=4), world_size=3)
    _names_all(message, "--num-layers", "--pipeline-model-parallel-size")


def test_no_data():
    message = _config_error(argv(drop=("--mock-data",)))
    _names_all(message, "--data-path", "--mock-data")


def test_data_path_without_files(tmp_path):
    prefix = str(tmp_path / "missing_text_document")
    message = _config_error(argv("--data-path", prefix, drop=("--mock-data",)))
    _names_all(message, "--data-path", prefix)


def test_data_path_with_only_bin(tmp_path, tiny_prefix):
    prefix = str(tmp_path / "half")
    with open(tiny_prefix + ".bin", "rb") as src, open(prefix + ".bin", "wb") as dst:
        dst.write(src.read())
    message = _config_error(argv("--data-path", prefix, drop=("--mock-data",)))
    _names_all(message, "--data-path", prefix + ".idx")


def test_blended_data_path_checks_every_prefix(tmp_path, tiny_prefix):
    missing = str(tmp_path / "other")
    message = _config_error(
        argv(
            "--data-path",
            "0.5",
            tiny_prefix,
            "0.5",
            missing,
            "--split",
            "1,1,1",
            drop=("--mock-data",),
        )
    )
    _names_all(message, "--data-path", missing)


def test_a_megatron_lm_tokenizer_type_refused_here_says_why():
    message = _config_error(argv("--tokenizer-type", "BertWordPieceCase"))
    _names_all(message, "--tokenizer-type", "BertWordPieceCase", "pretrain_gpt.py trains GPT")


def test_null_tokenizer_without_vocab_size():
    message = _config_error(argv("--tokenizer-type", "NullTokenizer"))
    _names_all(message, "--vocab-size")


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


def test_both_train_iters_and_train_samples():
    message = _config_error(argv("--train-samples", "100"))
    _names_all(message, "--train-iters", "--train-samples")


def test_neither_train_iters_nor_train_samples():
    message = _config_error(argv(drop=("--train-iters",)))
    _names_all(message, "--train-iters", "--train-samples")


def test_bf16_with_fp16():
    _names_all(_config_error(argv("--bf16", "--fp16")), "--bf16", "--fp16")


def test_sequence_parallel_without_tp_is_turned_off_with_a_warning(capsys):
    """As Megatron-LM (its LLaMA-3 example passes it at TP 1)."""
    assert parse_args(argv("--sequence-parallel"), world_size=2).parallel.sequence_parallel is False
    assert "disabling --sequence-parallel" in capsys.readouterr().out


def test_sequence_parallel_needs_the_norm_layers_of_te_or_apex(monkeypatch):
    """torch's LayerNorm and RMSNorm (megatron-core's local layers on CPU)
    refuse sequence parallelism when the model is built: said at start-up."""
    args = argv("--sequence-parallel", "--tensor-model-parallel-size", "2")
    _names_all(_config_error(args, world_size=2), "--sequence-parallel", "Apex")
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.setattr(host, "importable", lambda name: name == "apex")
    assert parse_args(args, world_size=2).parallel.sequence_parallel is True


def test_overlap_param_gather_without_distributed_optimizer():
    message = _config_error(argv("--overlap-param-gather", "--overlap-grad-reduce"))
    _names_all(message, "--overlap-param-gather", "--use-distributed-optimizer")


def test_overlapping_the_all_gather_with_the_step_takes_megatron_lms_rules():
    flag = "--overlap-param-gather-with-optimizer-step"
    ready = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage"]
    interleaved += ["1", "--num-layers", "4", "--global-batch-size", "8"]
    torch_format = ["--ckpt-format", "torch"]
    config = parse_args(argv(flag, *ready, *interleaved, *torch_format), world_size=4)
    assert config.parallel.overlap_param_gather_with_optimizer_step
    for dropped, says in [
        ("--overlap-param-gather", "--overlap-param-gather"),
        ("--num-layers-per-virtual-pipeline-stage", "interleaved"),
        ("--ckpt-format", "torch_dist"),
    ]:
        args = [flag, *ready, *interleaved, *torch_format]
        cut = args.index(dropped)
        args = args[:cut] + args[cut + (1 if dropped.startswith("--overlap") else 2) :]
        _names_all(_config_error(argv(*args), world_size=4), flag, says)


def test_hidden_not_divisible_by_heads():
    message = _config_error(argv(hidden_size=66, num_attention_heads=4))
    _names_all(message, "--hidden-size", "--num-attention-heads")
    # --kv-channels makes the shape explicit, so it is allowed.
    config = parse_args(
        argv("--kv-channels", "16", hidden_size=66, num_attention_heads=4), world_size=1
    )
    assert config.model.kv_channels == 16


def test_seq_length_longer_than_position_embeddings():
    message = _config_error(argv("--max-position-embeddings", "32", seq_length=64))
    _names_all(message, "--seq-length", "--max-position-embeddings")
    # Rotary embeddings have no table, so the limit does not apply.
    parse_args(
        argv("--max-position-embeddings", "32", "--position-embedding-type", "rope", seq_length=64),
        world_size=1,
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["--lr-warmup-iters", "10"],  # == train_iters
        ["--lr-warmup-iters", "50"],
        ["--lr-warmup-iters", "8", "--lr-decay-iters", "5"],
    ],
)
def test_warmup_not_shorter_than_decay(extra):
    message = _config_error(argv(*extra, train_iters=10))
    _names_all(message, "--lr-warmup-iters", "--lr-decay-iters")


def test_warmup_fraction_not_below_one_names_the_fraction():
    message = _config_error(argv("--lr-warmup-fraction", "1.0"))
    _names_all(message, "--lr-warmup-fraction")


def test_split_leaving_valid_split_without_document(tiny_prefix):
    args = argv("--data-path", tiny_prefix, "--split", "98,1,1", drop=("--mock-data",))
    # 3 documents: the valid share (1%) rounds to no document, and validation runs.
    message = _config_error(args)
    _names_all(message, "--split", "--eval-iters", "valid")
    # Without validation the valid split is never built: the same split is fine.
    config = parse_args(args + ["--eval-iters", "0"], world_size=1)
    assert config.data.data_path == [tiny_prefix]
    # A split that gives every used split a document is fine too.
    parse_args(
        argv("--data-path", tiny_prefix, "--split", "1,1,1", drop=("--mock-data",)), world_size=1
    )


def test_split_leaving_train_split_without_document(tiny_prefix):
    message = _config_error(
        argv("--data-path", tiny_prefix, "--split", "1,98,1", drop=("--mock-data",))
    )
    _names_all(message, "--split", "train")


def test_attention_backends_that_cannot_run_on_a_cpu_are_refused(monkeypatch):
    """Without Transformer Engine the backends are torch's SDPA kernels
    (megatron/training/attention.py): fused has none on a CPU, and the CPU
    flash kernel has no dropout."""
    monkeypatch.setattr(host, "cuda_available", lambda: False)
    message = _config_error(argv("--attention-backend", "fused"))
    _names_all(message, "--attention-backend fused", "needs a GPU", "unfused")
    message = _config_error(argv("--attention-backend", "flash"))
    _names_all(message, "--attention-backend flash", "--attention-dropout 0")
    for accepted in (["flash", "--attention-dropout", "0"], ["unfused"], ["local"], ["auto"]):
        parse_args(argv("--attention-backend", *accepted), world_size=1)


def test_attention_backends_on_a_gpu_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.setattr(host, "importable", lambda module: False)
    for backend in ("auto", "flash", "fused", "unfused", "local"):
        parse_args(argv("--attention-backend", backend), world_size=1)
    message = _config_error(argv("--attention-backend", "flash", "--reset-attention-mask"))
    _names_all(message, "--attention-backend flash", "--reset-attention-mask")


def test_local_attention_is_refused_with_transformer_engines_layers(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.setattr(host, "importable", lambda module: module == "transformer_engine")
    message = _config_error(argv("--attention-backend", "local"))
    _names_all(message, "--attention-backend local", "--transformer-impl local")


def test_no_position_embedding_goes_with_rope_only():
    _names_all(_config_error(argv("--no-position-embedding")), "--position-embedding-type rope")


@pytest.mark.parametrize(
    "eval_iters, split, drawn",
    [(0, "969,30,1", [(0, 0.969), None, None]), (2, "'99,1,0'", [(0, 0.99), (0.99, 1.0), None])],
)
def test_each_split_owns_megatron_lms_documents_and_unused_ones_are_not_built(
    eval_iters, split, drawn, tmp_path
):
    """--split's boundaries are Megatron-LM's whether a split is drawn from
    or not (zeroing an unused weight would move the train split's end: 969/999
    of the documents instead of 969/1000), and a split nothing is drawn from
    (test here; valid with --eval-iters 0) is not built."""
    from megatron.training import data
    from megatron.training.tokenizer import build_tokenizer

    prefix = _write_dataset(tmp_path, [f"document {i}" for i in range(200)])
    extra = ("--eval-iters", str(eval_iters), "--split", split, "--data-path", prefix)
    config = parse_args(argv(*extra, drop=("--mock-data",)), world_size=1)
    matrix = data.gpt_dataset_config(config, build_tokenizer(config.tokenizer)).split_matrix
    assert [b if b is None else tuple(round(x, 9) for x in b) for b in matrix] == drawn


def test_samples_drawn_from_each_split_are_megatron_lms():
    """Train: the run; valid: --eval-iters batches per validation, one more
    at the end; test: --eval-iters batches once, after training."""
    from megatron.training.data import dataset_sizes

    args = ["--train-iters", "10", "--eval-interval", "4", "--eval-iters", "3"]
    config = parse_args(argv(*args, "--global-batch-size", "2"), world_size=1)
    assert dataset_sizes(config) == [20, (10 // 4 + 1) * 3 * 2, 3 * 2]


class _RunsCode:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize("where", ["default", "--data-cache-path"])
def test_a_planted_file_in_the_dataset_index_cache_is_refused_before_loading(where, tmp_path):
    """megatron-core loads its index cache with allow_pickle=True: a pickle
    (or an object array) under an index file's name would run code in every
    rank (../shared/reliability-probes/npy_pickle.py)."""
    import pickle

    import numpy

    prefix = _write_dataset(tmp_path, [f"document {i}" for i in range(30)])
    args = argv("--data-path", prefix, "--split", "1,1,1", drop=("--mock-data",))
    cache = os.path.join(prefix, "cache", "GPTDataset_indices")
    if where != "default":
        cache = str(tmp_path / "cache")
        args += ["--data-cache-path", cache]
    os.makedirs(cache)
    numpy.save(os.path.join(cache, "abc-document_index.npy"), numpy.arange(5))
    parse_args(args, world_size=1)  # a plain array is what megatron-core writes
    planted = os.path.join(cache, "abc-shuffle_index.npy")
    with open(planted, "wb") as f:
        pickle.dump(_RunsCode(), f)
    _names_all(_config_error(args), planted, "not a plain numpy array")
    numpy.save(planted, numpy.array([_RunsCode()], dtype=object), allow_pickle=True)
    _names_all(_config_error(args), planted)


def test_dynamic_loss_scaling_turns_the_nan_check_off_as_megatron_lm(capsys):
    assert parse_args(argv(), world_size=1).training.check_for_nan_in_loss_and_grad
    assert not parse_args(argv("--fp16"), world_size=1).training.check_for_nan_in_loss_and_grad
    assert "dynamic loss scaling" in capsys.readouterr().out
    static = parse_args(argv("--fp16", "--loss-scale", "1024"), world_size=1)
    assert static.training.check_for_nan_in_loss_and_grad


def test_moe_with_the_tp_pp_dp_order_is_refused_where_megatron_core_would_stop():
    """EP 2 over PP 2 on 8 ranks with --use-tp-pp-dp-mapping: megatron-core's
    assertion at group creation, said here before any group exists."""
    moe = argv(
        *("--num-experts", "4", "--expert-model-parallel-size", "2"),
        *("--pipeline-model-parallel-size", "2", "--disable-bias-linear"),
    )
    message = _config_error(moe + ["--use-tp-pp-dp-mapping"], world_size=8)
    _names_all(message, "--use-tp-pp-dp-mapping", "--expert-model-parallel-size")
    parse_args(moe, world_size=8)  # Megatron's default order takes it


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


def test_the_deprecated_rotary_flag_selects_rope(capsys):
    config = parse_args(argv("--use-rotary-position-embeddings"), world_size=1)
    assert config.model.position_embedding_type == "rope"
    _names_all(capsys.readouterr().out, "WARNING:", "--position-embedding-type rope")


def test_deterministic_mode_refuses_what_megatron_lm_refuses(monkeypatch):
    _names_all(
        _config_error(argv("--deterministic-mode", "--cross-entropy-loss-fusion")),
        "--cross-entropy-loss-fusion",
    )
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    _names_all(_config_error(argv("--deterministic-mode")), "NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert parse_args(argv("--deterministic-mode"), world_size=1).training.deterministic_mode


def test_the_schedules_source_is_one_or_the_other():
    both = argv("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler")
    _names_all(_config_error(both), "--override-opt_param-scheduler")
