"""The sbatch scripts of examples/slurm/, without Slurm and without a GPU:
each script's own dry run (bash, then tools/slurm_plan.py with
pretrain_gpt.py's parser) checked against what the paper's runs need: 4 GPUs
per Perlmutter node (1 on Vista), the layouts and shapes of
tools/planning/scale.py, tensor parallelism inside a node, every buddy on another
node, spare nodes in the same allocation, the header sbatch reads, and a
checkpoint on SIGTERM before the time limit. Also the pieces the scripts
rely on that start processes: on_node.sh, bad input, shellcheck. (The
launcher's SIGTERM handling, in-process, is in
tests/unit_tests/test_slurm_scripts.py.)"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import REPO
from deadpool_ext.protocol import ExitCode
from deadpool_ext.topology import Experts, expert_dp_groups, rank_of
from tools.planning import scale as plan_scale
from tools.planning import slurm as slurm_plan

pytestmark = pytest.mark.integration

SLURM = os.path.join(REPO, "examples", "slurm")
# script: (the planner's model, tools/planning/scale.py, GPUs per node)
GPU_SCRIPTS = {
    "gpt_1.3b.sh": ("gpt-1.3b", 4),
    "gpt_6.7b.sh": ("gpt-6.7b", 4),
    "gpt_13b.sh": ("gpt-13b", 4),
    "llama_30b.sh": ("llama-30b", 4),
    "llama_65b.sh": ("llama-65b", 4),
    "mixtral_8x7b.sh": ("mixtral-8x7b", 4),
    "vista_gpt_13b.sh": ("gpt-13b", 1),
}


def script_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    return env


def dry_run(script: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", script, "--dry-run", *extra],
        cwd=REPO,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# The CPU script's data check reads the corpus with megatron-core (seconds of
# imports), and a clean clone has no corpus; the layout does not depend on it.
MOCK_DATA = "--mock-data --tokenizer-type ByteLevelTokenizer"


def dry_runs_as_json(runs: dict) -> dict:
    """{key: (script, extra training flags)}: each dry run's JSON plan, run
    side by side (one Python start each)."""
    cpu_env = dict(script_env(), DATA=MOCK_DATA)
    procs = {
        key: subprocess.Popen(
            ["bash", os.path.join(SLURM, script), "--dry-run", "--json", *extra],
            cwd=REPO,
            env=cpu_env if script == "cpu_demo.sh" else script_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, (script, extra) in runs.items()
    }
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{key}: {stderr[-3000:]}"
        out[key] = json.loads(stdout)
    return out


@pytest.fixture(scope="module")
def plans():
    """Every script's dry run as JSON."""
    return dry_runs_as_json({n: (n, ()) for n in list(GPU_SCRIPTS) + ["cpu_demo.sh"]})


gpu_script = pytest.mark.parametrize("name", list(GPU_SCRIPTS))


@gpu_script
def test_world_is_active_nodes_times_gpus_per_node(plans, name):
    p, gpus = plans[name], GPU_SCRIPTS[name][1]
    assert p["ranks_per_node"] == gpus
    assert p["world_size"] == p["nodes"] * gpus == len(p["ranks"])
    assert p["tp"] * p["pp"] * p["dp"] == p["world_size"]
    assert {r["node"] for r in p["ranks"]} == set(range(p["nodes"]))


@gpu_script
def test_perlmutter_layouts_are_the_planned_ones(plans, name):
    """The planner's layouts for 512 A100s, which docs/scale.md sizes."""
    p, (model, gpus) = plans[name], GPU_SCRIPTS[name]
    if gpus != 4:
        pytest.skip("Vista has its own layout (TP 1)")
    want = plan_scale.paper_layouts(512)[model]
    got = (p["tp"], p["pp"], p["dp"], p["micro_batch"], p["global_batch"], p["sequence_parallel"])
    assert got == (
        want.tp,
        want.pp,
        want.dp,
        want.micro_batch,
        want.global_batch,
        want.sequence_parallel,
    )
    assert (p["ep"], p["expert_tp"]) == (want.ep, want.expert_tp)


def test_vista_runs_without_tensor_parallelism(plans):
    p = plans["vista_gpt_13b.sh"]
    assert p["tp"] == 1 and p["hardware"] == "vista-gh200"


@gpu_script
def test_shape_is_the_papers_model(plans, name):
    model = GPU_SCRIPTS[name][0]
    got = plan_scale.ModelShape(**plans[name]["shape"])
    assert slurm_plan.comparable(got) == slurm_plan.comparable(plan_scale.MODELS[model])


@gpu_script
def test_memory_fits_the_gpu(plans, name):
    memory = plans[name]["memory"]
    assert memory["fits"] and memory["total_gib"] <= memory["limit_gib"]


