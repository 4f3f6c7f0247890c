"""The GPU validation: every recovery claim on NCCL and a GPU, as one
prepared run that fits a lent single-GPU machine's call (10 minutes, the
installs included), its figures and logs in one folder.

    bash tools/gpu_check.sh OUT                 # on the GPU machine
    python -m tools.gpu_check OUT --dry-run     # anywhere: every command built and parsed

Stages (each a set of runs; the runs of a group start together):

1. hot swap on NCCL: TP2 x DP2 on one GPU (the ranks share it as NCCL
   "hosts" of their own, megatron/training/gpu_sharing.py), two active
   emulated nodes and two spare ones; node 1 killed in backward, then rank 0
   in the optimizer step. Curve and every rank's final state against the
   failure-free run, bit for bit; the recovery's stages, the NCCL abort's
   cost among them. bf16, dropout on.
2. shrink on NCCL, no spare: node 1 killed, the job goes on at DP 1 with the
   same global batch, within compare.SHRINK_TOLERANCE of the failure-free
   run (fp32, dropout off); the buddies' copies in host and in device memory.
3. the mirror's cost: iteration time without --deadpool and with it, the
   copies in host and device memory, state and grad mode (grad needs
   device memory on a GPU), DP 2 on the card, a 760M GPT.
4. attention: GPT 1.3B on one rank, TFLOP/s with megatron-core's attention
   (--attention-backend local) and torch's SDPA (auto); and a small SDPA run
   with dropout twice, every iteration's metrics equal.
5. NVML: each GPU's health (control/gpu_health.py) before and after.

Writes OUT/summary.json, OUT/summary.md and OUT/logs.tar.gz (every run's
output and events; the device tool brings back at most 8 files). A stage
that would pass the deadline is skipped and says so. ``--cpu`` rehearses
the same stages on gloo with small models (no device-memory runs), to try
the runner and the checks before a GPU is lent.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One device call is at most 600 s; the machine's start is not in it, the
# installs are. Everything here must be done by then.
BUDGET_S = 540
SHARE = {"DEADPOOL_SHARE_GPU": "hostid"}
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50256"]
SCHEDULE = ["--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--seed", "1234"]
COMMON = MOCK + SCHEDULE + ["--eval-iters", "0", "--num-workers", "0", "--log-interval", "1"]
COMMON += ["--use-distributed-optimizer"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# Deterministic kernels, as Megatron-LM's CI runs for its bit-for-bit checks.
DETERMINISTIC = ["--deterministic-mode"]
NCCL_ORDER = {"NCCL_ALGO": "Ring"}


def gpt(layers: int, hidden: int, heads: int, seq: int, micro: int, batch: int) -> List[str]:
    return [
        *("--num-layers", str(layers), "--hidden-size", str(hidden)),
        *("--num-attention-heads", str(heads), "--seq-length", str(seq)),
        *("--max-position-embeddings", str(seq), "--micro-batch-size", str(micro)),
        *("--global-batch-size", str(batch)),
    ]


@dataclass(frozen=True)
class Sizes:
    """The models and lengths of a check: the GPU's, or a CPU rehearsal's."""

    recovery: List[str]  # stages 1-2: TP2 x DP2 on 4 ranks
    recovery_iters: int
    mirror: List[str]  # stage 3: DP2
    mirror_iters: int
    large: List[str]  # stage 4: one rank
    large_iters: int
    small: List[str]
    bf16: List[str]
    on_gpu: bool

    def mirror_for(self, card_gib: float) -> List[str]:
        """Stage 3's model: the largest of two that fits two ranks' mirrors
        (two own and two held copies of the fp32 shard each) on the card."""
        return self.mirror_large if self.on_gpu and card_gib >= 120 else self.mirror

    @property
    def mirror_large(self) -> List[str]:
        # 760M parameters: a 4.5 GB snapshot per rank, 37 GB per rank in all.
        return gpt(24, 1536, 16, 2048, 2, 16)


GPU = Sizes(
    recovery=gpt(4, 512, 8, 512, 2, 16),
    recovery_iters=10,
    # 540M parameters: a 3.2 GB snapshot per rank, about 30 GB per rank in
    # all with its model, fp32 state and activations (an 80 GB card).
    mirror=gpt(24, 1280, 16, 2048, 1, 16),
    mirror_iters=12,
    # 1.3B; micro-batch 2 keeps megatron-core's attention (its score
    # matrices) within an 80 GB card.
    large=gpt(24, 2048, 16, 2048, 2, 16),
    large_iters=10,
    small=gpt(4, 256, 8, 512, 4, 16),
    bf16=["--bf16"],
    on_gpu=True,
)
CPU = Sizes(
    recovery=gpt(2, 64, 4, 32, 2, 8),
    recovery_iters=8,
    mirror=gpt(2, 128, 4, 64, 2, 8),
    mirror_iters=6,
    large=gpt(2, 128, 4, 64, 2, 4),
    large_iters=5,
    small=gpt(2, 64, 4, 32, 2, 4),
    bf16=[],
    on_gpu=False,
)


@dataclass(frozen=True)
class Run:
    name: str  # its folder under the work folder
    command: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    timeout_s: float = 240.0


@dataclass(frozen=True)
class Stage:
    number: int
    title: str
    groups: List[List[Run]]  # the runs of a group start together
    judge: Callable[[str], dict]  # the work folder -> figures


# ----- the commands -----
def launcher(python: str, nodes: int, spares: int, per_node: int) -> List[str]:
    return [python, "-m", "deadpool_ext.launch", "--standalone", "--nnodes", str(nodes)] + [
        *("--spare-nodes", str(spares), "--nproc-per-node", str(per_node), "pretrain_gpt.py")
    ]


def torchrun(python: str, nproc: int) -> List[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def outputs(work: str, name: str, save: bool = False, events: bool = False) -> List[str]:
    folder = os.path.join(work, name)
    args = ["--metrics-file", os.path.join(folder, "metrics.jsonl")]
    if save:
        args += ["--save", os.path.join(folder, "ckpt")]
    if events:
        args += ["--deadpool-events", os.path.join(folder, "events.jsonl")]
    return args


def recovery_run(python, work, sizes: Sizes, name, spares, faults, precision, extra=()) -> Run:
    """TP2 x DP2 on two emulated nodes of two ranks (DP peers on different
    nodes), ``spares`` spare nodes, through deadpool-launch."""
    args = sizes.recovery + COMMON + precision + list(extra)
    args += ["--tensor-model-parallel-size", "2", "--use-tp-pp-dp-mapping"]
    args += ["--train-iters", str(sizes.recovery_iters), "--deadpool"]
    args += outputs(work, name, save=True, events=True)
    args += [f"--deadpool-inject={fault}" for fault in faults]
    env = {**SHARE, **NCCL_ORDER} if sizes.on_gpu else {}
    return Run(name, launcher(python, 2, spares, 2) + args, env)


SWAP_FAULTS = ["kill:node=1:iter=4:phase=backward", "kill:rank=0:iter=7:phase=optimizer"]
SHRINK_FAULT = "kill:node=1:iter=4:phase=backward"
SHRINK = ["--deadpool-on-spares-exhausted", "shrink"]


def swap_and_shrink_runs(python: str, work: str, sizes: Sizes) -> List[Run]:
    """Stages 1 and 2 and the determinism pair of stage 4: one group (none
    of them is timed). Bit for bit needs deterministic kernels on a GPU
    (--deterministic-mode, NCCL_ALGO): the swap runs the default attention
    (torch's SDPA), the shrink megatron-core's, so that one of them shows
    the recovery on NCCL should SDPA's backward not repeat itself (the pair
    says whether it does)."""
    half = sizes.bf16 + DETERMINISTIC
    fp32 = NO_DROPOUT + DETERMINISTIC + ["--attention-backend", "local"]
    runs = [
        recovery_run(python, work, sizes, "swap-reference", 0, [], half),
        recovery_run(python, work, sizes, "swap", 2, SWAP_FAULTS, half),
        recovery_run(python, work, sizes, "shrink-reference", 0, [], fp32, SHRINK),
        recovery_run(python, work, sizes, "shrink", 0, [SHRINK_FAULT], fp32, SHRINK),
    ]
    if sizes.on_gpu:  # the buddies' copies in GPU memory (re-cut on the host)
        device = SHRINK + ["--deadpool-mirror-memory", "device"]
        runs.append(
            recovery_run(python, work, sizes, "shrink-device", 0, [SHRINK_FAULT], fp32, device)
        )
    for name in ("sdpa-a", "sdpa-b"):
        args = sizes.small + COMMON + half + ["--train-iters", "10"]
        args += [] if sizes.on_gpu else ["--attention-backend", "unfused"]
        command = torchrun(python, 1) + ["pretrain_gpt.py"] + args + outputs(work, name)
        runs.append(Run(name, command, dict(NCCL_ORDER) if sizes.on_gpu else {}))
    return runs


MIRROR_MODES = {  # run: its --deadpool flags (None: without --deadpool)
    "mirror-off": None,
    "mirror-state-host": ["--deadpool-mirror-mode", "state", "--deadpool-mirror-memory", "host"],
    "mirror-state-device": [
        "--deadpool-mirror-mode",
        "state",
        "--deadpool-mirror-memory",
        "device",
    ],
    "mirror-grad-device": ["--deadpool-mirror-mode", "grad", "--deadpool-mirror-memory", "device"],
}


def mirror_runs(python: str, work: str, sizes: Sizes, card_gib: float) -> List[List[Run]]:
    """Stage 3, one run at a time (timed)."""
    groups = []
    for name, flags in MIRROR_MODES.items():
        if flags is not None and "device" in flags and not sizes.on_gpu:
            continue  # device memory is a GPU's
        args = sizes.mirror_for(card_gib) + COMMON + sizes.bf16
        args += ["--train-iters", str(sizes.mirror_iters)]
        if flags is not None:
            args += ["--deadpool", "--deadpool-ranks-per-node", "1", *flags]
        args += outputs(work, name, events=flags is not None)
        env = SHARE if sizes.on_gpu else {}
        groups.append([Run(name, torchrun(python, 2) + ["pretrain_gpt.py"] + args, env, 150)])
    return groups


def attention_runs(python: str, work: str, sizes: Sizes) -> List[List[Run]]:
    """Stage 4's timed pair, one run at a time."""
    groups = []
    for name, backend in (("attention-local", "local"), ("attention-sdpa", "auto")):
        if not sizes.on_gpu and backend == "auto":
            backend = "unfused"  # auto is megatron-core's attention on a CPU
        args = sizes.large + COMMON + sizes.bf16 + ["--train-iters", str(sizes.large_iters)]
        args += ["--attention-backend", backend, "--log-throughput"] + outputs(work, name)
        groups.append([Run(name, torchrun(python, 1) + ["pretrain_gpt.py"] + args, {}, 150)])
    return groups


