"""The table of Megatron-LM's features that are not here: each entry
selects flags Megatron-LM has, and none that pretrain_gpt.py takes (a
feature called missing that is here would send users away for nothing)."""

from megatron.training.missing_features import MISSING_FEATURES, by_feature, missing_feature
from tools.flag_parity import load_upstream, options, our_parser
from tools.upstream_configs import load

UPSTREAM = set(load_upstream())
# Flags in Megatron-LM's configs that plugins add to its parser (ModelOpt's).
CORPUS = {flag for config in load().values() for flag in config["args"]}


def test_no_flag_taken_here_is_called_missing():
    taken = [flag for flag in options(our_parser()) if missing_feature(flag)]
    assert taken == []


def test_each_feature_selects_flags_of_megatron_lms():
    for feature in MISSING_FEATURES:
        selected = [flag for flag in UPSTREAM | CORPUS if feature.selects(flag)]
        assert selected, feature.name
        assert set(feature.flags) <= UPSTREAM | CORPUS, feature.name


def test_flags_are_grouped_by_their_feature_in_order():
    groups = by_feature(["--use-torch-fsdp2", "--zzz", "--grpo-kl-beta", "--fsdp-double-buffer"])
    assert [(f.name if f else None, flags) for f, flags in groups.items()] == [
        (
            "fully sharded data parallelism (Megatron-FSDP, torch FSDP2)",
            ["--use-torch-fsdp2", "--fsdp-double-buffer"],
        ),
        (None, ["--zzz"]),
        ("reinforcement learning (GRPO)", ["--grpo-kl-beta"]),
    ]
