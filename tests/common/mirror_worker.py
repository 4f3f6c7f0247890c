"""Run on forked ranks (forkrun.py) by test_mirror.py: pretrain_gpt.py's
training with --deadpool, plus two probes the user's entry point does not have.

  --dump-at T [T ...]  at the start of iteration T wait for the mirror, then
                       write this rank's live optimizer state and the snapshot
                       it holds for its owner to --dump-dir (rank files).
  --restore-at K       after iteration K, throw the model and optimizer away,
                       build fresh (perturbed) ones, and restore them as a
                       hot swap restores a new process (every rank lost):
                       from the copy its buddy holds; then finish.
  --corrupt-packet-at T R
                       (--deadpool-mirror-mode grad) rank R flips one bit of
                       the gradients it sends at the start of iteration T, as
                       a link or a replay gone wrong would.

Everything else is pretrain_gpt.py's flags.
"""

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402
from megatron.training.model_setup import setup_model_and_optimizer  # noqa: E402
from megatron.training.training import Hook, Trainer, build_trainer  # noqa: E402

from deadpool_ext.state import replay  # noqa: E402
from deadpool_ext.state import snapshot as snap  # noqa: E402
from deadpool_ext.config import parse_args  # noqa: E402
from deadpool_ext.rank.hooks import MirrorHook  # noqa: E402
from deadpool_ext.rank.restore import restore_from_mirror  # noqa: E402


class DumpHook(Hook):
    """After the mirror hook's snapshot at the start of chosen iterations."""

    def __init__(self, mirror_hook: MirrorHook, iterations, directory: str):
        self.mirror_hook, self.iterations, self.directory = mirror_hook, set(iterations), directory

    def before_step(self, trainer: Trainer) -> None:
        t = trainer.progress.iteration
        if t not in self.iterations:
            return
        mirror, layout = self.mirror_hook.mirror, self.mirror_hook.layout
        mirror.wait_idle()
        live = []
        for seg in layout.segments:
            main, state = snap.main_param_and_state(trainer.state.optimizer, seg)
            live.append(
                {
                    "offset": seg.offset,
                    "numel": seg.numel,
                    "param": main.detach().clone().view(-1),
                    **{
                        k: (v.clone().view(-1) if k != "step" else v.clone())
                        for k, v in state.items()
                    },
                }
            )
        torch.save(
            {
                "iteration": t,
                "numel": layout.numel,
                "sidecar_capacity": layout.sidecar_capacity,
                "live": live,
                "held": mirror.held[mirror.held_index].clone(),
            },
            os.path.join(self.directory, f"t{t}_rank{trainer.runtime.rank}.pt"),
        )


def restore_into_fresh_objects(trainer: Trainer, mirror_hook: MirrorHook) -> None:
    """Every rank as a hot swap's new process: fresh objects, restored from
    the copy its buddy holds (the recovery's own restore, every rank lost)."""
    mirror = mirror_hook.mirror
    mirror.wait_idle()
    mirror.halt()  # as a recovery's tear-down
    iteration = mirror.held_iteration()
    trainer.state = setup_model_and_optimizer(
        trainer.config, pretrain_gpt.model_provider, trainer.runtime.on_cpu
    )
    with torch.no_grad():  # make sure nothing of the old run survives by chance
        for chunk in trainer.state.model:
            for param in chunk.parameters():
                param.add_(0.5)
    # A new process builds its mirror for its new objects; this one follows them.
    layout = snap.build_layout(trainer.state.optimizer)
    assert (layout.numel, layout.nbytes) == (mirror.layout.numel, mirror.layout.nbytes)
    mirror.optimizer, mirror.layout, mirror_hook.layout = trainer.state.optimizer, layout, layout
    lost = range(trainer.runtime.world_size)
    assert restore_from_mirror(trainer, mirror, layout, lost, iteration) == "buddy"


def corrupt_packet(mirror_hook: MirrorHook, iteration: int, rank: int) -> None:
    mirror = mirror_hook.mirror

    def flip(t: int) -> None:
        if t == iteration and mirror.rank == rank:
            grads = replay.grad_region(mirror.packets[0], mirror.layout)
            grads.view(torch.int32)[grads.numel() // 3] ^= 1 << 3

    mirror.register_exchange_hook(flip)


def main() -> None:
    probe = argparse.ArgumentParser()
    probe.add_argument("--dump-at", type=int, nargs="*", default=[])
    probe.add_argument("--dump-dir")
    probe.add_argument("--restore-at", type=int)
    probe.add_argument("--corrupt-packet-at", type=int, nargs=2)
    opts, rest = probe.parse_known_args()
    config = parse_args(rest)
    mirror_hook = MirrorHook(config)
    hooks = [mirror_hook]
    if opts.dump_at:
        hooks.append(DumpHook(mirror_hook, opts.dump_at, opts.dump_dir))
    trainer = build_trainer(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step, hooks)
    trainer.setup()
    if opts.corrupt_packet_at:
        corrupt_packet(mirror_hook, *opts.corrupt_packet_at)
    if opts.restore_at is not None:
        trainer.loop(until=opts.restore_at)
        restore_into_fresh_objects(trainer, mirror_hook)
    trainer.loop()
    if config.checkpoint.save:
        trainer.save()
    trainer.finish()
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