def test_the_memory_plan_follows_the_scripts_mirror_and_recompute_flags(plans):
    """Flags added to a script's command line reach the plan: the mirror in
    device memory counts against the GPU, grad mode adds its two packets and
    sends a packet instead of a snapshot, full recompute keeps less."""
    script = "llama_65b.sh"
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    runs = dry_runs_as_json(
        {
            "device": (script, ["--deadpool-mirror-memory", "device"]),
            "grad": (
                script,
                ["--deadpool-mirror-memory", "device", "--deadpool-mirror-mode", "grad"],
            ),
            "full": (script, full + ["--recompute-num-layers", "1"]),
        }
    )
    host, device, grad = plans[script]["memory"], runs["device"]["memory"], runs["grad"]["memory"]
    assert (host["mirror_in_device"], device["mirror_in_device"]) == (False, True)
    assert device["total_gib"] == pytest.approx(host["total_gib"] + host["mirror_gib_per_gpu"])
    par = plan_scale.paper_layouts(512)["llama-65b"]
    layout = plan_scale.rank_layout(plan_scale.MODELS["llama-65b"], par, host["worst_stage"])
    assert host["sent_mib_per_iteration"] == layout.snapshot_bytes / plan_scale.MiB
    packet = plan_scale.packet_bytes(layout.shard_numel, layout.tensors) / plan_scale.MiB
    assert grad["sent_mib_per_iteration"] == packet < host["sent_mib_per_iteration"] / 2.9
    assert grad["mirror_gib_per_gpu"] * 1024 == pytest.approx(
        host["mirror_gib_per_gpu"] * 1024 + 2 * packet
    )
    assert grad["total_gib"] == pytest.approx(device["total_gib"] + 2 * packet / 1024)
    assert runs["full"]["memory"]["total_gib"] < host["total_gib"] - 5  # activations: 10 GiB


@gpu_script
def test_rank_coordinates_follow_megatrons_tp_pp_dp_order(plans, name):
    p = plans[name]
    assert p["tp_pp_dp_mapping"]
    for r in p["ranks"]:
        assert r["rank"] == rank_of(
            r["tp"], r["dp"], r["pp"], p["tp"], p["dp"], p["pp"], tp_pp_dp=True
        )
        assert r["node"] == r["rank"] // p["ranks_per_node"]


@gpu_script
def test_tensor_parallel_groups_stay_inside_one_node(plans, name):
    groups = {}
    for r in plans[name]["ranks"]:
        groups.setdefault((r["pp"], r["dp"]), set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in groups.values())


@pytest.mark.parametrize("name", list(GPU_SCRIPTS) + ["cpu_demo.sh"])
def test_every_buddy_is_a_dp_peer_on_another_node(plans, name):
    ranks = {r["rank"]: r for r in plans[name]["ranks"]}
    for r in ranks.values():
        buddy = ranks[r["buddy"]]
        assert (buddy["tp"], buddy["pp"]) == (r["tp"], r["pp"]) and buddy["dp"] != r["dp"]
        assert buddy["node"] != r["node"]
        assert ranks[r["owner"]]["buddy"] == r["rank"]
    # each rank holds exactly one peer's mirror
    assert sorted(r["owner"] for r in ranks.values()) == sorted(ranks)
    if plans[name]["ep"] > 1:  # MoE: a rank holding the same experts
        p = plans[name]
        group_of = expert_dp_groups(
            p["world_size"], Experts(p["expert_tp"], p["ep"]), p["pp"], p["tp_pp_dp_mapping"]
        )
        assert all(group_of[r] == group_of[ranks[r]["buddy"]] for r in ranks)


@pytest.mark.parametrize("name", list(GPU_SCRIPTS) + ["cpu_demo.sh"])
def test_spare_nodes_are_in_the_allocation_and_idle(plans, name):
    p = plans[name]
    assert p["spare_nodes"] >= 1
    assert p["spare_node_ids"] == list(range(p["nodes"], p["nodes"] + p["spare_nodes"]))
    assert len(p["hosts"]) == p["nodes"] + p["spare_nodes"]
    assert all(r["node"] < p["nodes"] for r in p["ranks"])
    assert all(p["checks"].values()), p["checks"]


def header_value(options, *names):
    return slurm_plan.directive(options, *names)


@pytest.mark.parametrize("name", list(GPU_SCRIPTS) + ["cpu_demo.sh"])
def test_header_allocates_active_and_spare_nodes(plans, name):
    p = plans[name]
    options = p["sbatch"]
    assert header_value(options, "-N", "--nodes") == str(p["nodes"] + p["spare_nodes"])
    assert header_value(options, "--ntasks-per-node") == "1"  # one launcher per node
    assert "--no-kill" in options  # a failed node does not end the job
    assert header_value(options, "-t", "--time")


