"""Goodput of a long training run under failures, per recovery strategy.

    python -m tools.goodput --gpus 512 --days 30 --seeds 32

A discrete-event simulation of one job: failures arrive as a Poisson
process (rate per GPU from published traces, see ``LLAMA3``), and each
strategy pays its own price for them:

- checkpoint-restart: durable checkpoints every ``checkpoint_interval_s`` of
  compute, each blocking training for ``checkpoint_cost_s``; a failure loses
  the work since the last one and costs ``restart_s`` (a failure during the
  restart starts it again: Daly's model).
- in-process restart: the same rollback, a shorter restart (the processes
  live; groups are rebuilt and the checkpoint reloaded).
- hot swap (this project): each iteration's optimizer shard is on a buddy, so
  a failure loses only the interrupted iteration and costs ``swap_s``, while
  a warm spare node is free; a node out of repair returns to the spares
  after an exponential repair time. Without a spare the job falls back to
  checkpoint-restart (what deadpool-launch does today) or, with
  ``shrink_when_out``, goes on with DP-1 replicas at (DP-k)/DP throughput
  (after ReCoVer) and grows back when a repaired node returns. A second
  failure during a swap that hits the lost node's buddy or owner node
  (``pair_loss_probability``) loses the mirror: checkpoint-restart.

Effective training time ratio = useful work / wall time, where useful work
is wall time spent computing at full throughput that was never rolled back.
Every second of the horizon is accounted to exactly one of: useful work,
rework (computed, then rolled back), slowdown (mirror overhead, shrunk
throughput), checkpointing, recovery. Deterministic for a seed.
"""

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

HOUR, DAY = 3600.0, 86400.0

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4):
# 419 unexpected interruptions in a 54-day snapshot of pre-training on
# 16,384 H100 GPUs (47 more were planned maintenance).
LLAMA3 = {"interruptions": 419, "days": 54, "gpus": 16384}
FAILURES_PER_GPU_SECOND = LLAMA3["interruptions"] / (LLAMA3["days"] * DAY * LLAMA3["gpus"])


def job_mtbf_s(gpus: int, per_gpu_rate: float = FAILURES_PER_GPU_SECOND) -> float:
    """Mean time between failures of a job on ``gpus`` GPUs, in seconds."""
    return 1.0 / (gpus * per_gpu_rate)


