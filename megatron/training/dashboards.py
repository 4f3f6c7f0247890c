"""TensorBoard and Weights & Biases, written by the last rank as Megatron-LM
does, with Megatron-LM's scalar names ('lm loss', 'learning-rate', ...;
each also against samples).

Training here can go back: a recovery or a resumed checkpoint redoes the
iterations after its rollback point. TensorBoard is then opened again with
``purge_step`` there, so the dashboard holds each iteration once, the last
run's. A purge step applies to every tag of a log directory, so the
'... vs samples' series (steps counted in samples) are written to the
subdirectory ``vs-samples``, purged at the rollback's sample count.
W&B's steps only grow, so it keeps the values it has (a hot swap redoes no
logged iteration)."""

import hashlib
import os
from typing import Dict, Optional, Tuple

from megatron.training.config import Config

WANDB_HOST = "api.wandb.ai"
SAMPLES_RUN = "vs-samples"  # the subdirectory of the '... vs samples' series


class Dashboards:
    """The writers of one process: none unless it is the last rank and a
    dashboard was asked for."""

    def __init__(self, config: Config, writes: bool, resumed_at: Tuple[int, int]) -> None:
        """resumed_at: (iteration, consumed samples) training goes on from."""
        log = config.logging
        self.log_dir = log.tensorboard_dir if writes else None
        self.queue_size = log.tensorboard_queue_size
        self.tensorboard = self.by_samples = None
        self.wandb = None
        if self.log_dir:
            self.open_tensorboard(*resumed_at)
        if writes and log.wandb_project:
            self.wandb = open_wandb(config)

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def open_tensorboard(self, iteration: int, samples: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Events after the point training goes on from will be written again.
        def writer(directory, step):
            purge = step + 1 if step else None
            return SummaryWriter(directory, max_queue=self.queue_size, purge_step=purge)

        self.opened_at = (iteration, samples)
        self.tensorboard = writer(self.log_dir, iteration)
        self.by_samples = writer(os.path.join(self.log_dir, SAMPLES_RUN), samples)

    def rewind(self, iteration: int, samples: int) -> None:
        """Iterations after ``iteration`` (``samples`` consumed) are redone:
        TensorBoard forgets them."""
        if self.tensorboard is not None and self.opened_at != (iteration, samples):
            self.close_tensorboard()
            self.open_tensorboard(iteration, samples)

    def close_tensorboard(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.by_samples.close()
        self.tensorboard = self.by_samples = None

    def scalars(self, values: Dict[str, float], iteration: int, samples: Optional[int]) -> None:
        """Each value at ``iteration``, and against ``samples`` when given."""
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, iteration)
                if samples is not None:
                    self.by_samples.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log(dict(values), step=iteration)

    def text(self, tag: str, text: str, iteration: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_text(tag, text, iteration)
        if self.wandb is not None:
            self.wandb.log({tag: text}, step=iteration)

    def close(self) -> None:
        self.close_tensorboard()
        if self.wandb is not None:
            self.wandb.finish()
        self.wandb = None


def wandb_directory(config: Config) -> Optional[str]:
    """--wandb-save-dir, or SAVE/wandb as Megatron-LM."""
    log = config.logging
    if log.wandb_save_dir or not config.checkpoint.save:
        return log.wandb_save_dir
    return os.path.join(config.checkpoint.save, "wandb")


def wandb_mode() -> str:
    """WANDB_MODE when set; online with W&B credentials, offline without
    (a machine with no account or no network still keeps its runs, for
    `wandb sync`)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    logged_in = os.path.exists(netrc) and WANDB_HOST in open(netrc).read()
    return "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"


def open_wandb(config: Config):
    """One W&B run for the whole job: every process that becomes the last
    rank (a spare, or another one after a shrink) resumes the same id."""
    import wandb

    log = config.logging
    directory = wandb_directory(config)
    os.makedirs(directory, exist_ok=True)
    job = f"{log.wandb_project}/{log.wandb_exp_name}/{os.path.abspath(directory)}"
    return wandb.init(
        project=log.wandb_project,
        name=log.wandb_exp_name,
        entity=log.wandb_entity,
        dir=directory,
        id=hashlib.sha1(job.encode()).hexdigest()[:16],
        resume="allow",
        mode=wandb_mode(),
        config=flat_config(config),
    )


def flat_config(config: Config) -> dict:
    """The flags, as Megatron-LM gives W&B its args."""
    import dataclasses

    from megatron.training.config import SECTIONS

    flat = {}
    for name in SECTIONS:
        flat.update(dataclasses.asdict(getattr(config, name)))
    return flat