def plan(
    work: str, python: str, sizes: Sizes, wanted=(1, 2, 3, 4, 5), card_gib: float = 80.0
) -> List[Stage]:
    """The wanted stages. Stages 1 and 2 (and stage 4's repeated pair) run
    as one group, with the first of them wanted: none of them is timed (on
    a CPU, with two cores, one after the other)."""
    untimed = swap_and_shrink_runs(python, work, sizes)
    untimed = [untimed] if sizes.on_gpu else [[run] for run in untimed]
    first = min({1, 2} & set(wanted), default=None)
    stages = [
        Stage(1, "hot swap on NCCL", untimed if first == 1 else [], judge_swap),
        Stage(2, "shrink on NCCL", untimed if first == 2 else [], judge_shrink),
        Stage(3, "the mirror's cost", mirror_runs(python, work, sizes, card_gib), judge_mirror),
        Stage(4, "attention", attention_runs(python, work, sizes), judge_attention),
        Stage(5, "NVML", [], lambda work: {"gpus": read_gpus()}),
    ]
    return [stage for stage in stages if stage.number in wanted]


# ----- the checks -----
def metrics_of(work: str, name: str) -> List[dict]:
    from tools.compare import read_metrics

    path = os.path.join(work, name, "metrics.jsonl")
    return read_metrics(path) if os.path.exists(path) else []


