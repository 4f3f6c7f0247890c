"""Recovery from a lost node, side by side on the demo workload (TP2 PP2 DP2
on two emulated 4-rank nodes), in one run:

  (a) hot swap: deadpool-launch with one warm spare node, node 1 killed in
      iteration --fail-at;
  (b) checkpoint-restart, Megatron style: torchrun with --save every
      --save-interval iterations; the same node's four ranks are SIGKILLed at
      the same point, the job fails, and is started again at once (as a
      scheduler's requeue would, minus the queue) with --load: every process
      restarts and training resumes from the last checkpoint. (torchrun's
      own --max-restarts cannot restart gloo jobs here: the new attempt
      reads the old attempt's gloo addresses from the store and fails.)
  (c) failure-free, through deadpool-launch;
  (d) shrink: deadpool-launch with no spare node, the same node killed at
      the same point; the job goes on as DP1 (``tools/bench_shrink.py``,
      which also runs a trace of several failures against checkpoint-restart).

Reported: time from the failure to the first completed iteration after it
(with the hot swap's breakdown), time until the job is back at the
iteration it was in, iterations lost (redone), and total time to finish.

    python tools/bench_recovery.py [--iters 40] [--fail-at 25] [--save-interval 10]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_ext.events import read_events  # noqa: E402
from tools.bench_training import REPO, demo_args, strip_outputs  # noqa: E402
from tools.recovery_timeline import recoveries, stage_seconds  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
NODE_RANKS = (4, 5, 6, 7)  # node 1 of two 4-rank nodes


def workload(opts, workdir: str) -> List[str]:
    return strip_outputs(demo_args()) + [
        "--use-tp-pp-dp-mapping", "--train-iters", str(opts.iters), "--eval-iters", "0",
        "--metrics-file", os.path.join(workdir, "metrics.jsonl")]


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
        return next((t for t, i in self.seen if t > moment
                     and (iteration is None or i >= iteration)), None)


def run(command: List[str], watch: MetricsWatch, on_poll=None, check: bool = True) -> float:
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
            raise SystemExit(f"bench run failed ({proc.returncode}): {' '.join(command)}\n"
                             f"{out.read()[-5000:]}")
    return time.time() - start


def launcher(args: List[str]) -> List[str]:
    return [sys.executable, "-m", "deadpool_ext.launch", "--standalone", "--nnodes", "2",
            "--spare-nodes", "1", "--nproc-per-node", "4",
            os.path.join(REPO, "pretrain_gpt.py"), *args]


def hot_swap(opts, workdir: str, fault: bool) -> dict:
    events = os.path.join(workdir, "events.jsonl")
    args = workload(opts, workdir) + ["--deadpool", "--deadpool-events", events]
    if fault:
        args.append(f"--deadpool-inject=kill:node=1:iter={opts.fail_at}")
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    total = run(launcher(args), watch)
    result = {"total_s": total}
    if fault:
        record = recoveries(read_events(events))[0]
        failed = record["marks"]["fault"]
        result.update(
            to_first_iteration_s=record["marks"]["first_iteration_after_recovery"] - failed,
            back_at_failed_iteration_s=watch.first_after(failed, opts.fail_at) - failed,
            iterations_lost=opts.fail_at - 1 - record["rollback_to"],
            breakdown_ms={label: round(s * 1e3) for label, s in stage_seconds(record)})
    return result


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


def checkpoint_restart(opts, workdir: str) -> dict:
    save = os.path.join(workdir, "checkpoints")
    args = workload(opts, workdir) + ["--save", save, "--load", save,
                                      "--save-interval", str(opts.save_interval)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "8", "--monitor-interval", "0.1",
               os.path.join(REPO, "pretrain_gpt.py"), *args]
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    killed = []

    def kill_node(torchrun) -> None:
        done = [i for _, i in watch.seen]
        if not killed and done and done[-1] >= opts.fail_at - 1:
            time.sleep(0.3)  # into iteration fail_at, like the injected kill
            pids = worker_pids(torchrun.pid)
            killed.append(time.time())
            for rank in NODE_RANKS:
                os.kill(pids[rank], signal.SIGKILL)

    total = run(command, watch, kill_node, check=False)
    total += run(command, watch)  # the restarted job
    failed = killed[0]
    last_saved = (opts.fail_at - 1) // opts.save_interval * opts.save_interval
    return {"total_s": total,
            "to_first_iteration_s": watch.first_after(failed) - failed,
            "back_at_failed_iteration_s": watch.first_after(failed, opts.fail_at) - failed,
            "iterations_lost": opts.fail_at - 1 - last_saved}


def shrink(opts, workdir: str) -> dict:
    from tools.bench_shrink import one_shrink  # it builds on this module
    return one_shrink(opts, workdir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--fail-at", type=int, default=25)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--output", help="Also write the results as JSON here.")
    p.add_argument("--only", nargs="+", choices=["failure_free", "hot_swap",
                                                 "checkpoint_restart", "shrink"],
                   help="A subset.")
    opts = p.parse_args(argv)
    results = {}
    runs = [("failure_free", lambda d: hot_swap(opts, d, fault=False)),
            ("hot_swap", lambda d: hot_swap(opts, d, fault=True)),
            ("checkpoint_restart", lambda d: checkpoint_restart(opts, d)),
            ("shrink", lambda d: shrink(opts, d))]
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in runs:
            if opts.only and name not in opts.only:
                continue
            workdir = os.path.join(tmp, name)
            os.makedirs(workdir)
            results[name] = fn(workdir)
            print(name, json.dumps(results[name]), flush=True)
    if len(results) < len(runs):
        return 0
    hs, cr = results["hot_swap"], results["checkpoint_restart"]
    print(f"\nfailure -> first iteration: hot swap {hs['to_first_iteration_s']:.2f} s, "
          f"checkpoint-restart {cr['to_first_iteration_s']:.2f} s "
          f"({cr['to_first_iteration_s'] / hs['to_first_iteration_s']:.1f}x)")
    print(f"failure -> back at iteration {opts.fail_at}: hot swap "
          f"{hs['back_at_failed_iteration_s']:.2f} s, checkpoint-restart "
          f"{cr['back_at_failed_iteration_s']:.2f} s "
          f"({cr['back_at_failed_iteration_s'] / hs['back_at_failed_iteration_s']:.1f}x)")
    print(f"iterations lost: hot swap {hs['iterations_lost']}, checkpoint-restart "
          f"{cr['iterations_lost']}; total time: failure-free "
          f"{results['failure_free']['total_s']:.1f} s, hot swap {hs['total_s']:.1f} s, "
          f"checkpoint-restart {cr['total_s']:.1f} s")
    from tools.bench_shrink import print_shrink
    print_shrink(results["shrink"])
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"options": vars(opts), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
