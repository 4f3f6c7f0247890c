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
    "--cuda-graph-impl",
    "--cuda-graph-scope",
    "--overlap-moe-expert-parallel-comm",
    "--fine-grained-activation-offloading",
    "--offload-modules",
    "--tp-comm-overlap",
]


def test_megatron_lms_configs_name_flags_this_build_takes():
    configs = load()
    unknown = unknown_by_config(configs, known_flags())
    assert len(configs) == 171
    assert sum(not flags for flags in unknown.values()) >= 155
    still = {flag for flags in unknown.values() for flag in flags}
    assert not still & set(ONCE_UNKNOWN)
    # Control: a flag this build lacks is counted.
    config = {"args": {"--no-such-flag": 1, "--num-layers": 2}, "env": {}}
    assert unknown_by_config({"x": config}, known_flags()) == {"x": ["--no-such-flag"]}


# Why this build refuses the configs it knows every flag of: what
# Megatron-LM refuses too (a release config's retention interval, its own
# check), or fails at (a file that is not in its tree at that tag, which
# it opens when it sets up the userbuffers).
REFUSALS = (
    "must be a multiple of --save-interval",
    "gpt3_345m_weekly_dgx_b200_1N8G_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap"
    "/tp_comm_overlap_cfg.yaml: no such file",
    "gpt3_345m_weekly_dgx_h100_1N8G_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap"
    "/tp_comm_overlap_cfg.yaml: no such file",
)


def test_megatron_lms_configs_parse_as_on_a_gpu_node(corpus_prefix, tmp_path):
    """Each config with its paths pointed at local data (make data's
    tokenizers, a corpus of GPT-2 ids), parsed as on Megatron-LM's CI node
    (8 GPUs, Transformer Engine, its environment), and its megatron-core
    configuration built on this CPU."""
    from tools.upstream_configs import parse_all, parse_on_this_host

    data, configs = os.path.dirname(corpus_prefix), load()
    outcome = parse_all(configs, data, str(tmp_path))
    parsed = [case for case, o in outcome.items() if o == "parses"]
    assert len(parsed) >= 150
    refused = [o for o in outcome.values() if o != "parses" and not o.startswith("unknown")]
    assert all(any(r in o for r in REFUSALS) for o in refused), refused
    # On this CPU each of them is refused, by what of it needs a GPU.
    here = parse_on_this_host(configs, parsed, data, str(tmp_path))
    assert all(any(r in o for r in NEEDS_A_GPU) for o in here.values()), here
    # Control: one of them without those three flags parses here.
    case = "gpt/gpt3_mcore_te_tp1_pp2_rope_embeddings"
    args = {f: v for f, v in configs[case]["args"].items() if not any(n in f for n in NEEDS)}
    cpu = {case: {"args": args, "env": {}}}
    assert parse_on_this_host(cpu, [case], data, str(tmp_path)) == {case: "parses"}


# Why this CPU refuses Megatron-LM's configs that parse on a GPU node: what
# of each needs a GPU (the first such flag is named).
NEEDS_A_GPU = (
    "--transformer-impl transformer_engine needs the transformer_engine package",
    "--log-memory-to-tensorboard reads the CUDA allocator's statistics",
    "--sequence-parallel needs Transformer Engine's or Apex's norm layers",
)
NEEDS = [reason.split()[0] for reason in NEEDS_A_GPU]
