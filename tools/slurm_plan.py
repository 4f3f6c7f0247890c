"""Dry run of an sbatch script in examples/slurm/: the job's layout, without
a GPU and without Slurm.

    bash examples/slurm/llama_65b.sh --dry-run          # how users call it
    python -m tools.slurm_plan --nodes 128 --spare-nodes 2 --ranks-per-node 4 \\
        --hardware perlmutter-a100-40 --model llama-65b -- <pretrain_gpt.py flags>

It parses the training flags with pretrain_gpt.py's own parser and
validators (so the dry run fails where the job would, with the same
message), then prints which node hosts which (TP, PP, DP) ranks, which nodes
are warm spares, every rank's buddy (deadpool_ext/topology.py, the code the
job runs) and the memory plan of tools/planning/scale.py. ``--json``
prints the same as one JSON object, for tests. The layout itself is worked
out in tools/planning/slurm.py.
"""

import argparse
import contextlib
import json
import os
import sys
from typing import List, Tuple
from unittest import mock

from deadpool_ext import config as deadpool_config
from tools.planning import scale
from tools.planning.slurm import PlanError, describe, make_plan, to_json
from deadpool_ext.topology import BuddyMap
from megatron.training.arguments import ConfigError
from megatron.training.flags import host
from megatron.training.config import Config


def parse_training(
    argv: List[str], world_size: int, ranks_per_node: int, gpu: bool
) -> Tuple[Config, BuddyMap]:
    """pretrain_gpt.py's parser and validators, and the buddy map, for a world
    of ``world_size`` ranks, G per node. Whether *this* machine has CUDA, or
    Transformer Engine and Apex, does not matter (the job's nodes do: a GPU
    job installs setup.py's gpu extra), and asking would import torch, so
    the answers are given."""
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "DEADPOOL_RANKS_PER_NODE": str(ranks_per_node),
    }
    importable = host.importable

    def job_has(module: str) -> bool:
        return (gpu and module in GPU_EXTRAS) or importable(module)

    # What parsing says (its warnings) goes to stderr: stdout is the plan's.
    with (
        contextlib.redirect_stdout(sys.stderr),
        mock.patch.dict(os.environ, env),
        mock.patch.object(host, "cuda_available", lambda: gpu),
        mock.patch.object(host, "gpu_count", lambda: ranks_per_node if gpu else 0),
        mock.patch.object(host, "importable", job_has),
    ):
        try:
            config = deadpool_config.parse_args(argv)
            return config, deadpool_config.plan_buddies(config)
        except ConfigError as error:
            raise PlanError(str(error)) from None


GPU_EXTRAS = ("transformer_engine", "apex")  # setup.py's gpu extra


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--nodes", type=int, required=True, help="Active nodes.")
    p.add_argument("--spare-nodes", type=int, default=0, help="Warm spare nodes.")
    p.add_argument("--ranks-per-node", type=int, required=True, help="GPUs (ranks) per node.")
    p.add_argument(
        "--hardware",
        choices=sorted(scale.HARDWARE),
        help="Node type for the memory plan (none: a CPU run, no plan).",
    )
    p.add_argument(
        "--model", help="The planner's model (tools/planning/scale.py) the shape must equal."
    )
    p.add_argument("--script", help="The sbatch script, to check its #SBATCH header.")
    p.add_argument("--hosts", nargs="+", help="Node host names, in Slurm's order.")
    p.add_argument("--json", action="store_true", help="One JSON object instead of text.")
    p.add_argument(
        "training", nargs=argparse.REMAINDER, help="-- then the pretrain_gpt.py flags of the job."
    )
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    training = opts.training[1:] if opts.training[:1] == ["--"] else opts.training
    try:
        plan = make_plan(
            opts.nodes,
            opts.spare_nodes,
            opts.ranks_per_node,
            training,
            parse_training,
            opts.hardware,
            opts.model,
            opts.script,
            opts.hosts,
        )
    except PlanError as error:
        print(f"dry run: {opts.script or 'job'}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(plan)) if opts.json else describe(plan))
    return 0 if all(plan.checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