@gpu_script
def test_perlmutter_and_vista_headers(plans, name):
    options, gpus = plans[name]["sbatch"], GPU_SCRIPTS[name][1]
    assert not any(o.startswith("--gpus-per-task") for o in options)
    if gpus == 4:
        assert header_value(options, "-C", "--constraint") == "gpu"
        assert header_value(options, "--gpus-per-node") == "4"
        assert header_value(options, "--gpu-bind") == "none"  # CUDA IPC inside the node
    else:
        assert header_value(options, "-p", "--partition") == "gh"


@gpu_script
def test_sigterm_comes_early_enough_to_save(plans, name):
    """The signal reaches the job steps (no B:), leaving several iterations
    (the planner's estimate) for the running one and the checkpoint."""
    p = plans[name]
    assert not header_value(p["sbatch"], "--signal").startswith("B:")
    assert p["signal_lead_s"] >= 120
    assert p["signal_lead_s"] >= 5 * p["memory"]["iteration_s"]


def test_cpu_variant_is_the_demo_on_gloo(plans):
    p = plans["cpu_demo.sh"]
    assert (p["nodes"], p["spare_nodes"], p["ranks_per_node"]) == (2, 1, 4)
    assert (p["tp"], p["pp"], p["dp"]) == (2, 2, 2)
    assert p["hardware"] is None and p["memory"] is None


@pytest.mark.parametrize("name", list(GPU_SCRIPTS) + ["cpu_demo.sh"])
def test_job_mirrors_and_saves_on_sigterm(plans, name):
    args = plans[name]["training_args"]
    for flag in (
        "--deadpool",
        "--use-distributed-optimizer",
        "--use-tp-pp-dp-mapping",
        "--exit-signal-handler",
    ):
        assert flag in args, flag
    save, load = args[args.index("--save") + 1], args[args.index("--load") + 1]
    assert save == load  # a resubmission resumes from the SIGTERM checkpoint


# ----- bad input -----
def model_file(tmp_path, **changes) -> str:
    """A copy of cpu_demo.sh with some settings changed: its own, or the
    recipe's, which a setting before deadpool_main wins over."""
    with open(os.path.join(SLURM, "cpu_demo.sh")) as f:
        text = f.read()
    for name, value in changes.items():
        text, count = re.subn(rf"^{name}=.*$", f"{name}={value}", text, flags=re.M)
        if not count:
            text, count = re.subn(r"^deadpool_main ", f"{name}={value}\\n\\g<0>", text, flags=re.M)
        assert count == 1, name
    path = tmp_path / "model.sh"
    path.write_text(text)
    return str(path)


def run_model(path, *args, **env):
    return subprocess.run(
        ["bash", path, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(script_env(), DEADPOOL_REPO=REPO, **env),
        timeout=120,
    )


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"CLUSTER": "summit"}, "CLUSTER must be perlmutter, vista or cpu"),
        ({"NODES": "two"}, "NODES must be a whole number"),
        ({"TP": "3"}, "TP 3 does not divide RANKS_PER_NODE 4"),
        ({"SPARE_NODES": "2"}, "#SBATCH -N 3, but NODES + SPARE_NODES = 4"),
        ({"GLOBAL_BATCH": "30"}, "--global-batch-size 30 is not divisible"),
    ],
    ids=["cluster", "nodes", "tp", "header", "batch"],
)
def test_bad_settings_stop_with_a_clear_message(tmp_path, changes, message):
    proc = run_model(model_file(tmp_path, **changes), "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_shells_own_variables_of_the_settings_names_change_no_job():
    """TP or NODES exported for something else must not reach the layout:
    only the model file sets the recipe's settings."""
    script = os.path.join(SLURM, "cpu_demo.sh")
    plain = run_model(script, "--dry-run", DATA=MOCK_DATA)
    stray = run_model(script, "--dry-run", DATA=MOCK_DATA, TP="3", NODES="9")
    assert plain.returncode == stray.returncode == 0, stray.stderr
    assert stray.stdout == plain.stdout


def test_outside_a_job_it_says_to_use_sbatch(tmp_path):
    proc = run_model(os.path.join(SLURM, "cpu_demo.sh"))
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr


def test_wrong_allocation_size_is_refused(tmp_path):
    proc = run_model(os.path.join(SLURM, "cpu_demo.sh"), SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="2")
    assert proc.returncode == 2 and "the job has 2 nodes" in proc.stderr


# ----- on_node.sh and the launcher's SIGTERM -----
ON_NODE = os.path.join(SLURM, "on_node.sh")
# A child that, like the launcher, handles SIGTERM and finishes its work.
CHILD = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: None)\n"
    "time.sleep(1.5)\nsys.exit(3)\n"
)


