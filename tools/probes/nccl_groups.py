"""What one GPU says about NCCL communicators, for the recovery model of
docs/scale.md section 3 (issue 22): whether the installed torch and NCCL
can shrink a communicator in place, and what creating one costs a rank
locally (its buffers, proxy thread and streams; one GPU cannot host two
NCCL ranks, so no network part).

    python -m tools.probes.nccl_groups [--groups 20]

Prints one JSON object: versions, ``supports_shrinking`` and
``supports_splitting`` of the NCCL backend, and the milliseconds of each
new one-rank group made eagerly, split from the default communicator (what
torch does when the default group is bound to a device) and not split.
"""

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def backend_flags(group) -> dict:
    backend = group._get_backend(torch.device("cuda"))
    return {
        name: bool(getattr(backend, name, False))
        for name in ("supports_splitting", "supports_shrinking", "supports_coalescing")
    }


def timed_groups(count: int, **options) -> list:
    """Milliseconds per group: made, then its first all-reduce (NCCL makes a
    communicator lazily unless the group is bound to a device)."""
    times = []
    x = torch.ones(1, device="cuda")
    for _ in range(count):
        torch.cuda.synchronize()
        start = time.perf_counter()
        group = dist.new_group([0], backend="nccl", **options)
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        dist.destroy_process_group(group)
    return times


def summary(times: list) -> dict:
    return {
        "first_ms": round(times[0], 2),
        "median_ms": round(statistics.median(times[1:]), 2),
        "max_ms": round(max(times[1:]), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=20)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    start = time.perf_counter()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0")
    )
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    default_ms = (time.perf_counter() - start) * 1e3
    result = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(0),
        "shrink_group_in_torch": hasattr(dist, "shrink_group"),
        "default_group_ms": round(default_ms, 2),
        **backend_flags(dist.group.WORLD),
        "split_from_default": summary(timed_groups(args.groups, device_id=torch.device("cuda:0"))),
        "not_split": summary(timed_groups(args.groups)),
        "NCCL_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    print(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
