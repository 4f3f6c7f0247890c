"""The real snapshot layout of any rank of any job, built in one process.

    python -m tools.layout_probe --world-size 8 --ranks 0 7 -- <pretrain_gpt.py model flags>
    python -m tools.layout_probe --groups --world-size 16384 --ranks 0 -- <flags>

For each asked rank this builds that rank's GPT stage, megatron-core's DDP
buffers and the distributed optimizer exactly as training would, against
PyTorch's fake process group (collectives are no-ops, so a whole world's
layout is computed without the world; this is how a warm spare builds
itself, see ``deadpool_ext/rank/recovery.py``), and reports what
``deadpool_ext.state.snapshot.build_layout`` makes of it: elements per state
region, snapshot bytes, and the parameter tensors in registration order.
``tools/planning/scale.py`` computes the same numbers from the shape alone; the
tests compare the two. Prints one JSON list.

The vocabulary is given as a size (``--vocab-size``, default 512 as the
byte-level tokenizer has) and padded like training pads it; no tokenizer or
data is read (``--mock-data`` is added when no data flag is given).

``--groups`` reports each asked rank's process groups instead (role and
member ranks) and how many groups it took part in creating: what a rebuild
of the groups costs at that size (docs/scale.md's recovery time model).
"""

import argparse
import contextlib
import json
from typing import List, Sequence


def _config(argv: Sequence[str], world_size: int):
    from deadpool_ext.config import parse_args

    argv = list(argv)
    if "--data-path" not in argv and "--mock-data" not in argv:
        argv.append("--mock-data")
    if "--tokenizer-type" not in argv:  # the probe's --vocab-size default is its 512 ids
        argv += ["--tokenizer-type", "ByteLevelTokenizer"]
    if "--use-distributed-optimizer" not in argv:
        argv.append("--use-distributed-optimizer")
    return parse_args(argv + ["--cpu"], world_size=world_size)


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    """A world whose collectives do nothing (a warm spare's), as ``rank``;
    megatron-core's groups and the default group are gone after it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from deadpool_ext.rank.generation import open_fake_world

    open_fake_world(rank, world_size)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def probe_rank(argv: Sequence[str], world_size: int, rank: int, vocab_size: int) -> dict:
    """Build ``rank``'s model and optimizer in a fake world; its layout."""
    import pretrain_gpt
    from deadpool_ext.state import snapshot as snap
    from megatron.training.initialize import initialize
    from megatron.training.model_setup import setup_model_and_optimizer
    from megatron.training.training import padded_vocab_size

    config = _config(argv, world_size)
    with _fake_world(rank, world_size):
        runtime = initialize(config)
        config.run.on_cpu = runtime.on_cpu
        config.run.padded_vocab_size = padded_vocab_size(vocab_size, config)
        state = setup_model_and_optimizer(config, pretrain_gpt.model_provider, runtime.on_cpu)
        layout = snap.build_layout(state.optimizer)
        params = [
            (name, p.numel())
            for chunk in state.model
            for name, p in chunk.named_parameters()
            if p.requires_grad
        ]
        return {
            "rank": rank,
            "tp_rank": runtime.tp_rank,
            "pp_rank": runtime.pp_rank,
            "dp_rank": runtime.dp_rank,
            "numel": layout.numel,
            "nbytes": layout.nbytes,
            "sidecar_capacity": layout.sidecar_capacity,
            "params": params,
            "padded_vocab_size": config.run.padded_vocab_size,
        }


def probe_groups(argv: Sequence[str], world_size: int, rank: int) -> dict:
    """The process groups megatron-core builds for ``rank`` (and the two
    pair groups the mirror adds, with ``--deadpool`` among the flags): each
    held group's role and member ranks, and how many groups the rank took
    part in creating (torch's count: every rank calls ``new_group`` for
    every group of the world). No model."""
    import torch.distributed as dist

    from deadpool_ext.config import plan_buddies, section
    from deadpool_ext.rank.generation import groups_created, open_training_groups
    from deadpool_ext.rank.regroup import groups_by_role

    config = _config(argv, world_size)
    buddies = plan_buddies(config) if section(config).deadpool else None
    with _fake_world(rank, world_size):
        mirror = open_training_groups(config, buddies)
        held: dict = {}
        for role, group in groups_by_role(mirror.roles()).items():
            held.setdefault(id(group), (role, dist.get_process_group_ranks(group)))
        return {
            "rank": rank,
            "world_size": world_size,
            "groups_created": groups_created(),
            "held": {role: ranks for role, ranks in held.values()},
        }


def probe(
    argv: Sequence[str], world_size: int, ranks: Sequence[int], vocab_size: int = 512
) -> List[dict]:
    return [probe_rank(argv, world_size, rank, vocab_size) for rank in ranks]


def in_subprocess(options: Sequence[str], flags: Sequence[str], timeout: float = 900) -> list:
    """This tool's JSON for ``options`` and model ``flags``, run in a
    subprocess, so that megatron-core's global state stays out of the caller."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "tools.layout_probe", *options, "--", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=repo, check=True, timeout=timeout
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--vocab-size", type=int, default=512, help="unpadded vocabulary (ByteLevelTokenizer: 512)"
    )
    parser.add_argument(
        "--groups", action="store_true", help="each rank's process groups instead (no model)"
    )
    opts, rest = parser.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if opts.groups:
        found = [probe_groups(rest, opts.world_size, rank) for rank in opts.ranks]
    else:
        found = probe(rest, opts.world_size, opts.ranks, opts.vocab_size)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