@pytest.mark.parametrize("node", ["0", "1"])
def test_on_node_waits_through_sigterm_and_records_node_0(tmp_path, node):
    status = tmp_path / "status"
    env = dict(
        script_env(),
        SLURM_NODEID=node,
        DEADPOOL_STATUS_FILE=str(status),
        DEADPOOL_COORDINATOR_LOST=str(int(ExitCode.COORDINATOR_LOST)),
    )
    proc = subprocess.Popen(["bash", ON_NODE, sys.executable, "-c", CHILD], env=env)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # Slurm signals every process of the step
    assert proc.wait(timeout=30) == 3  # the child's status, not death by SIGTERM
    assert (status.read_text().strip() == "3") if node == "0" else not status.exists()


def on_node_in_job_7(tmp_path, child: str, **env) -> subprocess.CompletedProcess:
    """on_node.sh on node 1 of job 7 around a Python ``child``, with a
    scancel that records its arguments in tmp_path/cancelled."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scancel").write_text(f'#!/usr/bin/env bash\necho "$@" >{tmp_path}/cancelled\n')
    (bin_dir / "scancel").chmod(0o755)
    env = dict(
        script_env(),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_NODEID="1",
        SLURM_JOB_ID="7",
        DEADPOOL_COORDINATOR_LOST=str(int(ExitCode.COORDINATOR_LOST)),
        **env,
    )
    return subprocess.run(
        ["bash", ON_NODE, sys.executable, "-c", child],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# What scontrol says of job 7 while its first node lives, and after Slurm
# removed it (docs/slurm.md: with --no-kill the job stays RUNNING without it).
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
"show job") calls=$(($(cat "$CALLS" 2>/dev/null || echo 0) + 1)); echo $calls >"$CALLS"
    nodes=nodeA,nodeB; if ((calls > 2)); then nodes=nodeB; fi
    echo "JobId=$3 ReqNodeList=(null) BatchHost=nodeA NodeList=$nodes" ;;
"show hostnames") tr , '\\n' <<<"$3" ;;
esac
"""


@pytest.mark.parametrize("code", [ExitCode.COORDINATOR_LOST, ExitCode.FAILED])
def test_on_node_ends_the_job_its_first_node_left_behind(tmp_path, code):
    """Another node's launcher lost the coordinator: once Slurm has dropped
    the first node from the job, on_node.sh records the outcome and cancels
    the job, which Slurm would otherwise keep until the time limit. Any other
    failure leaves the job to the first node."""
    bin_dir, status = tmp_path / "bin", tmp_path / "status"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    proc = on_node_in_job_7(
        tmp_path,
        f"import sys; sys.exit({int(code)})",
        CALLS=str(tmp_path / "calls"),
        DEADPOOL_STATUS_FILE=str(status),
        DEADPOOL_ORPHAN_POLL_S="0.1",
    )
    assert proc.returncode == code, proc.stderr
    if code == ExitCode.COORDINATOR_LOST:
        # Asked for the batch host, then polled until Slurm dropped it.
        assert (tmp_path / "calls").read_text().strip() == "3"
        assert status.read_text().strip() == str(int(code))
        assert (tmp_path / "cancelled").read_text().strip() == "7"
        assert "the first node (nodeA) and its coordinator are gone" in proc.stderr
    else:
        assert not status.exists() and not (tmp_path / "cancelled").exists()


def test_on_node_ends_the_job_the_standby_took_over_with_its_status(tmp_path):
    """The second node's launcher took over as the coordinator (the first
    node died with the batch script): its exit status is the job's, and
    nobody else would end the job."""
    status = tmp_path / "status"
    child = (
        "import os, sys\n"
        "open(os.environ['DEADPOOL_TAKEOVER_FILE'], 'w').write('node 1 took over: silent')\n"
        "sys.exit(0)\n"
    )
    proc = on_node_in_job_7(tmp_path, child, DEADPOOL_STATUS_FILE=str(status))
    assert proc.returncode == 0, proc.stderr
    assert status.read_text().strip() == "0"
    assert (tmp_path / "cancelled").read_text().strip() == "7"
    assert "node 1 took over: silent; the job ended with status 0" in proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_scripts_are_shellcheck_clean():
    scripts = sorted(os.path.join(SLURM, n) for n in os.listdir(SLURM) if n.endswith(".sh"))
    proc = subprocess.run(
        ["shellcheck", "-x", *scripts, "tools/slurm_local.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout
