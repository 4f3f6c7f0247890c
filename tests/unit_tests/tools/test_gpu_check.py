"""The prepared GPU validation (tools/gpu_check.py): its dry run, which CI
runs, builds every stage's commands and parses them as the GPU machine's
ranks would; its checks read what the runs leave. (A CPU rehearsal of the
whole check, ``tools/gpu_check.sh OUT --cpu``, is a tool run, not a test.)"""

import json
import sys

from tools import gpu_check
from tools.gpu_check import CPU, GPU, plan


def test_the_dry_run_parses_every_command_as_on_the_gpu_machine(capsys, tmp_path):
    assert gpu_check.main([str(tmp_path / "out"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    runs = [
        run for stage in plan(str(tmp_path), sys.executable, GPU) for g in stage.groups for run in g
    ]
    assert printed.count("parsed as launched") == len(runs) == 13
    assert "REFUSED" not in printed
    assert "DEADPOOL_SHARE_GPU=hostid" in printed  # several NCCL ranks on the one GPU


def test_the_dry_run_can_fail(capsys, tmp_path, monkeypatch):
    """Control: a command the GPU machine's ranks would refuse is reported
    and fails the dry run (here device memory on a CPU plan)."""
    bad = gpu_check.Run("bad", gpu_check.torchrun(sys.executable, 2) + ["pretrain_gpt.py"])
    args = CPU.mirror + gpu_check.COMMON + ["--train-iters", "6", "--deadpool"]
    args += ["--deadpool-ranks-per-node", "1", "--deadpool-mirror-memory", "device"]
    bad = gpu_check.Run("bad", bad.command + args)
    stage = gpu_check.Stage(9, "bad", [[bad]], lambda work: {})
    assert gpu_check.dry_run([stage], on_gpu=False) == 2
    assert "REFUSED: --deadpool-mirror-memory device needs a GPU" in capsys.readouterr().out


def test_stages_one_and_two_start_together_and_fit_the_budget(tmp_path):
    stages = plan(str(tmp_path), sys.executable, GPU)
    (together,) = stages[0].groups
    names = {run.name for run in together}
    assert {"swap", "swap-reference", "shrink", "shrink-reference", "shrink-device"} <= names
    assert stages[1].groups == []  # stage 2's runs are in that group
    alone = plan(str(tmp_path), sys.executable, GPU, wanted={2})
    assert [s.number for s in alone] == [2] and alone[0].groups == [together]
    timed = [g for stage in stages[2:] for g in stage.groups]
    assert all(len(group) == 1 for group in timed)  # timed runs run alone
    assert gpu_check.BUDGET_S < 600  # one device call


def write_metrics(folder, losses, seconds=1.0, extra=None):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        {
            "iteration": i + 1,
            "consumed_samples": 16 * (i + 1),
            "lm_loss": loss,
            "grad_norm": 1.0,
            "lr": 1e-4,
            "seconds": seconds,
            **(extra or {}),
        }
        for i, loss in enumerate(losses)
    ]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n")


def test_the_shrink_check_holds_the_tolerance_and_can_fail(tmp_path):
    reference = [5.0, 4.9, 4.8, 4.7, 4.6, 4.5]
    write_metrics(tmp_path / "shrink-reference", reference)
    write_metrics(tmp_path / "shrink", [x * (1 + 2e-6) for x in reference])
    write_metrics(tmp_path / "shrink-device", [x * (1 + 2e-4) for x in reference])
    figures = gpu_check.judge_shrink(str(tmp_path))
    assert figures["shrink"]["within_tolerance"]
    assert not figures["shrink-device"]["within_tolerance"]  # control
    assert "lm_loss" in figures["shrink-device"]["difference"]


def test_the_mirror_and_attention_figures(tmp_path):
    write_metrics(tmp_path / "mirror-off", [5.0] * 8, seconds=2.0)
    write_metrics(tmp_path / "mirror-state-host", [5.0] * 8, seconds=2.1)
    figures = gpu_check.judge_mirror(str(tmp_path))
    assert figures["ratio_to_off"] == {"mirror-off": 1.0, "mirror-state-host": 1.05}
    log = tmp_path / "attention-sdpa" / "output.log"
    log.parent.mkdir()
    log.write_text(
        " > core attention: TorchSdpaAttention (--attention-backend auto)\n"
        + "".join(
            f" iteration {i}/10 | throughput per GPU (TFLOP/s/GPU): {400 + i}.0 |\n"
            for i in range(1, 11)
        )
    )
    for name in ("sdpa-a", "sdpa-b"):
        write_metrics(tmp_path / name, [5.0, 4.0])
    figures = gpu_check.judge_attention(str(tmp_path))
    assert figures["attention-sdpa"] == {
        "tflops": 406.5,
        "core_attention": "TorchSdpaAttention (--attention-backend auto)",
    }
    assert figures["sdpa_repeat_bit_for_bit"]
    write_metrics(tmp_path / "sdpa-b", [5.0, 4.000001])
    assert not gpu_check.judge_attention(str(tmp_path))["sdpa_repeat_bit_for_bit"]
