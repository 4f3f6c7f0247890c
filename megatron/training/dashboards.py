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
import time
from typing import Dict, Optional, Tuple

from megatron.training.config import Config

WANDB_HOST = "api.wandb.ai"
SAMPLES_RUN = "vs-samples"  # the subdirectory of the '... vs samples' series
EVENT_FILE = "events.out.tfevents."  # then the second it was made in


class Dashboards:
    """The writers of one process: none unless it is the last rank and a
    dashboard was asked for. They open at the first write (a warm spare
    that never takes the last rank writes nothing), and a write that fails
    (a full disk) stops nothing: it is reported and the next write opens
    them again."""

    def __init__(self, config: Config, writes: bool, resumed_at: Tuple[int, int]) -> None:
        """resumed_at: (iteration, consumed samples) training goes on from."""
        log = config.logging
        self.config = config
        self.log_dir = log.tensorboard_dir if writes else None
        self.wants_wandb = bool(writes and log.wandb_project)
        self.tensorboard = self.by_samples = self.wandb = None
        self.purge_after: Optional[Tuple[int, int]] = resumed_at
        self.failed = False

    @property
    def active(self) -> bool:
        return bool(self.log_dir) or self.wants_wandb

    def rewind(self, iteration: int, samples: int) -> None:
        """Iterations after ``iteration`` (``samples`` consumed) are redone:
        TensorBoard forgets them when it opens again."""
        if self.tensorboard is not None and self.opened_at == (iteration, samples):
            return
        self.close_tensorboard()
        self.purge_after = (iteration, samples)

    def open_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard reads a directory's event files in the order of their
        # names, which begin with the second they were made in: a file from
        # the same second as another writer's could be read before it, and its
        # purge would miss what that one holds.
        wait_for_a_later_second_than(self.log_dir)
        iteration, samples = self.purge_after or (0, 0)

        def writer(directory, step):
            purge = step + 1 if step else None  # what comes after is written again
            return SummaryWriter(
                directory, max_queue=self.config.logging.tensorboard_queue_size, purge_step=purge
            )

        self.opened_at, self.purge_after = (iteration, samples), None
        self.tensorboard = writer(self.log_dir, iteration)
        self.by_samples = writer(os.path.join(self.log_dir, SAMPLES_RUN), samples)

    def close_tensorboard(self) -> None:
        writers, self.tensorboard, self.by_samples = (self.tensorboard, self.by_samples), None, None
        for writer in writers:
            if writer is not None:
                try:
                    writer.close()
                except OSError:
                    pass  # what it could not write is lost; reported already

    def scalars(self, values: Dict[str, float], iteration: int, samples: Optional[int]) -> None:
        """Each value at ``iteration``, and against ``samples`` when given."""

        def write():
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, iteration)
                if samples is not None:
                    self.by_samples.add_scalar(f"{name} vs samples", value, samples)

        self.write_tensorboard(write)
        if self.wants_wandb:
            self.open_wandb().log(dict(values), step=iteration)

    def text(self, tag: str, text: str, iteration: int) -> None:
        self.write_tensorboard(lambda: self.tensorboard.add_text(tag, text, iteration))
        if self.wants_wandb:
            self.open_wandb().log({tag: text}, step=iteration)

    def write_tensorboard(self, write) -> None:
        """``write()`` with the writers open; once more with new writers when
        it fails (the error may be an earlier one of the writer's thread)."""
        if not self.log_dir:
            return
        for _ in range(2):
            try:
                if self.tensorboard is None:
                    self.open_tensorboard()
                write()
                self.failed = False
                return
            except OSError as error:  # its writer thread's error comes back here too
                if not self.failed:
                    print(
                        f"WARNING: TensorBoard cannot write to {self.log_dir} ({error!r}): "
                        "what it could not write is lost; training goes on",
                        flush=True,
                    )
                self.failed = True
                self.close_tensorboard()

    def open_wandb(self):
        if self.wandb is None:
            self.wandb = open_wandb(self.config)
        return self.wandb

    def close(self) -> None:
        self.close_tensorboard()
        if self.wandb is not None:
            self.wandb.finish()
        self.wandb = None


def wait_for_a_later_second_than(log_dir: str) -> None:
    """Until the clock's second is past that of every event file already in
    ``log_dir`` and its runs (at most a second, after a writer opened in this
    one)."""
    newest = -1
    for _, _, names in os.walk(log_dir):
        for name in names:
            if name.startswith(EVENT_FILE):
                newest = max(newest, int(name[len(EVENT_FILE) :].split(".")[0]))
    while int(time.time()) <= newest:
        time.sleep(0.02)


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
