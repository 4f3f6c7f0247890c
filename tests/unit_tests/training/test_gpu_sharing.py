"""Several ranks on one GPU for test jobs (megatron/training/gpu_sharing.py):
off unless asked for, each rank's GPU, NCCL's settings per mode, and the
memory fraction. The refusal at parse time is
tests/unit_tests/training/flags/test_parallel.py's."""

import pytest
import torch

from megatron.training import gpu_sharing
from megatron.training.gpu_sharing import HOSTID, MULTI_RANK, SHARE_ENV


def test_off_unless_asked_for():
    assert gpu_sharing.sharing_mode({}) is None
    assert gpu_sharing.nccl_environment(None, (2, 28, 9)) == {}
    assert gpu_sharing.device_index(3, 4, None) == 3
    with pytest.raises(ValueError, match=f"--nproc-per-node.*{SHARE_ENV}=hostid"):
        gpu_sharing.device_index(1, 1, None)


def test_a_shared_gpu_is_the_local_rank_modulo_the_gpus():
    assert [gpu_sharing.device_index(r, 1, HOSTID) for r in range(4)] == [0, 0, 0, 0]
    assert [gpu_sharing.device_index(r, 2, MULTI_RANK) for r in range(4)] == [0, 1, 0, 1]


def test_each_process_is_its_own_host_to_nccl():
    a = gpu_sharing.nccl_environment(HOSTID, (2, 28, 9), process="h-1")
    b = gpu_sharing.nccl_environment(HOSTID, (2, 28, 9), process="h-2")
    assert a["NCCL_HOSTID"] != b["NCCL_HOSTID"]
    assert a["NCCL_SOCKET_IFNAME"] == "lo" and a["NCCL_IB_DISABLE"] == "1"
    default = gpu_sharing.nccl_environment(HOSTID, (2, 28, 9))["NCCL_HOSTID"]
    assert default.endswith(f"-{__import__('os').getpid()}")


def test_multi_rank_needs_nccl_2_30():
    with pytest.raises(ValueError, match="needs NCCL 2.30.*loads 2.28.9.*=hostid"):
        gpu_sharing.nccl_environment(MULTI_RANK, (2, 28, 9))
    env = gpu_sharing.nccl_environment(MULTI_RANK, (2, 30, 7))
    assert env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}


@pytest.mark.parametrize("value", ["0", "1.5", "half"])
def test_a_memory_fraction_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="give a number in"):
        gpu_sharing.memory_fraction({gpu_sharing.MEMORY_FRACTION_ENV: value})
    assert gpu_sharing.memory_fraction({gpu_sharing.MEMORY_FRACTION_ENV: "0.25"}) == 0.25


def test_apply_sets_the_device_and_leaves_what_the_user_set(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("device", i))
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda f, i: calls.setdefault("fraction", (f, i)),
    )
    environ = {
        SHARE_ENV: HOSTID,
        "NCCL_SOCKET_IFNAME": "eth9",
        "DEADPOOL_GPU_MEMORY_FRACTION": "0.1",
    }
    assert gpu_sharing.apply(3, environ) == 0
    assert calls == {"device": 0, "fraction": (0.1, 0)}
    assert environ["NCCL_SOCKET_IFNAME"] == "eth9" and "NCCL_HOSTID" in environ