# ----- closed forms -----
def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young 1974 (CACM 17(9)): the first-order optimum sqrt(2 C M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly 2006 (FGCS 22(3)): the higher-order optimum interval."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def daly_ratio(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected useful work / wall time under exponential failures (Daly
    2006's model): a segment of ``interval_s`` work plus its checkpoint takes
    M e^(R/M) (e^((tau + C)/M) - 1) wall seconds on average, failures during
    the checkpoint and the restart included."""
    m = mtbf_s
    wall = m * math.exp(restart_s / m) * math.expm1((interval_s + cost_s) / m)
    return interval_s / wall


def hot_swap_ratio(iteration_s: float, swap_s: float, mtbf_s: float) -> float:
    """Expected useful work / wall time of hot swap with a spare always
    free and no checkpoints. A cycle is compute until a failure (X ~ Exp),
    of which the whole iterations are kept, T / (e^(T/M) - 1) on average,
    then a swap that a failure during it starts again, M (e^(S/M) - 1): so
    the ratio is (T/M) e^(-S/M) / (e^(T/M) - 1)."""
    t, s = iteration_s / mtbf_s, swap_s / mtbf_s
    return t * math.exp(-s) / math.expm1(t)


def probability_no_spare(rate_per_s: float, repair_s: float, spares: int) -> float:
    """Share of failures that find every spare in repair: nodes in repair
    form an M/G/inf queue, Poisson with mean rate x repair time, and Poisson
    arrivals see time averages."""
    mean = rate_per_s * repair_s
    term, below = math.exp(-mean), 0.0
    for k in range(spares):
        below += term
        term *= mean / (k + 1)
    return max(0.0, 1.0 - below)


# ----- the failure process -----
def poisson_failures(rate_per_s: float, seed: int) -> Iterator[float]:
    """Failure times of a Poisson process, from its own generator so every
    strategy of a seed meets the same failures."""
    rng, t = random.Random(f"failures-{seed}"), 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        yield t


@dataclass(frozen=True)
class Strategy:
    """How a job checkpoints and recovers; times in seconds."""

    name: str
    checkpoint_interval_s: float = math.inf  # compute between durable checkpoints
    checkpoint_cost_s: float = 0.0  # training blocked per durable checkpoint
    restart_s: float = 0.0  # failure -> training, from the durable checkpoint
    hot_swap: bool = False  # roll back one iteration instead, with a spare
    iteration_s: float = 1.0  # failure-free iteration (rollback granularity)
    mirror_overhead: float = 0.0  # share added to each iteration by the mirror
    swap_s: float = 0.0  # failure -> first iteration after a hot swap
    spares: Optional[int] = None  # warm spare nodes; None: never short of one
    repair_mean_s: float = math.inf  # a failed node's time until it is a spare again
    shrink_when_out: bool = False  # no spare: shrink instead of restarting
    shrink_s: float = 0.0  # failure -> training on the survivors
    regrow_s: float = 0.0  # pause to take a repaired node back in
    dp: int = 1  # data-parallel replicas (shrunk throughput)
    pair_loss_probability: float = 0.0  # a failure during a swap took the mirror too


@dataclass
class Outcome:
    strategy: str
    horizon_s: float
    work_s: float = 0.0
    failures: int = 0
    counts: Dict[str, int] = field(default_factory=dict)
    spent: Dict[str, float] = field(default_factory=dict)  # seconds by category
    trace: List[Tuple[float, float]] = field(default_factory=list)  # (time, work)

    @property
    def ratio(self) -> float:
        return self.work_s / self.horizon_s


class _Run:
    """One simulated job; each method is one kind of event."""

    def __init__(
        self,
        strategy: Strategy,
        failures: Iterable[float],
        horizon_s: float,
        seed: int,
        trace: bool,
    ):
        self.s, self.horizon = strategy, horizon_s
        self.failures = iter(failures)
        self.next_failure = next(self.failures, math.inf)
        self.rng = random.Random(f"run-{seed}")  # repairs and pair losses
        self.t = self.work = self.saved = 0.0
        self.since_checkpoint = self.since_resume = 0.0  # compute seconds
        self.failed = False
        self.missing = 0
        self.spares = strategy.spares
        self.repairs: List[float] = []  # times nodes come back, a heap
        self.out = Outcome(strategy.name, horizon_s)
        self.tracing = trace
        self._mark()

    # ----- bookkeeping -----
    def _mark(self) -> None:
        if self.tracing:
            self.out.trace.append((self.t, self.work))

    def _spend(self, kind: str, seconds: float) -> None:
        self.out.spent[kind] = self.out.spent.get(kind, 0.0) + seconds

    def _count(self, kind: str) -> None:
        self.out.counts[kind] = self.out.counts.get(kind, 0) + 1

    def _fail(self) -> None:
        self.failed = True
        self.out.failures += 1
        self.next_failure = next(self.failures, math.inf)

    def rate(self) -> float:
        """Useful work per second of compute."""
        return (1 - self.missing / self.s.dp) / (1 + self.s.mirror_overhead)

    # ----- time passing -----
    def compute(self, until: float) -> None:
        end = min(until, self.next_failure, self.horizon)
        dt = end - self.t
        gained = dt * self.rate()
        self.work += gained
        self._spend("slowdown", dt - gained)
        self.since_checkpoint += dt
        self.since_resume += dt
        self.t = end
        if end == self.next_failure:
            self._fail()
        self._mark()

    def pause(self, seconds: float, kind: str) -> bool:
        """Training stands still; False if a failure cut it short."""
        end = self.t + seconds
        if self.next_failure < min(end, self.horizon):
            self._spend(kind, self.next_failure - self.t)
            self.t = self.next_failure
            self._fail()
            self._mark()
            return False
        self._spend(kind, min(end, self.horizon) - self.t)
        self.t = min(end, self.horizon)
        self._mark()
        return True

    # ----- events -----
    def checkpoint(self) -> None:
        if self.pause(self.s.checkpoint_cost_s, "checkpoint"):
            self.saved, self.since_checkpoint = self.work, 0.0
            self._count("checkpoints")

    def restart(self) -> None:
        """Back to the durable checkpoint; failures during the restart restart it."""
        self._roll_back(self.work - self.saved)
        self.since_checkpoint = self.since_resume = 0.0
        self.missing = 0  # the scheduler relaunches the job at full size
        while not self.pause(self.s.restart_s, "recovery"):
            self._count("restarts_interrupted")
        self.failed = False
        self._count("restarts")

    def _roll_back(self, lost: float) -> None:
        self.work -= lost
        self._spend("rework", lost)
        self.saved = min(self.saved, self.work)
        self._mark()

    def _return_repaired(self) -> None:
        while self.repairs and self.repairs[0] <= self.t:
            heapq.heappop(self.repairs)
            self.spares += 1

    def _send_to_repair(self) -> None:
        if self.s.spares is not None:
            heapq.heappush(
                self.repairs,
                self.t + self.rng.expovariate(1 / self.s.repair_mean_s)
                if math.isfinite(self.s.repair_mean_s)
                else math.inf,
            )

    def hot_swap(self) -> None:
        """Redo the interrupted iteration on a spare, or shrink, or restart."""
        iteration_wall = self.s.iteration_s / self.rate()
        lost_wall = self.since_resume % iteration_wall
        self._roll_back(lost_wall * self.rate())
        self.since_checkpoint = max(0.0, self.since_checkpoint - lost_wall)
        self.since_resume = 0.0
        self._return_repaired()
        if self.spares is None or self.spares > 0:
            kind, seconds = "swaps", self.s.swap_s
            self.spares = None if self.spares is None else self.spares - 1
        elif self.s.shrink_when_out and self.missing + 1 < self.s.dp:
            kind, seconds = "shrinks", self.s.shrink_s
            self.missing += 1
        else:
            self._count("fallbacks")
            return self.restart()
        self._send_to_repair()
        if self.pause(seconds, "recovery"):
            self.failed = False
            self._count(kind)
        elif self.rng.random() < self.s.pair_loss_probability:
            self._count("pair_losses")
            self.restart()

    def regrow(self) -> None:
        """A repaired node takes a shrunk replica's place at an iteration end."""
        self.spares -= 1
        self.missing -= 1
        if self.pause(self.s.regrow_s, "recovery"):
            self._count("regrows")
        self.since_resume = 0.0

    def step(self) -> None:
        if self.failed:
            return self.restart() if not self.s.hot_swap else self.hot_swap()
        # A microsecond's slack: float sums of compute time may stop just short.
        if self.since_checkpoint >= self.s.checkpoint_interval_s - 1e-6:
            return self.checkpoint()
        if self.missing and self.spares is not None:
            self._return_repaired()
            if self.spares > 0:
                return self.regrow()
        until = self.t + self.s.checkpoint_interval_s - self.since_checkpoint
        if self.missing and self.repairs:
            until = min(until, self.repairs[0])
        self.compute(until)

    def run(self) -> Outcome:
        while self.t < self.horizon:
            self.step()
        self.out.work_s = self.work
        self._mark()
        return self.out


def simulate(
    strategy: Strategy,
    failures: Iterable[float],
    horizon_s: float,
    seed: int = 0,
    trace: bool = False,
) -> Outcome:
    """Run ``strategy`` over ``horizon_s`` seconds of wall time against the
    given failure times (ascending); ``seed`` drives repairs and pair losses."""
    return _Run(strategy, failures, horizon_s, seed, trace).run()


def simulate_seeds(
    strategy: Strategy,
    rate_per_s: float,
    horizon_s: float,
    seeds: Sequence[int],
    trace: bool = False,
) -> List[Outcome]:
    return [
        simulate(strategy, poisson_failures(rate_per_s, seed), horizon_s, seed, trace)
        for seed in seeds
    ]


def work_at(outcome: Outcome, times: Sequence[float]) -> List[float]:
    """Useful work done by each time (the trace is piecewise linear, with
    drops at rollbacks)."""
    out, trace, i = [], outcome.trace, 0
    for t in times:
        while i + 1 < len(trace) and trace[i + 1][0] <= t:
            i += 1
        if i + 1 < len(trace) and trace[i + 1][0] > trace[i][0]:
            (t0, w0), (t1, w1) = trace[i], trace[i + 1]
            out.append(w0 + (w1 - w0) * (t - t0) / (t1 - t0))
        else:
            out.append(trace[i][1])
    return out


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
