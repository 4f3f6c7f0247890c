"""Megatron-LM's own training configs as the measure of the drop-in promise:
which of its CI and release configs that run pretrain_gpt.py (GPT, MoE and
Mixtral: tests/functional_tests/test_cases/{gpt,moe,mixtral}/*/model_config.yaml
at the tag of our megatron-core, inference and checkpoint-conversion cases
left out) name only flags that pretrain_gpt.py takes.

    python -m tools.upstream_configs --checkout PATH   # extract from a Megatron-LM clone
    python -m tools.upstream_configs                   # count from the extracted data

Extracting reads the configs from a clone of NVIDIA/Megatron-LM (a bare one
too: read with git at the tag) and writes each config's flags and values
to docs/data/megatron-lm-configs.json (flags and values are facts: the
counts are then held by a test without the clone). Counting prints how many
configs have no flag unknown here, and the unknown flags by how many
configs use them.
"""

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from megatron.training.missing_features import by_feature

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "docs", "data", "megatron-lm-configs.json")
TAG = "core_v0.16.1"
CASES = "tests/functional_tests/test_cases"
FAMILIES = ("gpt", "moe", "mixtral")  # the cases that run pretrain_gpt.py


def git(checkout: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", checkout, *args], capture_output=True, text=True, check=True
    ).stdout


def show(checkout: str, tag: str, path: str) -> Optional[str]:
    """A file of the checkout at ``tag``, or None where it has none there."""
    found = subprocess.run(["git", "-C", checkout, "cat-file", "-e", f"{tag}:{path}"])
    return git(checkout, "show", f"{tag}:{path}") if found.returncode == 0 else None


