"""The checks of the model's shape and features
(megatron/training/flags/model.py), parsed in-process (a ConfigError whose
message names the flag to change, or a warning): divisibility, position
embeddings, attention backends, sequence parallelism's norm layers,
multi-token prediction, the activations and the wgrad deferral."""

import pytest

from megatron.training.flags import host
from megatron.training.arguments import ConfigError, parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, argv
from tests.unit_tests.training.flags.test_moe import BASE, _error
from tests.unit_tests.training.test_model_setup import gpu_config


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


def test_heads_not_divisible_by_tp():
    message = _config_error(
        argv("--tensor-model-parallel-size", "3", hidden_size=96, num_attention_heads=4),
        world_size=3,
    )
    _names_all(message, "--num-attention-heads", "--tensor-model-parallel-size")


def test_sequence_parallel_needs_the_norm_layers_of_te_or_apex(monkeypatch):
    """torch's LayerNorm and RMSNorm (megatron-core's local layers on CPU)
    refuse sequence parallelism when the model is built: said at start-up."""
    args = argv("--sequence-parallel", "--tensor-model-parallel-size", "2")
    _names_all(_config_error(args, world_size=2), "--sequence-parallel", "Apex")
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.setattr(host, "importable", lambda name: name == "apex")
    assert parse_args(args, world_size=2).parallel.sequence_parallel is True


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


def test_multi_token_prediction_is_refused_where_megatron_core_cannot_run_it():
    mtp = ["--mtp-num-layers", "1"]
    assert "needs --position-embedding-type rope" in _error(mtp, 1, BASE)
    rope = ["--position-embedding-type", "rope"]
    pipeline = ["--pipeline-model-parallel-size", "2"]
    assert "needs --untie-embeddings-and-output-weights" in _error(mtp + rope + pipeline, 2, BASE)
    untied = ["--untie-embeddings-and-output-weights"]
    parse_args(BASE + mtp + rope + pipeline + untied, world_size=2)
    parse_args(BASE + mtp + rope, world_size=1)  # one stage: tied is fine


def test_squared_relu_and_swiglu_are_one_activation_too_many():
    with pytest.raises(ConfigError, match="--squared-relu and --swiglu"):
        gpu_config(["--squared-relu", "--swiglu"], False)
