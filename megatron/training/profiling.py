"""--profile as Megatron-LM: a range of iterations profiled on the ranks of --profile-ranks.

Iterations --profile-step-start to --profile-step-end are profiled, by
torch.profiler with its traces in --tensorboard-dir (--use-pytorch-profiler)
or inside a CUDA profiler range that nsys records (a GPU)."""

from typing import Optional

import torch

from megatron.training.config import Config


class Profiler:
    def __init__(self, config: Config, rank: int):
        log = config.logging
        self.enabled = log.profile and rank in log.profile_ranks
        self.start, self.end = log.profile_step_start, log.profile_step_end
        self.torch_profiler = log.use_pytorch_profiler
        self.directory = log.tensorboard_dir
        self._running: Optional[object] = None  # torch's profiler, or nsys's NVTX context

    def begin(self) -> None:
        """Before the loop: torch's profiler starts waiting (its schedule
        skips to --profile-step-start), as Megatron-LM's does."""
        if not (self.enabled and self.torch_profiler):
            return
        self._running = torch.profiler.profile(
            schedule=torch.profiler.schedule(
                wait=max(self.start - 1, 0),
                warmup=1 if self.start > 0 else 0,
                active=self.end - self.start,
                repeat=1,
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.directory),
            record_shapes=True,
            with_stack=True,
        )
        self._running.start()

    def before_iteration(self, iteration: int) -> None:
        """``iteration``: the iterations done so far."""
        if not self.enabled:
            return
        if self.torch_profiler:
            if self._running is not None:
                self._running.step()
        elif iteration == self.start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self._running = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._running.__enter__()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and iteration == self.end:
            self.stop()

    def stop(self) -> None:
        """At --profile-step-end, or when training ends before it."""
        if self._running is None:
            return
        if self.torch_profiler:
            self._running.stop()
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self._running.__exit__(None, None, None)
        self._running = None
