"""What destroying a gloo group costs, and whether a thread can take it.

Two processes make ``--groups`` two-rank gloo groups, use each once, then
time dropping them (torch's registry first, then the last reference: the
C++ destructor runs then):

* ``torch``: groups made by ``torch.distributed.new_group``, which gives
  every group a transport device of its own (its own event loop thread);
* ``shared device``: ``ProcessGroupGloo`` built directly on one device for
  all groups (torch's ``new_group`` has no way to ask for that).

It also drops the torch-made groups from a second thread while the main
thread counts in Python, and adds up the main thread's gaps: whether the
destructors hold the GIL while they wait for their threads.

    python -m tools.probes.gloo_teardown --groups 20

Figures: docs/benchmarks.md ("Destroying the old groups").
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from deadpool_ext.control.ports import free_port


def made_by_torch(count: int) -> list:
    import torch.distributed as dist

    return [dist.new_group([0, 1]) for _ in range(count)]


def on_shared_device(count: int, store, rank: int) -> list:
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    device = ProcessGroupGloo.create_default_device()
    groups = []
    for number in range(count):
        options = ProcessGroupGloo._Options()  # torch's defaults (2 threads, 30 min)
        options._devices = [device]
        prefixed = dist.PrefixStore(f"shared/{number}/", store)
        groups.append(ProcessGroupGloo(prefixed, rank, 2, options))
    return groups


def use(groups: list) -> None:
    import torch

    for group in groups:
        group.allreduce([torch.ones(1)]).wait()


def drop(groups: list) -> None:
    """Out of torch's registry (where new_group put them), then the last
    references: their destructors run here."""
    import torch.distributed as dist

    for group in groups:
        if isinstance(group, dist.ProcessGroup):
            dist.destroy_process_group(group)
    groups.clear()


def drop_ms(groups: list) -> float:
    """Per group: the time ``drop`` takes."""
    count, start = len(groups), time.monotonic()
    drop(groups)
    return (time.monotonic() - start) * 1e3 / count


def stalls(groups: list) -> dict:
    """While another thread drops the groups: how long that took, and the
    main thread's longest gap and all its gaps over 1 ms, added up."""
    done = threading.Event()

    def reap() -> None:
        drop(groups)
        done.set()

    reaper = threading.Thread(target=reap)
    longest = stalled = 0.0
    start = last = time.monotonic()
    reaper.start()
    while not done.is_set():
        now = time.monotonic()
        gap, last = now - last, now
        longest = max(longest, gap)
        stalled += gap if gap > 1e-3 else 0.0
    reaper.join()
    took = time.monotonic() - start
    return {"reap": took * 1e3, "longest": longest * 1e3, "stalled": stalled * 1e3}


def worker(rank: int, port: int, count: int) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    out = {}
    groups = made_by_torch(count)
    use(groups)
    out["torch"] = drop_ms(groups)
    groups = on_shared_device(count, store, rank)
    use(groups)
    out["shared device"] = drop_ms(groups)
    groups = made_by_torch(count)
    use(groups)
    out.update(stalls(groups))
    dist.barrier()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=20)
    p.add_argument("--worker", nargs=2, type=int, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.groups < 1:
        p.error("--groups: at least 1")
    if opts.worker:
        print(json.dumps(worker(*opts.worker, opts.groups)), flush=True)
        os._exit(0)
    port = free_port()
    command = [sys.executable, "-m", "tools.probes.gloo_teardown", "--groups", str(opts.groups)]
    procs = [
        subprocess.Popen([*command, "--worker", str(rank), str(port)], stdout=subprocess.PIPE)
        for rank in range(2)
    ]
    results = [json.loads(proc.communicate(timeout=600)[0]) for proc in procs]
    print(f"{opts.groups} two-rank gloo groups, each used once; rank 0 / rank 1")
    print("| | ms |\n|---|---|")
    rows = (
        ("destroy a group made by new_group (device of its own)", "torch"),
        ("destroy a group on a shared device", "shared device"),
        ("another thread destroys them all (torch's): its time", "reap"),
        ("... the main thread's gaps over 1 ms, added up", "stalled"),
        ("... the main thread's longest gap", "longest"),
    )
    for label, key in rows:
        print(f"| {label} | {' / '.join(f'{r[key]:.1f}' for r in results)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