def extract(checkout: str, tag: str = TAG) -> Dict[str, Dict[str, dict]]:
    """Each training config's MODEL_ARGS and ENV_VARS ({"args", "env"}) by
    its case's path, and its GPUS_PER_NODE ("gpus") where it names one (its
    CI then runs it on one node of that many GPUs)."""
    import yaml

    found = {}
    for path in git(checkout, "ls-tree", "-r", "--name-only", tag, CASES).split():
        parts = path.split("/")
        if not path.endswith("model_config.yaml") or parts[3] not in FAMILIES:
            continue
        config = yaml.safe_load(git(checkout, "show", f"{tag}:{path}")) or {}
        args = config.get("MODEL_ARGS")
        if not args or "inference" in path or config.get("TEST_TYPE") == "ckpt-convert":
            continue
        env = {k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()}
        case = {"args": args, "env": env}
        gpus = ((config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get("GPUS_PER_NODE")
        if gpus is not None:
            case["gpus"] = int(gpus)
        files = {flag: args[flag] for flag in READ if flag in args}
        if files:  # as at the tag; one not there stays unread (a run fails to open it)
            case["files"] = {flag: show(checkout, tag, path) for flag, path in files.items()}
        found[os.path.dirname(path)[len(CASES) + 1 :]] = case
    return found


def known_flags() -> set:
    """pretrain_gpt.py's flags, the --deadpool ones included."""
    from deadpool_ext.config import DeadpoolConfig
    from megatron.training.arguments import build_parser
    from megatron.training.config import SECTIONS

    return set(build_parser({**SECTIONS, "deadpool": DeadpoolConfig})._option_string_actions)


def unknown_by_config(configs: Dict[str, Dict[str, dict]], known: set) -> Dict[str, List[str]]:
    return {
        case: [flag for flag in config["args"] if flag.startswith("--") and flag not in known]
        for case, config in configs.items()
    }


# Where a config's paths point here: the data and tokenizers of `make data`
# (or any folder laid out as it), and scratch folders for what a run writes.
TOKENIZER_FILES = {
    "--vocab-file": "tokenizers/gpt2/vocab.json",
    "--merge-file": "tokenizers/gpt2/merges.txt",
}
TOKENIZER_MODELS = {
    "GPTSentencePieceTokenizer": "tokenizers/sentencepiece.model",
    "SentencePieceTokenizer": "tokenizers/sentencepiece.model",
    "Llama2Tokenizer": "tokenizers/sentencepiece.model",
    "TikTokenizer": "tokenizers/tiktoken.json",
    "HuggingFaceTokenizer": "tokenizers/hf",
}
# Files in Megatron-LM's tree that configs name, kept with the extracted flags.
READ = ("--tp-comm-overlap-cfg",)
WRITTEN = ("--save", "--load", "--tensorboard-dir", "--data-cache-path", "--wandb-save-dir")


def synthetic_corpus(prefix: str, documents: int = 4000, vocab: int = 50257) -> str:
    """An indexed dataset of ``documents`` short documents of GPT-2 ids, as
    many as Megatron-LM's splits (949,50,1) need to give every split some:
    make data's corpus has 457 documents, whose 0.1% is none."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    rng = numpy.random.default_rng(0)
    for _ in range(documents):
        ids = rng.integers(0, vocab, size=int(rng.integers(64, 512)))
        builder.add_document(torch.IntTensor(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def command_line(
    args: Dict[str, object], data: str, scratch: str, files: Optional[Dict[str, str]] = None
) -> List[str]:
    """A config's flags as Megatron-LM's CI passes them (true: the flag,
    false: left out), its paths pointed at ``data`` (make data's folder, for
    its tokenizers) and ``scratch`` (what a run writes, a corpus of GPT-2
    ids: ``synthetic_corpus``, and the files of Megatron-LM's tree it names,
    ``files`` by flag)."""
    kind = args.get("--tokenizer-type", "GPT2BPETokenizer")
    argv = []
    for flag, value in args.items():
        if value is False or value is None:
            continue
        argv.append(flag)
        if value is True:
            continue
        if flag in TOKENIZER_FILES:
            argv.append(os.path.join(data, TOKENIZER_FILES[flag]))
        elif flag == "--tokenizer-model":
            argv.append(os.path.join(data, TOKENIZER_MODELS.get(kind, "tokenizers/hf")))
        elif flag == "--data-path":
            corpus = os.path.join(scratch, "corpus_text_document")
            argv += [corpus if "$" in v else v for v in str(value).split()]
        elif flag in WRITTEN:
            argv.append(os.path.join(scratch, flag.strip("-")))
        elif (files or {}).get(flag) is not None:
            path = os.path.join(scratch, os.path.basename(str(value)))
            with open(path, "w") as f:
                f.write(files[flag])
            argv.append(path)
        else:
            argv += ci_words(str(value))
    return argv


# The variables Megatron-LM's CI sets that configs name in values: the
# repetition of a test (the first here).
CI_VARIABLES = {"${REPEAT}": "1"}


def ci_words(value: str) -> List[str]:
    """A value as Megatron-LM's CI script passes it: a [list] without its
    brackets, word by word; its variables filled in."""
    for name, filled in CI_VARIABLES.items():
        value = value.replace(name, filled)
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    # Its two shell passes take off the backslashes before | ( ) (the
    # pipeline layouts': 'Et*3\\|\\(tt\\|\\)*6L' is passed as 'Et*3|(tt|)*6L').
    value = re.sub(r"\\+([|()])", r"\1", value)
    return value.split()


def world_size(args: Dict[str, object], gpus: Optional[int] = None) -> int:
    """The GPUs the config names (one node of them), else the fewest of
    Megatron-LM's CI nodes (8 GPUs each) that hold both the dense
    model-parallel grid (TP x CP x PP) and the experts' (expert TP x EP x PP)."""
    if gpus is not None:
        return gpus

    def size(flag: str, default: int = 1) -> int:
        return int(args.get(flag, default))

    tp, pp = size("--tensor-model-parallel-size"), size("--pipeline-model-parallel-size")
    dense = tp * size("--context-parallel-size") * pp
    experts = size("--expert-tensor-parallel-size", tp) * size("--expert-model-parallel-size") * pp
    return math.lcm(8, dense, experts)


def parse_on_a_gpu_node(argv: List[str], world: int, config_env: Dict[str, str]) -> Optional[str]:
    """None when the flags parse as on a GPU node of Megatron-LM's CI (CUDA,
    8 GPUs, Transformer Engine and Apex importable, the config's environment)
    and megatron-core takes the configuration a GPU run builds (without
    their kernels here), else why not."""
    from unittest import mock

    from deadpool_ext.config import parse_args
    from megatron.training.arguments import ConfigError
    from megatron.training.flags import host, megatron_core

    local, rank = min(world, 8), min(1, world - 1)
    env = dict(config_env, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local), RANK=str(rank))
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(host, "cuda_available", lambda: True),
        mock.patch.object(host, "gpu_count", lambda: 8),
        mock.patch.object(host, "importable", lambda module: True),
        # megatron-core's checks run below, on the configuration a GPU builds
        mock.patch.object(megatron_core, "check", lambda config: None),
    ):
        try:
            config = parse_args(argv, world_size=world)
        except ConfigError as error:
            return f"refused: {error}"
    import dataclasses
    import importlib.util

    from megatron.training import model_setup

    if importlib.util.find_spec("transformer_engine") is None:
        # Transformer Engine's own configuration needs its kernels to be
        # built: here, the one a GPU without it builds, with Apex's kernels
        # (importable on Megatron-LM's CI node, as above), without what
        # only Transformer Engine runs: FP8, its fused MoE kernels.
        config.model = dataclasses.replace(config.model, transformer_impl="local")
        config.moe = dataclasses.replace(
            config.moe, moe_permute_fusion=False, moe_router_fusion=False
        )
        config.training = dataclasses.replace(config.training, fp8=None, fp8_param_gather=False)
    try:
        with mock.patch.object(model_setup, "apex_gradient_fusion_built", lambda: True):
            model_setup.transformer_config(config, on_cpu=False)
    except (ValueError, AssertionError) as error:
        return f"megatron-core refuses its configuration: {error}"
    return None


