"""torchrun for the tests, with ranks forked from one zygote.

    python -u forkrun.py NPROC script.py ARGS...

runs ``script.py ARGS`` on NPROC ranks of this host with the variables
``torchrun --standalone --nproc-per-node NPROC`` gives a rank for
torch.distributed's ``env://`` rendezvous (rank 0 hosts the store, where
torchrun's own process does), and ends as torchrun does: 0 when every rank
ended with 0, else 1 once the others are stopped.

Why: a rank spends about 6 s of CPU importing torch and megatron-core, so
an 8-rank run on 2 cores spends some 25 s of its start on imports. Forked
from deadpool-launch's zygote (``deadpool_ext.control.zygote``) the ranks
share one import, and train bit for bit as started ones do (test_hot_swap
compares a started job with forked references; test_forkrun compares this
with torchrun). Tests that check what torchrun itself does (its exit on a
signal) run torchrun.
"""

import os
import sys
import time
from typing import Dict, List

from deadpool_ext.control.ports import free_port
from deadpool_ext.control.zygote import Zygote

# How long the other ranks get to end after SIGTERM when one has failed.
STOP_GRACE_S = 10.0


def rank_env(rank: int, nproc: int, port: int) -> Dict[str, str]:
    """What torchrun sets for a rank of a one-node job."""
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
    }


def wait_for(zygote: Zygote, workers: List) -> int:
    """Wait until every rank ended, or one failed and the rest are stopped;
    the job's exit code as torchrun's."""
    stop_by = None
    while any(w.returncode is None for w in workers):
        for _ in zygote.messages(timeout_s=0.2):
            pass
        failed = [(rank, w) for rank, w in enumerate(workers) if w.returncode not in (None, 0)]
        if failed and stop_by is None:
            rank, worker = failed[0]
            print(f"forkrun: rank {rank} exited with {worker.returncode}", file=sys.stderr)
            for other in workers:
                other.terminate()
            stop_by = time.monotonic() + STOP_GRACE_S
        if stop_by is not None and time.monotonic() > stop_by:
            for other in workers:
                other.kill()
    return 0 if all(w.returncode == 0 for w in workers) else 1


def main() -> int:
    nproc, command = int(sys.argv[1]), [sys.executable, "-u", *sys.argv[2:]]
    # First, before this process has a thread or a connection (Zygote.fork).
    zygote = Zygote.fork(command)
    if zygote is None:  # the zygote after this process hung up, or a worker whose script returned
        return 0
    port = free_port()
    workers = [zygote.spawn(rank_env(rank, nproc, port), lambda: None) for rank in range(nproc)]
    try:
        return wait_for(zygote, workers)
    finally:
        zygote.close()


if __name__ == "__main__":
    # Killed, this process takes the zygote along, and the zygote its ranks
    # (each dies with its parent).
    sys.exit(main())