def events_of(work: str, name: str) -> List[dict]:
    from deadpool_ext.events import read_events

    path = os.path.join(work, name, "events.jsonl")
    return read_events(path) if os.path.exists(path) else []


def judge_swap(work: str) -> dict:
    from tools.compare import curve_difference, state_difference
    from megatron.training.checkpointing import read_whole
    from tools.recovery_timeline import recoveries, stage_seconds, total_seconds

    got, want = metrics_of(work, "swap"), metrics_of(work, "swap-reference")
    difference = curve_difference(got, want) if got and want else "a run left no metrics"
    state = None
    if difference is None:
        state = state_difference(
            read_whole(os.path.join(work, "swap", "ckpt")),
            read_whole(os.path.join(work, "swap-reference", "ckpt")),
        )
    events = events_of(work, "swap")
    released = [e["released"] for e in events if e["event"] == "groups_torn_down"]
    return {
        "curve_bit_for_bit": difference is None,
        "curve_difference": difference,
        "final_state_bit_for_bit": difference is None and state is None,
        "state_difference": state,
        "iterations": len(got),
        "recoveries": [
            {
                "fault": r["fault"],
                "stages_ms": {label: round(s * 1e3) for label, s in stage_seconds(r)},
                "fault_to_first_iteration_ms": round(total_seconds(r) * 1e3),
            }
            for r in recoveries(events)
        ],
        "nccl_abort_ms": [r["abort_ms"] for r in released if r and "abort_ms" in r],
    }


