"""pretrain_gpt.py's flags against Megatron-LM's at the tag matching our
megatron-core (core_v0.16.1: docs/data/megatron-lm-core_v0.16.1-flags.json, its
parser's every option with dest and default), written to
docs/megatron-lm-flags.md; a test holds the file to what this prints, so any
drift shows in review.

Usage (from the repository root):

    python -m tools.flag_parity            # rewrite docs/megatron-lm-flags.md
    python -m tools.flag_parity --check    # exit 1 if it is out of date
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from megatron.training.missing_features import MISSING_FEATURES, missing_feature

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "megatron-lm-flags.md")

# Shared flags whose destination or default differs from Megatron-LM's, and why.
DIFFERENCES = {
    "--norm-epsilon": "stored as norm_epsilon (Megatron-LM: layernorm_epsilon); same value",
    "--disable-bias-linear": "stored as disable_bias_linear=True (Megatron-LM: "
    "add_bias_linear=False); same meaning",
    "--transformer-impl": "default auto: Transformer Engine where it is importable on a GPU, "
    "megatron-core's local layers otherwise (Megatron-LM: transformer_engine)",
    "--eval-interval": "default 1000 (Megatron-LM's parser: None)",
    "--split": "default 969,30,1, the value Megatron-LM fills in when --data-path is given",
    "--attention-backend": "default auto, as Megatron-LM (whose default is the AttnBackend "
    "enum); without Transformer Engine flash, fused and unfused are torch's SDPA kernels, and "
    "auto is SDPA on a GPU (Megatron-LM: TE's backends only)",
    "--no-position-embedding": "stored as position_embedding (Megatron-LM: "
    "add_position_embedding); deprecated in both, accepted with rope only",
    "--apply-layernorm-1p": "stored as apply_layernorm_1p (Megatron-LM: "
    "layernorm_zero_centered_gamma); same meaning",
    "--rerun-mode": "default None: validate_results, as Megatron-LM, except under --deadpool, "
    "whose --deadpool-on-nan takes its place (a value given then is said to have no effect)",
    "--use-mcore-models": "stored as use_mcore_models (Megatron-LM: deprecated_use_mcore_models); "
    "ignored in both: megatron-core's models are the only ones",
}


def our_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser, the --deadpool flags included."""
    from deadpool_ext.config import DeadpoolConfig
    from megatron.training.arguments import build_parser
    from megatron.training.config import SECTIONS

    return build_parser({**SECTIONS, "deadpool": DeadpoolConfig})


