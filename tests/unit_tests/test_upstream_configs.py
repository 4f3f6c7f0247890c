"""Megatron-LM's own training configs at core_v0.16.1 (extracted by
tools/upstream_configs.py into docs/data): how many name only flags that
pretrain_gpt.py takes. The count may grow, never fall."""

import os

from tools.upstream_configs import known_flags, load, unknown_by_config

# The 11 flags most of these configs pass that this build lacked at 0 of 171.
ONCE_UNKNOWN = [
    "--log-num-zeros-in-grad",
    "--log-params-norm",
    "--no-gradient-accumulation-fusion",
    "--deterministic-mode",
    "--attention-softmax-in-fp32",
    "--use-checkpoint-opt_param-scheduler",
    "--no-bias-gelu-fusion",
    "--no-rope-fusion",
    "--moe-router-dtype",
    "--apply-query-key-layer-scaling",
    "--qk-layernorm",
    "--overlap-param-gather-with-optimizer-step",
    "--multi-latent-attention",
    "--kv-lora-rank",
    "--q-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--fim-data",
    "--fim-rate",
    "--fim-spm-rate",
]


def test_megatron_lms_configs_name_flags_this_build_takes():
    configs = load()
    unknown = unknown_by_config(configs, known_flags())
    assert len(configs) == 171
    assert sum(not flags for flags in unknown.values()) >= 147
    still = {flag for flags in unknown.values() for flag in flags}
    assert not still & set(ONCE_UNKNOWN)
    # Control: a flag this build lacks is counted.
    config = {"args": {"--no-such-flag": 1, "--num-layers": 2}, "env": {}}
    assert unknown_by_config({"x": config}, known_flags()) == {"x": ["--no-such-flag"]}


# Why this build refuses the configs it knows every flag of: what
# Megatron-LM's own checks refuse too (a release config's retention
# interval, a test's batch on the 8 GPUs its recipe gives it).
REFUSALS = (
    "must be a multiple of --save-interval",
    "is not divisible by --micro-batch-size 2 x data-parallel size 8",
)


def test_megatron_lms_configs_parse_as_on_a_gpu_node(corpus_prefix, tmp_path):
    """Each config with its paths pointed at local data (make data's
    tokenizers, a corpus of GPT-2 ids), parsed as on Megatron-LM's CI node
    (8 GPUs, Transformer Engine, its environment), and its megatron-core
    configuration built on this CPU."""
    from tools.upstream_configs import parse_all

    outcome = parse_all(load(), os.path.dirname(corpus_prefix), str(tmp_path))
    assert sum(o == "parses" for o in outcome.values()) >= 143
    refused = [o for o in outcome.values() if o != "parses" and not o.startswith("unknown")]
    assert all(any(r in o for r in REFUSALS) for o in refused), refused
