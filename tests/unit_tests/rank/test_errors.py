"""Failures inside a worker are told apart: a peer's is recovered, the
rank's own device failure replaces the rank, anything else stops the job."""

import pytest
import torch
import torch.distributed as dist

from deadpool_ext.rank.errors import Failure, classify, traceback_text
from deadpool_ext.rank.generation import FailureAnnounced
from deadpool_ext.state.mirror import MirrorError

# The messages torch raised when peers died in the fault campaign's runs.
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] "
    "Connection closed by peer [127.0.0.1]:21346"
)
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Read error [127.0.0.1]:4431: Connection reset by peer"
)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(GLOO_CLOSED),
        RuntimeError(GLOO_RESET),
        FailureAnnounced("the coordinator announced generation 2"),
        MirrorError("buddy lost"),
        ConnectionResetError("reset"),
        TimeoutError("waited"),
        dist.DistNetworkError("store gone"),
    ],
)
def test_peer_failures_are_recovered(error):
    assert classify(error) == Failure.PEER


# NCCL's words, as torch's ProcessGroupNCCL raises them (DistBackendError).
NCCL = "NCCL error in: ProcessGroupNCCL.cpp:3200, {}, NCCL version 2.28.9\n{}"
NCCL_REMOTE = NCCL.format(
    "remote process exited or there was a network error",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.",
)
NCCL_CUDA = NCCL.format("unhandled cuda error (run with NCCL_DEBUG=INFO for details)", "")
NCCL_USAGE = NCCL.format(
    "invalid usage (run with NCCL_DEBUG=WARN for details)",
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
    "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000",
)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        MemoryError(),
        dist.DistBackendError(NCCL_CUDA),
    ],
)
def test_the_ranks_own_resource_failures_are_local(error):
    assert classify(error) == Failure.LOCAL


def test_nccl_errors_a_peer_causes_are_recovered_and_misuse_stops_the_job():
    """A lost peer surfaces as NCCL's remote error; NCCL refusing its use
    (two ranks on one GPU) would refuse a spare the same way: a bug."""
    assert classify(dist.DistBackendError(NCCL_REMOTE)) == Failure.PEER
    assert classify(RuntimeError("NCCL communicator was aborted on rank 3.")) == Failure.PEER
    assert classify(dist.DistBackendError(NCCL_USAGE)) == Failure.BUG


@pytest.mark.parametrize(
    "message",
    ["found NaN in local forward loss calculation", "found Inf in local grad norm for bucket #0"],
)
def test_megatron_cores_nan_and_inf_rejections_are_numeric(message):
    """What megatron-core's rerun state machine raises in disabled mode (as a
    run on CPU printed it: test_megatron_flags.py reads it from a real run)."""
    raised = RuntimeError(
        f"Rank 0, node vm, device cpu, iteration 2: Unexpected result nan (message='{message}')"
    )
    assert classify(raised) == Failure.NUMERIC
    assert classify(RuntimeError(f"loss is {message}")) == Failure.BUG  # not its words alone


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x128 and 64x128)"),
        KeyError("iteration"),
        TypeError("unsupported operand"),
        AssertionError(),
        ValueError("bad"),
    ],
)
def test_everything_else_is_a_bug(error):
    """Before, every RuntimeError counted as recoverable: a shape bug was
    'recovered' into a new generation that met it again."""
    assert classify(error) == Failure.BUG


def test_flags_refused_by_a_check_in_the_running_job_are_usage():
    """A check that needs the job (the buddies from the real hostnames):
    the job stops as for flags refused at parse time, not as on a bug."""
    from megatron.training.arguments import ConfigError

    assert classify(ConfigError("--deadpool: two nodes hold uneven rank blocks")) == Failure.USAGE


def test_a_main_ends_bad_flags_with_the_code_the_agents_read_as_usage():
    """pretrain_gpt.py, a Megatron-LM script and deadpool-launch end with
    ConfigError.EXIT_CODE; an agent and the coordinator tell a refusal of
    the flags by ExitCode.USAGE (megatron/training cannot import it)."""
    from megatron.training.arguments import ConfigError

    from deadpool_ext.protocol import ExitCode

    assert ConfigError.EXIT_CODE == ExitCode.USAGE == 2  # argparse's code, as Megatron-LM's


def test_the_whole_traceback_is_kept_as_text():
    def outer():
        middle()

    def middle():
        inner()

    def inner():
        raise RuntimeError("x" * 1000)

    with pytest.raises(RuntimeError) as caught:
        outer()
    text = traceback_text(caught.value)
    assert "x" * 1000 in text
    assert all(f"in {name}" in text for name in ("outer", "middle", "inner"))
