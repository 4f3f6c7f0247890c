"""--rerun-mode, as Megatron-LM: megatron-core's rerun state machine redoes
an iteration whose result failed validation, in place, and the run stops
with its exit code: 17 when the wrong result was not reproducible (a
transient fault), 16 with a checkpoint to resume from elsewhere when it was;
resumed on the same host, it says so and stops with 16 again. Wrong results
come from megatron-core's error injector (--error-injection-rate 1: the
first validation of every iteration)."""

import pytest

from dist_utils import GPT_SHAPE, curve, forkrun, read_metrics
from megatron.training.checkpointing import RERUN_SHARDS, checkpoint_dir, read_tracker

pytestmark = pytest.mark.integration

ITERS = 3


def run(tmp_path, corpus, name, extra=()):
    directory = tmp_path / name
    args = [
        *("--num-layers", "2", *GPT_SHAPE, "--global-batch-size", "4", "--lr", "1e-3"),
        *("--tokenizer-type", "ByteLevelTokenizer", "--data-path", corpus, "--eval-iters", "0"),
        *("--train-iters", str(ITERS), "--use-distributed-optimizer", "--num-workers", "0"),
        *("--save", str(directory / "ckpt"), "--metrics-file", str(directory / "metrics.jsonl")),
        *extra,
    ]
    proc = forkrun(2, args, timeout=240)
    return proc, directory


def rank_exits(proc) -> set:
    return {
        int(line.rsplit(" ", 1)[1])
        for line in proc.stderr.splitlines()
        if line.startswith("forkrun: rank ") and " exited with " in line
    }


def has_machine_state(ckpt) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    index = FileSystemReader(checkpoint_dir(str(ckpt), read_tracker(str(ckpt)))).read_metadata()
    return any(key.startswith(RERUN_SHARDS) for key in index.state_dict_metadata)


def inject(kind):
    return ["--error-injection-rate", "1", "--error-injection-type", kind]


def test_a_reproducible_wrong_result_stops_with_a_checkpoint_to_resume_elsewhere(
    tmp_path, corpus_prefix
):
    proc, directory = run(tmp_path, corpus_prefix, "first", inject("persistent_error"))
    assert proc.returncode != 0 and rank_exits(proc) == {16}, proc.stderr[-4000:]
    assert "unexpected result is reproducible" in proc.stderr
    # Iteration 1 is not validated (megatron-core's rule); 2 is, and is not taken.
    assert len(read_metrics(directory / "metrics.jsonl")) == 1
    ckpt = directory / "ckpt"
    assert read_tracker(str(ckpt)) == "1" and has_machine_state(ckpt)
    # Resumed on the same host: iteration 2 is not rerun here.
    resumed, _ = run(
        tmp_path, corpus_prefix, "again", [*inject("persistent_error"), "--load", str(ckpt)]
    )
    assert rank_exits(resumed) == {16}, resumed.stderr[-4000:]
    assert "Getting RerunStateMachine state from checkpoint" in resumed.stderr
    assert "resume the job from the same checkpoint" in resumed.stderr


def test_a_wrong_result_that_does_not_repeat_fails_the_run(tmp_path, corpus_prefix):
    proc, directory = run(tmp_path, corpus_prefix, "transient", inject("transient_error"))
    assert rank_exits(proc) == {17}, proc.stderr[-4000:]
    assert "Possible transient error" in proc.stderr
    assert read_tracker(str(directory / "ckpt")) == "1"


def test_validation_changes_nothing_while_results_are_right(tmp_path, corpus_prefix):
    """The default (validate_results) with every check on against no
    validation: the same curve; the replicas' weights compared at the start
    and after each iteration. Control: injection is ignored without
    validation, with a warning."""
    hashes = ["--check-weight-hash-across-dp-replicas-interval", "1"]
    validated, a = run(tmp_path, corpus_prefix, "validated", ["--check-for-spiky-loss", *hashes])
    assert validated.returncode == 0, validated.stderr[-4000:]
    assert "RerunMode.VALIDATE_RESULTS" in validated.stderr
    for iteration in range(ITERS + 1):
        assert f">>> Weight hashes match after {iteration} iterations" in validated.stdout
    plain, b = run(
        tmp_path, corpus_prefix, "plain", ["--rerun-mode", "disabled", *inject("persistent_error")]
    )
    assert plain.returncode == 0, plain.stderr[-4000:]
    assert "--error-injection-rate, --error-injection-type have no effect without" in plain.stdout
    first, second = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert len(first) == ITERS and curve(first) == curve(second)


def test_replicas_whose_weights_differ_stop_the_run(monkeypatch):
    """What the run does with megatron-core's verdict (the comparison itself
    is megatron-core's, run above): a difference stops it by name."""
    from types import SimpleNamespace

    from megatron.training import replica_check

    monkeypatch.setattr(
        replica_check, "check_param_hashes_across_dp_replicas", lambda *a, **k: False
    )
    trainer = SimpleNamespace(
        config=SimpleNamespace(parallel=SimpleNamespace(overlap_param_gather=False)),
        progress=SimpleNamespace(iteration=3),
        state=SimpleNamespace(model=[]),
    )
    hook = replica_check.ReplicaHashCheck(interval=2)
    hook.after_step(trainer, {})  # not at an interval: no check
    trainer.progress.iteration = 4
    with pytest.raises(
        RuntimeError, match="differ between data-parallel replicas after iteration 4"
    ):
        hook.after_step(trainer, {})
    with pytest.raises(RuntimeError, match="after iteration 4"):
        hook.on_setup(trainer)  # and at the start, as Megatron-LM
