"""Why ranks keep gloo's full mesh: torch's ``TORCH_GLOO_LAZY_INIT=1``
(connect a pair of ranks on first use) sometimes never completes a pair.

The mirror's traffic, alone: ``--ranks`` gloo processes, each with a
two-rank group per (owner, buddy) pair, buddy = rank + ``--step``; a
thread of each rank sends 1 MB to its buddy and receives from its owner
while the main thread all-reduces over the world. Each trial runs once
with pairs connected on first use and once with the full mesh made with
each group; a rank whose exchange has not finished after ``--wait-s`` is
hung (torch 2.13's gloo waits in ``Pair::waitUntilConnected``).

    python -m tools.probes.gloo_lazy_pairs --ranks 16 --trials 12

Figures: docs/benchmarks.md ("Pairs connected on first use").
"""

import argparse
import os
import subprocess
import sys
import threading

from deadpool_ext.control.ports import free_port

LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # torch's


def exchange(rank: int, world: int, step: int, wait_s: float) -> bool:
    """One rank's part; whether its exchange finished within ``wait_s``."""
    import torch
    import torch.distributed as dist

    pairs = {}
    for owner in range(world):  # every rank makes every pair, in order
        pair = tuple(sorted((owner, (owner + step) % world)))
        if pair not in pairs:
            pairs[pair] = dist.new_group(list(pair))
    buddy, owner = (rank + step) % world, (rank - step) % world
    to_buddy, from_owner = pairs[tuple(sorted((rank, buddy)))], pairs[tuple(sorted((owner, rank)))]

    def send_and_receive() -> None:
        received = torch.zeros(250_000)
        receive = dist.irecv(received, owner, group=from_owner)
        dist.isend(torch.ones(250_000), buddy, group=to_buddy).wait()
        receive.wait()

    thread = threading.Thread(target=send_and_receive, daemon=True)
    thread.start()
    dist.all_reduce(torch.ones(10))  # the main thread's own traffic meanwhile
    thread.join(timeout=wait_s)
    return not thread.is_alive()


def worker(rank: int, world: int, port: int, step: int, wait_s: float) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    print("done" if exchange(rank, world, step, wait_s) else "hung", flush=True)


def trial(opts, lazy: bool) -> int:
    """How many ranks hung in one trial."""
    port = free_port()
    env = {**os.environ, LAZY_ENV: "1" if lazy else "0"}
    command = [sys.executable, "-m", "tools.probes.gloo_lazy_pairs", "--worker"]
    procs = [
        subprocess.Popen(
            [*command, str(rank), str(port), *vars_of(opts)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(opts.ranks)
    ]
    return sum(outcome(p, opts.wait_s + 120) != "done" for p in procs)


def outcome(proc: subprocess.Popen, timeout_s: float) -> str:
    """What a rank printed; "hung" when its main thread never got to say
    (killed then, so that no rank of a trial outlives it)."""
    try:
        return proc.communicate(timeout=timeout_s)[0].strip()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "hung"


def vars_of(opts) -> list:
    return ["--ranks", str(opts.ranks), "--step", str(opts.step), "--wait-s", str(opts.wait_s)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--step", type=int, default=4, help="buddy = rank + step (a node's ranks)")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--wait-s", type=float, default=60.0)
    p.add_argument("--worker", nargs=2, type=int, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if not 0 < opts.step < opts.ranks:
        p.error(f"--step {opts.step}: a buddy is another rank, so 0 < step < --ranks")
    if opts.worker:
        worker(opts.worker[0], opts.ranks, opts.worker[1], opts.step, opts.wait_s)
        os._exit(0)  # a hung exchange's thread would hold the exit
    hung = {True: [], False: []}
    for number in range(1, opts.trials + 1):
        for lazy in (True, False):
            hung[lazy].append(trial(opts, lazy))
            mode = "lazy" if lazy else "eager"
            print(f"trial {number}, {mode}: {hung[lazy][-1]} hung", flush=True)
    print("\n| pairs connected | trials | trials with a hung rank | ranks hung |")
    print("|---|---|---|---|")
    for lazy in (True, False):
        counts = hung[lazy]
        label = "on first use (TORCH_GLOO_LAZY_INIT=1)" if lazy else "when the group is made"
        print(f"| {label} | {len(counts)} | {sum(c > 0 for c in counts)} | {sum(counts)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