def judge_shrink(work: str) -> dict:
    from tools.compare import SHRINK_TOLERANCE, shrink_difference

    want = metrics_of(work, "shrink-reference")
    out = {"tolerance": SHRINK_TOLERANCE}
    for name in ("shrink", "shrink-device"):
        got = metrics_of(work, name)
        if not os.path.isdir(os.path.join(work, name)):
            continue
        fault_iteration = int(SHRINK_FAULT.split("iter=")[1].split(":")[0])
        difference = shrink_difference(got, want, fault_iteration)
        difference = difference if got and want else "a run left no metrics"
        drift = max(
            (
                abs(g[k] - w[k]) / abs(w[k])
                for g, w in zip(got, want)
                for k in ("lm_loss", "grad_norm")
            ),
            default=None,
        )
        resized = [e for e in events_of(work, name) if e["event"] == "decision"]
        out[name] = {
            "within_tolerance": difference is None,
            "difference": difference,
            "largest_relative_drift": drift,
            "decisions": [
                {k: e.get(k) for k in ("action", "dp_before", "dp_after")} for e in resized
            ],
        }
    return out


def steady_seconds(metrics: List[dict], skip: int = 3) -> Optional[float]:
    seconds = [m["seconds"] for m in metrics if m["iteration"] > skip]
    return statistics.median(seconds) if seconds else None


def judge_mirror(work: str) -> dict:
    base = steady_seconds(metrics_of(work, "mirror-off"))
    out = {"iteration_s": {}, "ratio_to_off": {}, "mirror_stage_ms": {}}
    for name in MIRROR_MODES:
        seconds = steady_seconds(metrics_of(work, name))
        out["iteration_s"][name] = seconds
        if seconds is not None and base:
            out["ratio_to_off"][name] = round(seconds / base, 4)
        snapshots = [e for e in events_of(work, name) if e["event"] == "mirror_snapshot"]
        stages = ("pack_ms", "seal_ms", "exchange_ms", "verify_ms")
        out["mirror_stage_ms"][name] = {
            s: statistics.median([e[s] for e in snapshots if s in e])
            for s in stages
            if any(s in e for e in snapshots)
        }
    return out


THROUGHPUT = re.compile(r"iteration\s+(\d+)/.*throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")


def judge_attention(work: str) -> dict:
    from tools.compare import curve_difference

    out = {}
    for name in ("attention-local", "attention-sdpa"):
        log = os.path.join(work, name, "output.log")
        found = THROUGHPUT.findall(open(log).read()) if os.path.exists(log) else []
        steady = [float(t) for i, t in found if int(i) > 2]
        out[name] = {
            "tflops": statistics.median(steady) if steady else None,
            "core_attention": core_attention_in(log),
        }
    a, b = metrics_of(work, "sdpa-a"), metrics_of(work, "sdpa-b")
    out["sdpa_repeat_bit_for_bit"] = bool(a) and curve_difference(a, b) is None
    out["sdpa_core_attention"] = core_attention_in(os.path.join(work, "sdpa-a", "output.log"))
    return out