def parse_all(configs: Dict[str, Dict[str, dict]], data: str, scratch: str) -> Dict[str, str]:
    """Each config's outcome: 'parses', 'unknown flags: ...' or the refusal."""
    known = known_flags()
    synthetic_corpus(os.path.join(scratch, "corpus_text_document"))
    outcome = {}
    for case, config in sorted(configs.items()):
        args = config["args"]
        unknown = [f for f in args if f.startswith("--") and f not in known]
        if unknown:
            outcome[case] = "unknown flags: " + why_unknown(unknown)
            continue
        argv = command_line(args, data, scratch, config.get("files"))
        outcome[case] = (
            parse_on_a_gpu_node(argv, world_size(args, config.get("gpus")), config["env"])
            or "parses"
        )
    return outcome


def parse_on_this_host(
    configs: Dict[str, Dict[str, dict]], cases: Sequence[str], data: str, scratch: str
) -> Dict[str, str]:
    """``cases`` parsed on this machine as it is (on a CPU, what needs a GPU
    is refused with its reason): 'parses' or the refusal. ``scratch`` holds
    parse_all's corpus."""
    from deadpool_ext.config import parse_args
    from megatron.training.arguments import ConfigError

    outcome = {}
    for case in cases:
        config = configs[case]
        argv = command_line(config["args"], data, scratch, config.get("files"))
        try:
            parse_args(argv, world_size=world_size(config["args"], config.get("gpus")))
            outcome[case] = "parses"
        except ConfigError as error:
            outcome[case] = f"refused: {error}"
    return outcome


def why_unknown(flags: List[str]) -> str:
    """Unknown flags grouped by the Megatron-LM feature they select."""
    return "; ".join(
        ", ".join(group) + (f" ({feature.name})" if feature else "")
        for feature, group in by_feature(flags).items()
    )


def report(unknown: Dict[str, List[str]], top: int = 20) -> str:
    """How many configs name only known flags; the others by the missing
    feature they need (docs/megatron-lm-flags.md says why each is not
    here), then the unknown flags by how many configs use them."""
    clean = sum(not flags for flags in unknown.values())
    needs = collections.Counter(
        feature.name if feature else "flags of no feature listed"
        for flags in unknown.values()
        for feature in by_feature(flags)
    )
    uses = collections.Counter(flag for flags in unknown.values() for flag in flags)
    lines = [f"{len(unknown)} configs; {clean} name no flag unknown here; the others need:"]
    lines += [f"  {count:3d} {name}" for name, count in needs.most_common()]
    lines += ["unknown flags by the configs that use them:"]
    lines += [f"  {count:3d} {flag}" for flag, count in uses.most_common(top)]
    return "\n".join(lines)


def load(path: str = DATA) -> Dict[str, Dict[str, object]]:
    with open(path) as f:
        return json.load(f)["configs"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", help="A clone of NVIDIA/Megatron-LM: extract its configs first.")
    p.add_argument("--tag", default=TAG, help=f"The tag to read (default {TAG}).")
    p.add_argument(
        "--parse",
        metavar="DATA",
        help="Also parse every config as on a GPU node, its paths in DATA (`make data`'s folder).",
    )
    opts = p.parse_args(argv)
    if opts.checkout:
        configs = extract(opts.checkout, opts.tag)
        os.makedirs(os.path.dirname(DATA), exist_ok=True)
        with open(DATA, "w") as f:
            json.dump({"tag": opts.tag, "configs": configs}, f, indent=1, sort_keys=True)
        print(f"wrote {len(configs)} configs to {DATA}")
    print(report(unknown_by_config(load(), known_flags())))
    if opts.parse:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            outcome = parse_all(load(), opts.parse, scratch)
            parsed = [case for case, o in outcome.items() if o == "parses"]
            here = parse_on_this_host(load(), parsed, opts.parse, scratch)
        print(
            f"{len(parsed)} of {len(outcome)} parse as on a GPU node and build their configuration"
        )
        for case, why in outcome.items():
            if why != "parses":
                print(f"  {case}: {why[:300]}")
        print(f"of those {len(parsed)}, on this machine:")
        reasons = collections.Counter(why[:160] for why in here.values())
        print("\n".join(f"  {count:3d} {why}" for why, count in reasons.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
