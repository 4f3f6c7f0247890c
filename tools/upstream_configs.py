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
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "docs", "data", "megatron-lm-configs.json")
TAG = "core_v0.16.1"
CASES = "tests/functional_tests/test_cases"
FAMILIES = ("gpt", "moe", "mixtral")  # the cases that run pretrain_gpt.py


def git(checkout: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", checkout, *args], capture_output=True, text=True, check=True
    ).stdout


def extract(checkout: str, tag: str = TAG) -> Dict[str, Dict[str, object]]:
    """Each training config's MODEL_ARGS by its case's path."""
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
        found[os.path.dirname(path)[len(CASES) + 1 :]] = args
    return found


def known_flags() -> set:
    """pretrain_gpt.py's flags, the --deadpool ones included."""
    from deadpool_ext.config import DeadpoolConfig
    from megatron.training.arguments import build_parser
    from megatron.training.config import SECTIONS

    return set(build_parser({**SECTIONS, "deadpool": DeadpoolConfig})._option_string_actions)


def unknown_by_config(configs: Dict[str, Dict[str, object]], known: set) -> Dict[str, List[str]]:
    return {
        case: [flag for flag in args if flag.startswith("--") and flag not in known]
        for case, args in configs.items()
    }


def report(unknown: Dict[str, List[str]], top: int = 20) -> str:
    clean = sum(not flags for flags in unknown.values())
    uses = collections.Counter(flag for flags in unknown.values() for flag in flags)
    lines = [f"{len(unknown)} configs; {clean} name no flag unknown here"]
    lines += [f"  {count:3d} {flag}" for flag, count in uses.most_common(top)]
    return "\n".join(lines)


def load(path: str = DATA) -> Dict[str, Dict[str, object]]:
    with open(path) as f:
        return json.load(f)["configs"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", help="A clone of NVIDIA/Megatron-LM: extract its configs first.")
    p.add_argument("--tag", default=TAG, help=f"The tag to read (default {TAG}).")
    opts = p.parse_args(argv)
    if opts.checkout:
        configs = extract(opts.checkout, opts.tag)
        os.makedirs(os.path.dirname(DATA), exist_ok=True)
        with open(DATA, "w") as f:
            json.dump({"tag": opts.tag, "configs": configs}, f, indent=1, sort_keys=True)
        print(f"wrote {len(configs)} configs to {DATA}")
    print(report(unknown_by_config(load(), known_flags())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
