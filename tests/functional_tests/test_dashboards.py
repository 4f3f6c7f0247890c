"""TensorBoard and W&B (offline) as a Megatron-LM user reads them: the
last rank's scalars under Megatron-LM's names, equal to the run's exact
metrics, each iteration once after a resume redid some."""

import glob
import json
import os

import pytest

from dist_utils import (
    TINY_GPT,
    float32,
    gpt2_bpe_data,
    read_metrics,
    run_pretrain,
    tensorboard_scalars,
)
from megatron.training.config import TRACKER

pytestmark = pytest.mark.integration

ITERS = 6


def wandb_records(path):
    """The protobuf records of a W&B run file: LevelDB's log format (32 KiB
    blocks of pieces, each with a 7-byte header) after W&B's 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pieces = open(path, "rb").read(), 7, 32768, []
    while pos + 7 <= len(data):
        room = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if room < 7 or kind == 0:  # the zero padding at a block's end
            pos += room
            continue
        pieces.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = pb.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def wandb_history(path):
    """{step: {name: value}} of a W&B run file."""
    rows = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = rows.setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows


def raw_steps(directory, tag):
    """Every step written for ``tag`` in every event file, purged or not."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


@pytest.fixture(scope="module")
def runs(corpus_prefix, tmp_path_factory):
    """A 6-iteration run on 2 ranks saving at 3 and 6, then the same job
    resumed from 3 (its iterations 4 to 6 redone)."""
    out = tmp_path_factory.mktemp("dashboards")
    args = TINY_GPT + [
        "--data-path",
        corpus_prefix,
        "--split",
        "90,10,0",
        "--global-batch-size",
        "8",
    ]
    args += ["--train-iters", str(ITERS), "--save-interval", "3", "--save", str(out / "ckpt")]
    args += ["--eval-interval", "3", "--eval-iters", "1", "--log-throughput"]
    args += ["--tensorboard-dir", str(out / "tb"), "--log-timers-to-tensorboard"]
    args += ["--log-world-size-to-tensorboard", "--log-validation-ppl-to-tensorboard"]
    args += ["--wandb-project", "deadpool-test", "--wandb-exp-name", "tiny"]
    run_pretrain(2, args + ["--metrics-file", str(out / "first.jsonl")])
    wandb_files = glob.glob(str(out / "ckpt" / "wandb" / "wandb" / "offline-run-*" / "*.wandb"))
    (out / "ckpt" / TRACKER).write_text("3")
    run_pretrain(
        2, args + ["--load", str(out / "ckpt"), "--metrics-file", str(out / "resumed.jsonl")]
    )
    return out, wandb_files


def test_tensorboard_holds_megatron_lms_scalars_once_per_iteration(runs):
    out, _ = runs
    scalars = tensorboard_scalars(str(out / "tb"))
    for tag in ("lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm", "world-size"):
        assert [step for step, _ in scalars[tag]] == list(range(1, ITERS + 1)), tag
        assert f"{tag} vs samples" in scalars
    first, resumed = read_metrics(out / "first.jsonl"), read_metrics(out / "resumed.jsonl")
    # Iterations 1-3 from the first run, 4-6 from the resumed one (they agree
    # bit for bit: the same job).
    expected = [m["lm_loss"] for m in first[:3] + resumed]
    assert [value for _, value in scalars["lm loss"]] == [float32(v) for v in expected]
    assert [value for _, value in scalars["grad-norm"]] == [
        float32(m["grad_norm"]) for m in first[:3] + resumed
    ]
    assert scalars["batch-size vs samples"] == [(8 * i, 8) for i in range(1, 7)]
    assert [v for _, v in scalars["lm loss vs samples"]] == [v for _, v in scalars["lm loss"]]
    assert [s for s, _ in scalars["lm loss validation"]] == [3, 6, 6]  # 6: also the final one
    assert "lm loss validation ppl" in scalars
    assert [s for s, _ in scalars["iteration-time"]] == [2, 3, 4, 5, 6]  # log interval 1
    assert "throughput" in scalars


def test_the_resume_purges_what_it_redoes(runs):
    """The control: the event files do hold iterations 4-6 twice; the resumed
    writer's purge step hides the first ones."""
    out, _ = runs
    assert sorted(raw_steps(str(out / "tb"), "lm loss")) == [1, 2, 3, 4, 4, 5, 5, 6, 6]


def test_wandb_offline_run_holds_the_same_values(runs):
    out, wandb_files = runs
    assert len(wandb_files) == 1
    history = wandb_history(wandb_files[0])
    first = read_metrics(out / "first.jsonl")
    assert [history[m["iteration"]]["lm loss"] for m in first] == [m["lm_loss"] for m in first]
    assert [history[m["iteration"]]["learning-rate"] for m in first] == [m["lr"] for m in first]
    assert history[3]["lm loss validation"] > 0


def test_the_demo_model_learns_gpt2_bpe_text_and_tensorboard_shows_its_curve(
    corpus_prefix, tmp_path
):
    """make demo's model, layout and schedule (TP2 x PP2 x DP2, 60 iterations)
    with Megatron-LM's default tokenizer on the embedded corpus: every
    iteration's TensorBoard loss is the run's own, and the model learns
    (measured: 6.93 = ln 1024 at iteration 1, 6.00 at 20, 5.79 at 60;
    validation 5.90 at 30 and 5.81 at the end)."""
    from tools.bench.common import demo_args, strip_outputs

    corpus, tokenizer_files = gpt2_bpe_data(corpus_prefix)
    args = strip_outputs(demo_args())
    at = args.index("--data-path")
    assert args[at : at + 4] == [
        "--data-path",
        "data/corpus_text_document",
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ]
    args[at : at + 4] = ["--data-path", corpus]
    args += tokenizer_files
    args += [
        "--metrics-file",
        str(tmp_path / "metrics.jsonl"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    run_pretrain(8, args, timeout=600)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    scalars = tensorboard_scalars(str(tmp_path / "tb"))
    assert scalars["lm loss"] == [(m["iteration"], float32(m["lm_loss"])) for m in metrics]
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 61))
    losses = [m["lm_loss"] for m in metrics]
    assert losses[0] > 6.8 and max(losses[-10:]) < 6.0, losses
    validation = dict(scalars["lm loss validation"])
    assert sorted(validation) == [30, 60] and validation[60] < 6.0
