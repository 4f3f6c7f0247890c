"""Run megatron-core on a CPU-only PyTorch build, with gloo.

megatron-core assumes CUDA in a handful of places even on code paths that
do no GPU work: it asks for ``torch.cuda.current_device()``, calls
``torch.cuda.synchronize()``, creates tensors with ``device="cuda"``,
dispatches on ``Tensor.type()`` strings such as ``torch.cuda.FloatTensor``
and keeps its dropout RNG streams in the CUDA generator; its all-to-all
MoE dispatcher copies token counts to the host on a side CUDA stream. This
module maps each of those to the CPU. (Where megatron-core mishandles
torch's own Adam, which it runs without Apex or Transformer Engine on a GPU
as on a CPU, optimizer_layout.py fixes it for both.)

It is enabled explicitly (``enable()``) and only when CUDA is absent, or
when a test asks for it with ``force=True``. A GPU run never touches it:
``is_active()`` says whether it is on, and the GPU validation asserts it
is not.

Why patching and not a ``TorchFunctionMode``: a mode sees every torch call
and costs 10-25% per iteration on small models; the handful of patched
entry points below give identical results at no measurable cost.
"""

import functools
import threading

import torch

_ACTIVE = False
_LOCK = threading.Lock()

# Factories that megatron-core calls with device="cuda" (or the current
# device). Everything else gets CPU tensors by default already.
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "as_tensor",
    "linspace",
    "empty_strided",
)

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def is_active() -> bool:
    """True when the CPU mapping is in force in this process."""
    return _ACTIVE


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare int means a CUDA ordinal to torch


def _to_cpu_device(kwargs):
    if _is_cuda(kwargs.get("device")):
        kwargs["device"] = "cpu"
    return kwargs


def _wrap_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        return fn(*args, **_to_cpu_device(kwargs))

    return factory


def _tensor_type(orig):
    @functools.wraps(orig)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        # The distributed optimizer dispatches on these names; answer as a
        # CUDA tensor would so CPU tensors take the same branches.
        if dtype is None and not kwargs:
            return _CUDA_TYPE_NAMES.get(self.dtype, orig(self))
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return orig(self, dtype, non_blocking, **kwargs)

    return type_


def _tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda_arg(a) else a for a in args)
        return orig(self, *args, **_to_cpu_device(kwargs))

    return to


def _is_cuda_arg(arg) -> bool:
    if isinstance(arg, torch.device):
        return arg.type == "cuda"
    return isinstance(arg, str) and arg.startswith("cuda")


def _patch_torch_cuda():
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device=None: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # Dropout streams live in the "CUDA" generator: map them to the CPU one
    # so the model-parallel RNG tracker really switches streams.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = cuda.manual_seed
    cuda.empty_cache = lambda: None


class _HostStream:
    """The one 'stream' of a CPU: work is done when its call returns, so
    waiting and synchronising are no-ops. megatron-core's all-to-all MoE
    dispatcher copies token counts to the host on a side stream."""

    def wait_stream(self, stream) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, event=None) -> "_HostStream":
        return self  # an event that has happened

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_HostStream":
        return self

    def __exit__(self, *exc) -> None: ...


_HOST_STREAM = _HostStream()


def _patch_cuda_streams():
    cuda = torch.cuda
    # One stream for all: a "side" stream equals the current one, so
    # megatron-core never asks a CPU tensor to record a stream.
    cuda.Stream = lambda *args, **kwargs: _HOST_STREAM
    cuda.current_stream = lambda device=None: _HOST_STREAM
    cuda.stream = lambda stream=None: _HOST_STREAM


def _patch_moe_host_copies():
    """megatron-core's all-to-all MoE dispatcher copies its split sizes to
    the host as numpy arrays, which torch's all_to_all_single takes; a
    tensor already on the host is left a tensor, which it refuses. On a CPU
    every tensor is on the host: give the numpy array a GPU run gets."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _patch_megatron_rng():
    from megatron.core.tensor_parallel import random as mcore_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        # megatron's version queues a lazy CUDA call that never runs on a
        # CPU build, which would silently make dropout streams a no-op.
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state


def _patch_tensor():
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))


def define_missing_te_names() -> None:
    """Where megatron-core 0.16 takes Transformer Engine for there without it
    (on a CPU, or a GPU without TE). Its MoE router asks ``te_general_gemm
    is not None``, a name its module defines only when TE imports: every MoE
    forward raises NameError; defined as None, the router takes its own
    torch.mm path. Not CPU-only: setup_device calls this on every run."""
    from megatron.core.extensions import transformer_engine as te_layers
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Multi-latent attention takes Transformer Engine for there when the
    # module of its layers imports, which it does without TE too (its layer
    # classes then mocks): isinstance against them fails at model build.
    if not te_layers.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def enable(force: bool = False) -> bool:
    """Map megatron-core's CUDA calls to the CPU. Returns whether it is on.

    Does nothing when CUDA is available, unless ``force`` is set (tests and
    ``--cpu``). Idempotent.
    """
    global _ACTIVE
    with _LOCK:
        if _ACTIVE:
            return True
        if torch.cuda.is_available() and not force:
            return False
        _patch_torch_cuda()
        _patch_cuda_streams()
        _patch_tensor()
        _patch_megatron_rng()
        _patch_moe_host_copies()
        _quiet_rng_warning()
        _ACTIVE = True
        return True


class _DropCpuRngWarning:
    """On CPU the 'GPU' dropout stream *is* the CPU generator, so megatron's
    check that forking the tracker left the CPU stream alone always fires."""

    def filter(self, record) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _quiet_rng_warning():
    import logging

    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropCpuRngWarning())


def import_megatron_core_without_cuda() -> None:
    """Import megatron-core as a run without CUDA uses it, leaving out two
    costs of its import that such a run never uses: its fused functions are
    wrapped with ``torch.compile`` (``megatron.core.jit.jit_fuser``), which
    builds TorchInductor's backend in every process, and its inference
    context imports wandb. Together they are 3-5 s of each rank's start on
    2 cores, more than the rest of megatron-core.

    Here the fuser is the identity: the fusions are off without CUDA
    (``model_setup.transformer_config``), and the few compiled helpers that
    still run (the MoE router's and experts') run eagerly, as the rest of
    the model; the inference context sees no wandb (training logs to W&B
    through ``dashboards``, which imports it itself). Does nothing where
    CUDA is available or megatron-core is already imported: call it first
    thing in a rank's process."""
    import sys

    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return
    compile_, hidden = torch.compile, "wandb" not in sys.modules
    torch.compile = _eager
    if hidden:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_
        if hidden:
            del sys.modules["wandb"]


def _eager(model=None, **options):
    """torch.compile's signature, compiling nothing."""
    return model if model is not None else _eager