def options(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


# Shared flags with Megatron-LM's destination and default that act otherwise
# in some case, and how.
BEHAVIOUR = {
    "--num-distributed-optimizer-instances": "not with --deadpool yet (the mirror holds one "
    "distributed optimizer's shards)",
    "--overlap-param-gather-with-optimizer-step": "not with --deadpool yet (its two "
    "distributed optimizers' mirrors are untested)",
    "--defer-embedding-wgrad-compute": "GPU only: it needs gradient-accumulation fusion "
    "(Transformer Engine's layers or Apex's kernel), refused on a CPU",
    "--moe-permute-fusion": "GPU only: Transformer Engine's fused kernel, refused on a CPU",
    "--moe-router-fusion": "GPU only: Transformer Engine's fused kernel, refused on a CPU",
    "--moe-token-dispatcher-type": "flex is GPU only: DeepEP's or HybridEP's kernels (the "
    "deep_ep package), refused on a CPU and under --deadpool (its buffer holds the "
    "expert-parallel group a recovery replaces)",
    "--moe-enable-deepep": "GPU only (with --moe-token-dispatcher-type flex), deprecated as in "
    "Megatron-LM",
    "--moe-grouped-gemm": "GPU only: Transformer Engine's or the grouped_gemm package's "
    "kernel, refused on a CPU",
    "--mtp-num-layers": "with a pipeline, only with --untie-embeddings-and-output-weights "
    "(megatron-core 0.16 cannot save the tied weight on the MTP stage)",
    "--context-parallel-size": "not with --deadpool yet (a recovery rebuilds no context-parallel "
    "group); without Transformer Engine torch's SDPA gathers keys and values from the group",
    "--cp-comm-type": "Transformer Engine's; torch's SDPA (without TE) gathers keys and values "
    "whatever it says, and the parse warns",
    "--legacy-tokenizer": "no effect: with GPT2BPETokenizer megatron-core's tokenizer gives "
    "the legacy class's ids (measured on 703,152 tokens); with other types refused",
    "--ckpt-format": "torch is written too, in the foreground, without expert parallelism "
    "(Megatron-LM writes it with EP as well); --load tells the format from the files",
    "--no-rope-fusion": "without Transformer Engine the rotary embeddings are not fused "
    "(Megatron-LM stops there: megatron-core has no other kernel)",
    "--no-gradient-accumulation-fusion": "fused only with Transformer Engine's layers or "
    "Apex's kernel",
    "--use-checkpoint-opt_param-scheduler": "without it or --override-opt_param-scheduler a "
    "loaded checkpoint's schedule is taken (Megatron-LM asserts it equals the command line's)",
    "--use-persistent-ckpt-worker": "the background writer of --async-save is a thread of "
    "each rank (Megatron-LM: a worker process that lives as long as the job)",
    "--logging-level": "the training log keeps its own level (MEGATRON_LOG_LEVEL), as "
    "Megatron-LM's printed log does; megatron-core's loggers follow the flag",
    "--tp-comm-overlap": "GPU only: Transformer Engine's userbuffers, refused on a CPU and "
    "under --deadpool (no recovery shown with them)",
    "--overlap-moe-expert-parallel-comm": "GPU only: megatron-core's combined 1F1B schedule, "
    "refused on a CPU and under --deadpool (no recovery shown with it)",
    "--delay-wgrad-compute": "GPU only (with --overlap-moe-expert-parallel-comm)",
    "--fine-grained-activation-offloading": "GPU only: copies on CUDA streams, refused on a "
    "CPU and under --deadpool (no recovery shown with it)",
    "--cuda-graph-impl": "GPU only: transformer_engine, refused on a CPU and under --deadpool "
    "(a graph replays the communicators it captured); local (megatron-core's own) not here",
    "--cuda-graph-scope": "Transformer Engine's scopes only (full_iteration is local's)",
    "--external-cuda-graph": "GPU only (--cuda-graph-impl transformer_engine), deprecated as "
    "in Megatron-LM",
    "--te-rng-tracker": "GPU only: Transformer Engine's tracker, refused on a CPU",
    "--fim-data": "a sample's reordering is drawn from the seed and its index (Megatron-LM: "
    "from one generator in the order a rank reads, so it changes with the layout and on "
    "a restart), and empty segments stay empty; not with NullTokenizer, ByteLevelTokenizer "
    "or TikTokenizer",
}


def status(flag: str, upstream: dict, ours: Dict[str, argparse.Action]) -> str:
    if flag not in ours:
        feature = missing_feature(flag)
        return "not here" + (f": {feature.name} (below)" if feature else "")
    action = ours[flag]
    if flag in DIFFERENCES:
        return "differs: " + DIFFERENCES[flag]
    if flag in BEHAVIOUR:
        return "same name and default; here " + BEHAVIOUR[flag]
    if action.dest != upstream["dest"] or action.default != upstream["default"]:
        return f"differs (unexplained): dest {action.dest}, default {action.default!r}"
    return "same"


def report(upstream: Dict[str, dict], ours: Dict[str, argparse.Action]) -> str:
    rows = {flag: status(flag, spec, ours) for flag, spec in upstream.items()}
    shared = [f for f, s in rows.items() if not s.startswith("not here")]
    features = [f for f in rows if f not in shared and missing_feature(f)]
    lines = [
        "# pretrain_gpt.py's flags against Megatron-LM's (core_v0.16.1)",
        "",
        "Generated by `python -m tools.flag_parity` from Megatron-LM's parser at the tag that",
        "matches our megatron-core (`docs/data/megatron-lm-core_v0.16.1-flags.json`);",
        "`tests/unit_tests/test_flag_parity.py` fails when this file is out of date. A flag",
        'here parses with Megatron-LM\'s name; "same" means the same destination and',
        "default. Some shared flags are refused with the reason when given (for example",
        "`--log-memory-to-tensorboard` and `--apply-layernorm-1p` on CPU,",
        "`--context-parallel-size` under `--deadpool`):",
        "`python pretrain_gpt.py --help` and docs/megatron-lm.md say which.",
        "",
        f"Megatron-LM: {len(upstream)} options; here: {len(shared)} of them "
        f"({sum(s == 'same' for s in rows.values())} the same, "
        f"{sum(s.startswith('same name') for s in rows.values())} the same but acting "
        "otherwise in some case, "
        f"{sum(s.startswith('differs') for s in rows.values())} differing), "
        f"{len(upstream) - len(shared)} not here ({len(features)} of them select one of the "
        "features named below).",
        "",
        "| flag | Megatron-LM's default | here |",
        "|---|---|---|",
    ]
    for flag, spec in upstream.items():
        lines.append(f"| `{flag}` | `{spec['default']!r}` | {rows[flag]} |")
    lines += ["", "## Megatron-LM's features not here, and why", ""]
    lines += [f"- {feature.name}: {feature.why}." for feature in MISSING_FEATURES]
    lines += ["", "## Flags of ours, not in Megatron-LM", ""]
    lines += [f"- `{flag}`: {ours[flag].help}" for flag in sorted(set(ours) - set(upstream))]
    return "\n".join(lines) + "\n"


def load_upstream() -> Dict[str, dict]:
    from megatron.training.arguments import UPSTREAM_FLAGS

    with open(UPSTREAM_FLAGS) as f:
        return {k: v for k, v in json.load(f).items() if k not in ("-h", "--help")}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if the file is stale.")
    args = parser.parse_args(argv)
    text = report(load_upstream(), options(our_parser()))
    if args.check:
        with open(DOC) as f:
            stale = f.read() != text
        print(f"{DOC} is {'out of date' if stale else 'up to date'}")
        return int(stale)
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote {DOC}")
    return 0


def unexplained(upstream: Dict[str, dict], ours: Dict[str, argparse.Action]) -> List[str]:
    return [f for f, spec in upstream.items() if "unexplained" in status(f, spec, ours)]


if __name__ == "__main__":
    sys.exit(main())
