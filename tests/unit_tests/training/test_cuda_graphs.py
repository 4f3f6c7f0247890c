"""Transformer Engine's CUDA graphs as a trainer hook
(megatron/training/cuda_graphs.py), with stand-ins for what only a GPU
has: captured after the warmup, once, and deleted at the end."""

import types

import pytest

from megatron.training import cpu_compat

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.training.cuda_graphs import CudaGraphHook  # noqa: E402


class _Chunk:
    def __init__(self, log):
        self.log = log

    def disable_forward_pre_hook(self, param_sync=True):
        self.log.append(("disable", param_sync))

    def enable_forward_pre_hook(self):
        self.log.append("enable")


class _Helper:
    def __init__(self, log):
        self.log, self.created = log, False

    def graphs_created(self):
        return self.created

    def create_cudagraphs(self):
        self.log.append("capture")
        self.created = True

    def cuda_graph_set_manual_hooks(self):
        self.log.append("manual hooks")

    def delete_cuda_graphs(self):
        self.log.append("delete")


def _trainer(iteration, warmup, overlap, log):
    gpu = types.SimpleNamespace(cuda_graph_warmup_steps=warmup)
    parallel = types.SimpleNamespace(overlap_param_gather=overlap)
    return types.SimpleNamespace(
        progress=types.SimpleNamespace(iteration=iteration),
        config=types.SimpleNamespace(gpu=gpu, parallel=parallel),
        state=types.SimpleNamespace(model=[_Chunk(log), _Chunk(log)]),
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_the_graphs_are_captured_after_the_warmup_once_and_deleted_at_the_end(overlap):
    log = []
    hook = CudaGraphHook()
    hook.helper, hook.start_iteration = _Helper(log), 5  # resumed at iteration 5
    for iteration in range(5, 10):
        hook.before_step(_trainer(iteration, warmup=2, overlap=overlap, log=log))
        log.append(iteration)
    hook.on_train_end(_trainer(10, 2, overlap, log))
    around = [("disable", False), ("disable", False), "capture", "enable", "enable"]
    captured = (around + ["manual hooks"]) if overlap else ["capture"]
    assert log == [5, 6, *captured, 7, 8, 9, "delete"]
