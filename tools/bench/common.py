"""What the benchmarks share (not a script): the demo workload, running it
under torchrun or deadpool-launch while watching its metrics, the workers of
a torchrun job, and the one-shrink measurement that bench/recovery.py and
bench/shrink.py both report. The benchmarks import this module and never
each other."""

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import List, Optional

from deadpool_ext.events import read_events
from tools.workers import worker_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = worker_env()
# The "large" configuration's model (2 ranks at DP 2: 19.4 M parameters, a
# 116 MB snapshot per rank): the mirror and checkpoint benchmarks and the
# planner's cross-check (tools/scale_report.py) run it.
LARGE_MODEL = [
    "--num-layers",
    "6",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "512",
    "--max-position-embeddings",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
]


# ----- the demo workload -----
def demo_args() -> list:
    """The demo's flags, read from the Makefile so the two never drift."""
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", REPO, "print-demo-args"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return shlex.split(out)


def strip_outputs(args: list) -> list:
    """Drop the demo's --save/--save-interval/--metrics-file: the bench sets its own."""
    drop, kept, skip = {"--save", "--save-interval", "--metrics-file"}, [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        else:
            kept.append(arg)
    return kept


# The demo's model with MoE layers: 4 experts, top-2, EP 2, on its 8 ranks as
# DP 8 (TP 1, PP 1): megatron-core's MoE layers need sequence parallelism
# with TP > 1, which needs Transformer Engine or Apex. Expert-DP 4; node 1
# (ranks 4-7) holds two whole expert blocks.
MOE_LAYERS = [  # also the MoE tests' model (tests/common/dist_utils.py)
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--expert-model-parallel-size",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--disable-bias-linear",
]
MOE_FLAGS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
MOE_FLAGS += MOE_LAYERS


def demo_workload(iters: int, workdir: str, moe: bool = False) -> List[str]:
    """The demo on whole emulated nodes (a DP replica fills a node), its
    metrics in ``workdir``; with ``moe`` its MLPs are MoE layers."""
    return (
        strip_outputs(demo_args())
        + (MOE_FLAGS if moe else [])
        + [
            "--use-tp-pp-dp-mapping",
            "--train-iters",
            str(iters),
            "--eval-iters",
            "0",
            "--metrics-file",
            os.path.join(workdir, "metrics.jsonl"),
        ]
    )


# ----- a torchrun job, start to end -----
def torchrun_command(nproc: int, args: List[str], torchrun_flags: List[str] = ()) -> List[str]:
    """pretrain_gpt.py under torchrun on this host."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *torchrun_flags,
        os.path.join(REPO, "pretrain_gpt.py"),
        *args,
    ]


def run_once(nproc: int, iters: int, extra: list, workdir: str, base=None) -> dict:
    """One torchrun of pretrain_gpt.py with ``base`` flags (default: the demo's)."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    base = strip_outputs(demo_args()) if base is None else base
    args = base + [
        "--train-iters",
        str(iters),
        "--eval-iters",
        "0",
        "--metrics-file",
        metrics,
        *extra,
    ]
    cmd = torchrun_command(nproc, args)
    start = time.time()
    with open(os.path.join(workdir, "stderr.log"), "w+") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        first_iteration, elapsed_ms = None, []
        for line in proc.stdout:
            if first_iteration is None and re.search(r" iteration +1/", line):
                first_iteration = time.time() - start
            # The log line's time: the whole iteration, hooks included.
            found = re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", line)
            if found:
                elapsed_ms.append(float(found.group(1)))
        failed = proc.wait() != 0
        stderr.seek(0)
        lines = stderr.readlines()
    if failed:
        tail = "".join([line for line in lines if "error:" in line][:3] + lines[-15:])
        raise SystemExit(
            f"run failed: {shlex.join(cmd)}\n{tail}\n"
            "(the demo corpus comes from `make data`; `make bench` runs it first)"
        )
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return {
        "launch_to_first_iteration_s": first_iteration,
        "records": records,
        "elapsed_ms": elapsed_ms,  # per log line (every iteration with --log-interval 1)
        "total_s": time.time() - start,
        "args": args,
    }


# ----- a job watched while it runs -----
class MetricsWatch:
    """Wall-clock time at which each iteration's metrics line appeared
    (polled; the last rank writes one line per iteration)."""

    def __init__(self, path: str):
        self.path, self.offset, self.seen = path, 0, []  # (time, iteration)

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            for line in f:
                if line.endswith("\n"):
                    self.seen.append((time.time(), json.loads(line)["iteration"]))
                    self.offset += len(line)

    def first_after(self, moment: float, iteration: Optional[int] = None) -> Optional[float]:
        return next(
            (t for t, i in self.seen if t > moment and (iteration is None or i >= iteration)), None
        )


def run(command: List[str], watch: MetricsWatch, on_poll=None, check: bool = True) -> float:
    """Run ``command`` to its end, polling ``watch`` (and ``on_poll(proc)``,
    which may kill workers) every 20 ms; its wall time in seconds."""
    start = time.time()
    log = os.path.join(os.path.dirname(watch.path), "output.log")
    with open(log, "w+") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=out)
        while proc.poll() is None:
            watch.poll()
            if on_poll is not None:
                on_poll(proc)
            time.sleep(0.02)
        watch.poll()
        if check and proc.returncode != 0:
            out.seek(0)
            raise SystemExit(
                f"bench run failed ({proc.returncode}): {' '.join(command)}\n{out.read()[-5000:]}"
            )
    return time.time() - start


def worker_pids(root: int) -> dict:
    """RANK -> pid of the workers under a torchrun process."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != root:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            found[int(env[b"RANK"])] = int(pid)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return found


# ----- torchrun on 8 ranks, saving and loading checkpoints -----
def checkpoint_restart_command(args: List[str], workdir: str, save_interval: int) -> List[str]:
    """The failure-free way to survive a failure: torchrun restarts the job
    from the last --save checkpoint."""
    save = os.path.join(workdir, "checkpoints")
    checkpoints = ["--save", save, "--load", save, "--save-interval", str(save_interval)]
    return torchrun_command(8, args + checkpoints, ["--monitor-interval", "0.1"])


# ----- deadpool-launch on two emulated 4-rank nodes -----
def launcher(args: List[str], spare_nodes: int, nnodes: int = 2) -> List[str]:
    return [
        sys.executable,
        "-m",
        "deadpool_ext.launch",
        "--standalone",
        "--nnodes",
        str(nnodes),
        "--spare-nodes",
        str(spare_nodes),
        "--nproc-per-node",
        "4",
        os.path.join(REPO, "pretrain_gpt.py"),
        *args,
    ]


def deadpool_run(args: List[str], workdir: str, faults: List[str], spare_nodes: int = 0) -> dict:
    """A --deadpool job with the given injected faults (no spare node by default)."""
    events = os.path.join(workdir, "events.jsonl")
    args = (
        args
        + ["--deadpool", "--deadpool-events", events]
        + [f"--deadpool-inject={f}" for f in faults]
    )
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    total = run(launcher(args, spare_nodes=spare_nodes), watch)
    return {"total_s": total, "watch": watch, "events": read_events(events)}


def iteration_seconds(workdir: str, first: int, last: int) -> float:
    """Median of the logged iteration times in [first, last]."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        seconds = [m["seconds"] for m in map(json.loads, f) if first <= m["iteration"] <= last]
    return statistics.median(seconds)


# ----- one shrink: reported by bench/recovery.py and bench/shrink.py -----
def one_shrink(opts, workdir: str) -> dict:
    """The demo with no spare node, node 1 killed in iteration
    ``opts.fail_at`` of ``opts.iters``: the job goes on as DP1."""
    out = deadpool_run(
        demo_workload(opts.iters, workdir, getattr(opts, "moe", False)),
        workdir,
        [f"kill:node=1:iter={opts.fail_at}"],
    )
    events = out["events"]
    fault = next(e["time"] for e in events if e["event"] == "fault_injected")
    decision = next(e for e in events if e["event"] == "decision")
    first = max(
        e["time"]
        for e in events
        if e["event"] == "first_iteration_after_recovery" and e["gen"] == decision["gen"]
    )
    return {
        "total_s": out["total_s"],
        "to_first_iteration_s": first - fault,
        "iterations_lost": opts.fail_at - 1 - decision["rollback_to"],
        "dp": [decision["dp_before"], decision["dp_after"]],
        "iteration_s_before": iteration_seconds(workdir, 3, opts.fail_at - 1),
        "iteration_s_after": iteration_seconds(workdir, opts.fail_at + 2, opts.iters),
    }


def print_shrink(s: dict) -> None:
    print(
        f"\nshrink DP{s['dp'][0]} -> DP{s['dp'][1]}: failure -> first iteration "
        f"{s['to_first_iteration_s']:.2f} s, {s['iterations_lost']} iteration(s) lost; "
        f"iteration {s['iteration_s_before']:.3f} s before, {s['iteration_s_after']:.3f} s "
        f"after (throughput ratio {s['iteration_s_before'] / s['iteration_s_after']:.2f})"
    )
