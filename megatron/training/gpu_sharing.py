"""Several ranks on one GPU: for validating multi-rank NCCL jobs on fewer GPUs than ranks.

Hot swap, shrink and the mirror are validated so on a single-GPU machine.
Never a default, and never for a real cluster, where each rank has a GPU of
its own: a job turns it on with the environment, which torchrun and
deadpool-launch pass to every rank.

``DEADPOOL_SHARE_GPU``:

- ``hostid``: each process gives NCCL a host id of its own
  (``NCCL_HOSTID``). NCCL refuses two ranks of a communicator on one GPU
  only when their host hash and bus id are both equal ("Duplicate GPU
  detected"), and the host hash is taken from ``NCCL_HOSTID`` when it is
  set, so the ranks look like ranks on different hosts and talk through
  NCCL's socket transport on the loopback interface. Works with any NCCL.
- ``multi-rank``: NCCL 2.30's experimental ``NCCL_MULTI_RANK_GPU_ENABLE``
  (several ranks of one communicator on one GPU, over its own transports;
  NVLS off, as it requires).

Either way rank ``LOCAL_RANK`` uses GPU ``LOCAL_RANK % device_count``, and
``DEADPOOL_GPU_MEMORY_FRACTION`` caps each process's share of the GPU's
memory (torch's per-process memory fraction). Variables the user set
already are left as they are.
"""

import os
import socket
from typing import Dict, Mapping, Optional, Tuple

SHARE_ENV = "DEADPOOL_SHARE_GPU"
MEMORY_FRACTION_ENV = "DEADPOOL_GPU_MEMORY_FRACTION"
HOSTID, MULTI_RANK = "hostid", "multi-rank"
MODES = (HOSTID, MULTI_RANK)
MULTI_RANK_SINCE = (2, 30, 0)  # the NCCL release that brought it


def sharing_mode(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The mode asked for, or None (one GPU per rank). A wrong value is a
    usage error, raised as ValueError naming the choices."""
    mode = environ.get(SHARE_ENV) or None
    if mode is not None and mode not in MODES:
        raise ValueError(f"{SHARE_ENV}={mode}: choose one of {', '.join(MODES)}, or leave it unset")
    return mode


def memory_fraction(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    text = environ.get(MEMORY_FRACTION_ENV)
    if not text:
        return None
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{MEMORY_FRACTION_ENV}={text}: give a number in (0, 1]")
    return fraction


def device_index(local_rank: int, device_count: int, mode: Optional[str]) -> int:
    """The GPU of a rank: its local rank, or with sharing that modulo the GPUs."""
    if mode is not None:
        return local_rank % device_count
    if local_rank >= device_count:
        raise ValueError(
            f"local rank {local_rank} has no GPU of its own ({device_count} visible): start "
            f"at most {device_count} ranks per node (--nproc-per-node), or set "
            f"{SHARE_ENV}=hostid to share GPUs (tests only)"
        )
    return local_rank


def nccl_environment(
    mode: Optional[str], nccl_version: Tuple[int, ...], process: Optional[str] = None
) -> Dict[str, str]:
    """What NCCL must read for ``mode`` in this process (``process``: a name
    no other process on the machine has; by default host and pid)."""
    if mode == HOSTID:
        return {
            "NCCL_HOSTID": process or f"{socket.gethostname()}-{os.getpid()}",
            "NCCL_SOCKET_IFNAME": "lo",  # NCCL leaves loopback out by default
            "NCCL_IB_DISABLE": "1",
        }
    if mode == MULTI_RANK:
        if tuple(nccl_version) < MULTI_RANK_SINCE:
            raise ValueError(
                f"{SHARE_ENV}={MULTI_RANK} needs NCCL 2.30 or later, and torch loads "
                f"{'.'.join(map(str, nccl_version))}: use {SHARE_ENV}={HOSTID}, or load a "
                "newer libnccl"
            )
        return {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    return {}


def apply(local_rank: int, environ=os.environ) -> int:
    """Pick this rank's GPU and set NCCL up for the sharing asked for,
    before anything creates a communicator. Returns the GPU's index."""
    import torch

    mode = sharing_mode(environ)
    index = device_index(local_rank, torch.cuda.device_count(), mode)
    torch.cuda.set_device(index)
    version = torch.cuda.nccl.version() if mode == MULTI_RANK else ()
    for name, value in nccl_environment(mode, version).items():
        environ.setdefault(name, value)
    fraction = memory_fraction(environ)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    return index
