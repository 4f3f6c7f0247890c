"""The scale planner's command line (tools/plan_scale.py), in-process: it
prints a plan, and plans grad mode in device memory only."""

import pytest

from tools import plan_scale as plan_scale_cli


def test_the_cli_prints_a_plan(capsys):
    plan_scale_cli.main(["--model", "gpt-13b", "--tp", "4", "--pp", "1", "--dp", "128"])
    out = capsys.readouterr().out
    assert "GPT 13B on 512" in out and "hides" in out and "state mode sends" in out


def test_the_cli_plans_grad_mode_in_device_memory_only(capsys):
    args = ["--model", "gpt-13b", "--tp", "4", "--pp", "1", "--dp", "128", "--mirror-mode", "grad"]
    with pytest.raises(SystemExit, match="add --mirror-memory device"):
        plan_scale_cli.main(args)
    plan_scale_cli.main(args + ["--mirror-memory", "device"])
    out = capsys.readouterr().out
    assert "grad mode sends" in out and "in device memory" in out
