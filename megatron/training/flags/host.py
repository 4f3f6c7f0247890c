"""What this machine offers a run, as the flag checks ask: a GPU,
optional packages and their versions, writable paths, and megatron-core
imported the way a rank imports it.

The checks call these through the module (``host.importable(...)``), so
that a planning tool or a test that parses for another machine replaces
them here, in one place.
"""

import os
import re
from typing import Optional, Tuple

from megatron.training.config import Config


def cuda_available() -> bool:
    """Whether a GPU is there. Where the NVIDIA driver has no device (a CPU
    machine) torch is not even imported: a refusal then takes a fraction of
    a second, not the seconds of torch's import."""
    if not _gpu_devices_present():
        return False
    import torch

    return torch.cuda.is_available()


def _gpu_devices_present() -> bool:
    """The NVIDIA driver's device files (or WSL's GPU device)."""
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def gpu_count() -> int:
    """GPUs this process sees."""
    import torch

    return torch.cuda.device_count()


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def package_version(name: str) -> Optional[Tuple[int, ...]]:
    """An installed package's version as numbers (major, minor), or None."""
    from importlib import metadata

    try:
        numbers = re.findall(r"\d+", metadata.version(name))
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(n) for n in numbers[:2])


def uses_transformer_engine(config: Config) -> bool:
    """Whether the run's layers are Transformer Engine's: asked for, or by
    default on a GPU where its package is installed."""
    m = config.model
    return m.transformer_impl == "transformer_engine" or (
        m.transformer_impl == "auto"
        and config.parallel.distributed_backend == "nccl"
        and importable("transformer_engine")
    )


def can_create(path: str) -> bool:
    """Whether ``path`` is, or can be made, a writable directory: checked up
    front, so that a save does not fail hours into a run."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def can_append(path: str) -> bool:
    if os.path.exists(path):
        return os.path.isfile(path) and os.access(path, os.W_OK)
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


def import_with_megatron_core(module: str):
    """A module of ours that imports megatron-core, imported the way a rank
    imports it (cpu_compat: without CUDA, none of the costs a CPU run never
    uses). The checks that need one run last: every other refusal comes
    before megatron-core is imported (a second or more)."""
    import importlib

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core_without_cuda()
    return importlib.import_module(module)
