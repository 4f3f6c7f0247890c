"""Megatron-LM's own training configs at core_v0.16.1 (extracted by
tools/upstream_configs.py into docs/data): how many name only flags that
pretrain_gpt.py takes. The count may grow, never fall."""

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
]


def test_megatron_lms_configs_name_flags_this_build_takes():
    configs = load()
    unknown = unknown_by_config(configs, known_flags())
    assert len(configs) == 171
    assert sum(not flags for flags in unknown.values()) >= 93
    still = {flag for flags in unknown.values() for flag in flags}
    assert not still & set(ONCE_UNKNOWN)
    # Control: a flag this build lacks is counted.
    assert unknown_by_config({"x": {"--no-such-flag": 1, "--num-layers": 2}}, known_flags()) == {
        "x": ["--no-such-flag"]
    }