def core_attention_in(log: str) -> Optional[str]:
    if not os.path.exists(log):
        return None
    found = re.search(r"core attention: (.*)", open(log).read())
    return found.group(1) if found else None


def read_gpus() -> object:
    from deadpool_ext.control.gpu_health import NvmlReader, NvmlUnavailable

    try:
        reader = NvmlReader.open()
    except NvmlUnavailable as why:
        return str(why)
    return [reader.read(str(i)).to_dict() for i in range(reader.count)]


# ----- running -----
def start(run: Run, work: str) -> subprocess.Popen:
    folder = os.path.join(work, run.name)
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, **run.env)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    with open(os.path.join(folder, "command.txt"), "w") as f:
        f.write(" ".join(f"{k}={v}" for k, v in run.env.items()) + " " + shlex.join(run.command))
    log = open(os.path.join(folder, "output.log"), "w")
    return subprocess.Popen(
        run.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def run_group(runs: List[Run], work: str, deadline: float) -> Dict[str, dict]:
    """Start the runs together; each ends, or is stopped at its timeout or
    the deadline (its stacks printed first, into its log)."""
    started = time.monotonic()
    procs = {run.name: (run, start(run, work)) for run in runs}
    results = {}
    while len(results) < len(procs):
        for name, (run, proc) in procs.items():
            if name in results:
                continue
            late = time.monotonic() > min(started + run.timeout_s, deadline)
            if proc.poll() is None and late:
                stop(proc)
            if proc.poll() is not None:
                results[name] = {
                    "exit_code": proc.returncode,
                    "seconds": round(time.monotonic() - started, 1),
                    "stopped_at_timeout": late,
                }
        time.sleep(0.5)
    return results


def stop(proc: subprocess.Popen) -> None:
    """Every process of the run prints its stacks (faulthandler on
    SIGUSR1, deadpool's workers), then is killed."""
    for sig, wait_s in ((signal.SIGUSR1, 3), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


def card_memory_gib() -> float:
    """The GPU's memory, or an H100's where none is seen (the dry run)."""
    import torch

    if not torch.cuda.is_available():
        return 80.0
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def environment() -> dict:
    import torch

    facts = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_memory_gib": (
            round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            if torch.cuda.is_available()
            else None
        ),
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))
        if torch.cuda.is_available()
        else None,
    }
    try:
        import megatron.core

        facts["megatron_core"] = megatron.core.__version__
    except ImportError as error:
        facts["megatron_core"] = f"not importable: {error}"
    return facts


def run_check(out: str, work: str, stages: List[Stage], budget_s: float) -> dict:
    deadline = time.monotonic() + budget_s
    summary = {"environment": environment(), "gpus_before": read_gpus(), "stages": {}}
    write_summary(out, summary)
    for stage in stages:
        entry = summary["stages"].setdefault(str(stage.number), {"title": stage.title})
        runs = {}
        for group in stage.groups:
            if time.monotonic() > deadline - 30:
                entry["skipped"] = "the check's time ran out before this stage"
                break
            runs.update(run_group(group, work, deadline))
        entry["runs"] = runs
        try:
            entry["figures"] = stage.judge(work)
        except Exception as error:  # noqa: BLE001 - a stage's check must not stop the others
            entry["judge_error"] = f"{type(error).__name__}: {error}"
        write_summary(out, summary)
        print(f"stage {stage.number} ({stage.title}): {json.dumps(entry, default=str)[:2000]}")
    summary["gpus_after"] = read_gpus()
    write_summary(out, summary)
    pack_logs(out, work)
    return summary


def write_summary(out: str, summary: dict) -> None:
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(markdown(summary))


def markdown(summary: dict) -> str:
    lines = ["# GPU check", "", f"`{json.dumps(summary['environment'])}`", ""]
    for number, entry in summary["stages"].items():
        lines.append(f"## {number}. {entry['title']}")
        for name, result in entry.get("runs", {}).items():
            lines.append(f"- run `{name}`: {json.dumps(result)}")
        for key in ("skipped", "judge_error"):
            if key in entry:
                lines.append(f"- {key}: {entry[key]}")
        lines.append("```json")
        lines.append(json.dumps(entry.get("figures"), indent=1, default=str))
        lines.append("```")
    return "\n".join(lines) + "\n"


def pack_logs(out: str, work: str) -> None:
    """Every run's output, command, metrics and events (no checkpoints)."""
    with tarfile.open(os.path.join(out, "logs.tar.gz"), "w:gz") as tar:
        for folder, dirs, files in os.walk(work):
            dirs[:] = [d for d in dirs if d != "ckpt"]
            for name in files:
                path = os.path.join(folder, name)
                tar.add(path, arcname=os.path.relpath(path, work))


# ----- the dry run -----
def gpu_host(env: Dict[str, str]):
    """Parsing as on the lent GPU machine: CUDA with one GPU, no Transformer
    Engine or Apex (its image has neither), the run's environment."""
    from megatron.training.flags import host

    return [
        mock.patch.dict(os.environ, env),
        mock.patch.object(host, "cuda_available", lambda: True),
        mock.patch.object(host, "gpu_count", lambda: 1),
        mock.patch.object(host, "importable", lambda module: False),
    ]


def parse_as_launched(run: Run, on_gpu: bool) -> str:
    """Parse the run's launcher and script flags as its ranks would; raise
    ConfigError (or SystemExit from a launcher's parser) if refused.
    Returns what was checked."""
    from deadpool_ext import config as deadpool_config
    from deadpool_ext.control.command_line import build_parser

    command = run.command
    script = command.index("pretrain_gpt.py")
    if "deadpool_ext.launch" in command:
        opts = build_parser().parse_args(command[command.index("deadpool_ext.launch") + 1 :])
        world, per_node = opts.nnodes * opts.nproc_per_node, opts.nproc_per_node
        env = {"DEADPOOL_SLOT": "0.0", "DEADPOOL_RANKS_PER_NODE": str(per_node)}
    else:
        from torch.distributed.run import get_args_parser

        opts = get_args_parser().parse_args(command[command.index("torch.distributed.run") + 1 :])
        world = per_node = int(opts.nproc_per_node)
        env = {}
    env.update(run.env, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_node))
    with contextlib.ExitStack() as stack:
        for patch in gpu_host(env) if on_gpu else [mock.patch.dict(os.environ, env)]:
            stack.enter_context(patch)
        deadpool_config.parse_args(command[script + 1 :], environ=os.environ, world_size=world)
    return f"{world} ranks"


def dry_run(stages: List[Stage], on_gpu: bool) -> int:
    """Every stage's commands printed and parsed as on the GPU machine; the
    worst case of the timeouts against the budget."""
    from megatron.training.arguments import ConfigError

    refused, worst = 0, 0.0
    for stage in stages:
        print(f"stage {stage.number}: {stage.title}")
        for group in stage.groups:
            worst += max(run.timeout_s for run in group)
            for run in group:
                env = " ".join(f"{k}={v}" for k, v in run.env.items())
                print(f"  {run.name}: {env} {shlex.join(run.command)}".replace("  ", " ", 1))
                try:
                    print(f"    parsed as launched ({parse_as_launched(run, on_gpu)}): ok")
                except (ConfigError, SystemExit) as error:
                    refused += 1
                    print(f"    REFUSED: {error}")
    print(f"worst case {worst:.0f} s of runs; the check stops them by {BUDGET_S} s")
    return 2 if refused else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="Folder for summary.json, summary.md and logs.tar.gz.")
    p.add_argument("--dry-run", action="store_true", help="Build and parse every command only.")
    p.add_argument("--cpu", action="store_true", help="Rehearse on gloo with small models.")
    p.add_argument("--stages", default="1,2,3,4,5", help="Which stages, e.g. 1,3 (default all).")
    p.add_argument(
        "--work", default=None, help="Where the runs write (default OUT/../gpu-check-work)."
    )
    p.add_argument("--budget", type=float, default=BUDGET_S, help="Seconds for all the runs.")
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    sizes = CPU if opts.cpu else GPU
    os.makedirs(opts.out, exist_ok=True)
    work = opts.work or os.path.join(os.path.dirname(os.path.abspath(opts.out)), "gpu-check-work")
    wanted = {int(s) for s in opts.stages.split(",")}
    stages = plan(work, sys.executable, sizes, wanted, card_gib=card_memory_gib())
    if opts.dry_run:
        return dry_run(stages, on_gpu=not opts.cpu)
    run_check(opts.out, work, stages, opts.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
