"""--deadpool flags (deadpool_ext/config.py), parsed in-process: bad layouts
are refused before any process group, with a message that says what to
change; good ones pass, MoE whatever its expert-parallel size; the launcher
reads the flags it shares with the workers. (pretrain_gpt.py and the
launcher refusing them, as processes, are in
tests/functional_tests/test_deadpool_config.py.)"""

import pytest

from dist_utils import MOCK_GPT
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.flags import host

from deadpool_ext import defaults
from deadpool_ext.config import (
    DeadpoolConfig,
    coordinator_settings,
    plan_buddies,
    ranks_per_node,
    validate_deadpool,
)
from deadpool_ext.protocol import ExitCode
from tests.unit_tests.training.flags.test_moe import MOE

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DEADPOOL = ["--deadpool", "--use-distributed-optimizer"]


def parse(args, world_size, environ=None):
    environ = {} if environ is None else environ

    def check(config):
        validate_deadpool(config, environ)

    return parse_args(
        BASE + args,
        extra_sections={"deadpool": DeadpoolConfig},
        extra_validators=[check],
        world_size=world_size,
    )


def error(args, world_size, environ=None) -> str:
    with pytest.raises(ConfigError) as info:
        parse(args, world_size, environ)
    return str(info.value)


def test_without_deadpool_nothing_is_checked():
    parse(TP2_PP2, 8, {"LOCAL_WORLD_SIZE": "8"})


def test_needs_the_distributed_optimizer():
    assert "--use-distributed-optimizer" in error(
        ["--deadpool", "--deadpool-ranks-per-node", "1"], 2
    )


def test_needs_two_data_parallel_ranks():
    message = error(
        DEADPOOL + ["--tensor-model-parallel-size", "2", "--deadpool-ranks-per-node", "1"], 2
    )
    assert "data-parallel size >= 2" in message
    assert "--tensor-model-parallel-size" in message


def test_one_node_is_refused_and_says_how_to_accept_it():
    message = error(DEADPOOL + TP2_PP2, 8, {"LOCAL_WORLD_SIZE": "8"})
    assert "--deadpool-allow-same-node-buddy" in message
    assert "node" in message


def test_layouts_the_mirror_lacks_are_refused_under_deadpool_and_taken_without():
    cp = ["--context-parallel-size", "2", "--deadpool-ranks-per-node", "2"]
    message = error(DEADPOOL + cp, 8)
    assert "--context-parallel-size 2" in message and "--deadpool" in message
    assert parse(["--use-distributed-optimizer", "--context-parallel-size", "2"], 8)
    two = ["--num-distributed-optimizer-instances", "2", "--deadpool-ranks-per-node", "2"]
    assert "--num-distributed-optimizer-instances 2" in error(DEADPOOL + two, 8)
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    overlap += ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"]
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage"]
    interleaved += ["1", "--num-layers", "4", "--global-batch-size", "8"]
    message = error(DEADPOOL + overlap + interleaved + ["--deadpool-ranks-per-node", "2"], 8)
    assert "--overlap-param-gather-with-optimizer-step" in message and "--deadpool" in message
    assert parse(["--use-distributed-optimizer"] + overlap + interleaved, 8)


def test_same_node_buddies_on_request():
    config = parse(
        DEADPOOL + TP2_PP2 + ["--deadpool-allow-same-node-buddy"], 8, {"LOCAL_WORLD_SIZE": "8"}
    )
    assert plan_buddies(config, {"LOCAL_WORLD_SIZE": "8"}).same_node


def test_default_mapping_keeps_dp_peers_on_one_node_and_says_to_remap():
    """TP2 PP2 DP2 on 4-rank nodes: with Megatron's default rank order the DP
    peers of rank 0 (ranks 0 and 2) share node 0."""
    message = error(DEADPOOL + TP2_PP2 + ["--deadpool-ranks-per-node", "4"], 8)
    assert "--use-tp-pp-dp-mapping" in message
    config = parse(
        DEADPOOL + TP2_PP2 + ["--deadpool-ranks-per-node", "4", "--use-tp-pp-dp-mapping"], 8
    )
    buddies = plan_buddies(config)
    assert buddies.buddy[0] == 4 and not buddies.same_node


def test_world_must_be_whole_nodes():
    assert "--deadpool-ranks-per-node" in error(DEADPOOL + ["--deadpool-ranks-per-node", "3"], 4)


def test_device_memory_needs_a_gpu():
    message = error(
        DEADPOOL
        + ["--deadpool-ranks-per-node", "1", "--cpu", "--deadpool-mirror-memory", "device"],
        2,
    )
    assert "--deadpool-mirror-memory" in message and "host" in message


def test_gradient_replay_on_a_gpu_needs_the_replica_in_device_memory(monkeypatch):
    """The host's Adam differs from the GPU's in the last bits (measured:
    docs/benchmarks.md), so a host replica could never match its owner."""
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    grad = DEADPOOL + ["--deadpool-ranks-per-node", "1", "--deadpool-mirror-mode", "grad"]
    message = error(grad, 2)
    assert "--deadpool-mirror-memory device" in message and "state" in message
    assert parse(grad + ["--deadpool-mirror-memory", "device"], 2)
    assert parse(grad + ["--cpu"], 2)


def test_keeping_groups_across_a_swap_is_refused_on_nccl(monkeypatch):
    """Whether a kept group is intact is read from gloo's counts of completed
    operations; NCCL's count what was enqueued."""
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    keep = DEADPOOL + ["--deadpool-ranks-per-node", "1", "--deadpool-rebuild-groups", "changed"]
    assert "--deadpool-rebuild-groups all" in error(keep, 2)
    assert parse(keep + ["--cpu"], 2)


def test_mirror_timeout_must_be_positive():
    assert "--deadpool-mirror-timeout" in error(
        DEADPOOL + ["--deadpool-ranks-per-node", "1", "--deadpool-mirror-timeout", "0"], 2
    )


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, 8),
        ({"LOCAL_WORLD_SIZE": "4"}, 4),
        ({"SLURM_NTASKS_PER_NODE": "2"}, 2),
        ({"DEADPOOL_RANKS_PER_NODE": "1", "LOCAL_WORLD_SIZE": "8"}, 1),
    ],
)
def test_node_size_comes_from_the_launcher(environ, expected):
    assert ranks_per_node(DeadpoolConfig(), 8, environ) == expected
    assert ranks_per_node(DeadpoolConfig(deadpool_ranks_per_node=2), 8, environ) == 2


LAUNCHED = {"DEADPOOL_SLOT": "0.0", "LOCAL_WORLD_SIZE": "1"}


def test_recovery_needs_gradient_clipping():
    message = error(DEADPOOL + ["--clip-grad", "0"], 2, LAUNCHED)
    assert "--clip-grad > 0" in message


def test_fault_injection_is_checked_and_needs_the_launcher():
    assert "deadpool-launch" in error(
        DEADPOOL + ["--deadpool-inject", "kill:rank=1:iter=3"], 2, {"LOCAL_WORLD_SIZE": "1"}
    )
    assert "iter=N" in error(DEADPOOL + ["--deadpool-inject", "kill:rank=1"], 2, LAUNCHED)
    assert "does not exist" in error(
        DEADPOOL + ["--deadpool-inject", "kill:rank=7:iter=2"], 2, LAUNCHED
    )
    config = parse(
        DEADPOOL
        + ["--deadpool-inject", "kill:rank=1:iter=3", "--deadpool-inject", "hang:rank=0:iter=5"],
        2,
        LAUNCHED,
    )
    assert config.section(DeadpoolConfig).deadpool_inject == [
        "kill:rank=1:iter=3",
        "hang:rank=0:iter=5",
    ]
    parse(DEADPOOL + ["--deadpool-inject", "slow-warm:node=2:gen=1"], 2, LAUNCHED)  # a spare node


@pytest.mark.parametrize(
    "spec, says",
    [
        ("kill:rank=1:iter=0", "iterations count from 1"),
        ("kill:rank=1:iter= 3", "digits only"),
        ("kill:node=2:iter=3", "node 2 does not train"),
        ("kill:rank=1:iter=999", "comes after the last one"),
        ("kill:rank=1:iter=3:phase=save", "no checkpoint is saved after that iteration"),
        ("disk-full:rank=1:iter=3", "no checkpoint is saved after that iteration"),
        ("slow-warm:node=1:gen=1", "node 1 trains"),
    ],
)
def test_a_fault_that_can_never_fire_is_refused(spec, says):
    """On 2 nodes of 1 rank: a test whose fault cannot fire cannot fail."""
    assert says in error(DEADPOOL + ["--deadpool-inject", spec], 2, LAUNCHED)


def test_the_optimizer_phase_never_comes_when_the_all_gather_starts_in_the_forward():
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    spec = ["--deadpool-inject", "kill:rank=1:iter=3:phase=optimizer"]
    assert "phase=optimizer never comes" in error(DEADPOOL + overlap + spec, 2, LAUNCHED)
    parse(DEADPOOL + spec, 2, LAUNCHED)


def test_a_save_fault_fires_at_an_interval_save_or_the_last_one(tmp_path):
    saving = ["--save", str(tmp_path), "--save-interval", "3"]
    for spec in ("kill:rank=1:iter=3:phase=save", "disk-full:rank=1:iter=6"):
        parse(DEADPOOL + saving + ["--deadpool-inject", spec], 2, LAUNCHED)
    assert "no checkpoint" in error(
        DEADPOOL + saving + ["--deadpool-inject", "disk-full:rank=1:iter=4"], 2, LAUNCHED
    )


def test_heartbeat_timeout_must_be_positive():
    assert "heartbeat" in error(DEADPOOL + ["--deadpool-heartbeat-timeout", "0"], 2, LAUNCHED)


def test_spare_wait_must_not_be_negative():
    assert "--deadpool-spare-wait" in error(DEADPOOL + ["--deadpool-spare-wait", "-1"], 2, LAUNCHED)
    assert (
        parse(DEADPOOL + ["--deadpool-spare-wait", "0"], 2, LAUNCHED)
        .section(DeadpoolConfig)
        .deadpool_spare_wait
        == 0
    )


def test_a_fault_may_fire_a_delay_into_its_phase():
    from deadpool_ext.inject import parse_fault

    fault = parse_fault("kill:rank=1:iter=3:phase=backward:delay=40")
    assert (fault.phase, fault.delay_ms) == ("backward", 40)
    assert parse_fault("kill:rank=1:iter=3").delay_ms == 0
    assert "delay" in error(
        DEADPOOL + ["--deadpool-inject", "kill:rank=1:iter=3:delay=-5"], 2, LAUNCHED
    )
    assert "integers" in error(
        DEADPOOL + ["--deadpool-inject", "kill:rank=1:iter=3:delay=x"], 2, LAUNCHED
    )


def test_a_stall_stops_a_main_thread_phase_of_one_rank():
    from deadpool_ext.inject import parse_fault

    assert parse_fault("stall:rank=1:iter=4:phase=backward").action == "stall"
    for spec, says in [
        ("stall:node=1:iter=4", "rank=N"),
        ("stall:rank=1:iter=4:phase=mirror", "phase must be one of"),
        ("stall:rank=1:iter=4:delay=10", "without delay"),
    ]:
        assert says in error(DEADPOOL + ["--deadpool-inject", spec], 2, LAUNCHED), spec


def test_checkpoint_policy_needs_a_save_directory():
    args = DEADPOOL + ["--deadpool-on-spares-exhausted", "checkpoint"]
    assert "add --save DIR" in error(args, 2, LAUNCHED)
    config = parse(args + ["--save", "/tmp/unused-ckpt"], 2, LAUNCHED)
    assert config.section(DeadpoolConfig).deadpool_on_spares_exhausted == "checkpoint"


def test_the_recovery_timeout_is_a_positive_flag_apart_from_the_heartbeat_timeout():
    config = parse(DEADPOOL + ["--deadpool-recovery-timeout", "300"], 2, LAUNCHED)
    assert config.section(DeadpoolConfig).deadpool_recovery_timeout == 300
    # A long heartbeat timeout needs a longer recovery timeout: the stuck
    # watch kills 3 timeouts after the announcement, before the reports' deadline.
    slow = DEADPOOL + ["--deadpool-heartbeat-timeout", "180"]
    assert "must be below --deadpool-recovery-timeout (120 s)" in error(slow, 2, LAUNCHED)
    given = parse(slow + ["--deadpool-recovery-timeout", "600"], 2, LAUNCHED)
    assert given.section(DeadpoolConfig).deadpool_recovery_timeout == 600
    message = error(DEADPOOL + ["--deadpool-recovery-timeout", "0"], 2, LAUNCHED)
    assert "--deadpool-recovery-timeout must be > 0 seconds" in message


# The timeouts' order (defaults.check_order): each broken order, the flags'
# and the constants', is one line naming both ends and what to change.
FLAG_ORDERS = [
    (
        ["--deadpool-heartbeat-timeout", "50"],
        "STUCK_KILL_TIMEOUTS x --deadpool-heartbeat-timeout (150 s) must be below "
        "--deadpool-recovery-timeout (120 s)",
        "raise --deadpool-recovery-timeout or lower --deadpool-heartbeat-timeout",
    ),
    (
        ["--deadpool-heartbeat-timeout", "0.5"],
        "HEARTBEAT_INTERVAL_S (0.5 s) must be below --deadpool-heartbeat-timeout (0.5 s)",
        "raise --deadpool-heartbeat-timeout",
    ),
    (
        ["--deadpool-heartbeat-timeout", "20", "--deadpool-mirror-timeout", "15"],
        "--deadpool-heartbeat-timeout (20 s) must be at most --deadpool-mirror-timeout (15 s)",
        "raise --deadpool-mirror-timeout or lower --deadpool-heartbeat-timeout",
    ),
]
CONSTANT_ORDERS = [
    (
        {"STUCK_REPORT_TIMEOUTS": 3},
        "STUCK_REPORT_TIMEOUTS x --deadpool-heartbeat-timeout (30 s) must be below "
        "STUCK_KILL_TIMEOUTS x --deadpool-heartbeat-timeout (30 s)",
    ),
    (
        {"STORE_MEND_TIMEOUT_S": 5.0},
        "STORE_MEND_TIMEOUT_S (5 s) must be below STORE_RECONNECT_TIMEOUT_S (5 s)",
    ),
    ({"CONTROL_SILENCE_S": 60.0}, "CONTROL_SILENCE_S (60 s) must be below TAKEOVER_WAIT_S (60 s)"),
    ({"RELEASE_ALL_AFTER_S": 1.0}, "RELEASE_GRACE_S (1 s) must be below RELEASE_ALL_AFTER_S (1 s)"),
    (
        {"RELEASE_ALL_COMPUTING_AFTER_S": 2.0},
        "RELEASE_ALL_AFTER_S (2 s) must be below RELEASE_ALL_COMPUTING_AFTER_S (2 s)",
    ),
    (
        {"RELEASE_ALL_COMPUTING_AFTER_S": 20.0},
        "RELEASE_ALL_COMPUTING_AFTER_S (20 s) must be below "
        "STUCK_REPORT_TIMEOUTS x HEARTBEAT_TIMEOUT_S (20 s)",
    ),
]


def launcher_refusal(flags, monkeypatch, capsys) -> str:
    """deadpool-launch's one line for these script flags; nothing may start."""
    from deadpool_ext.control import launch

    monkeypatch.setattr(launch, "run_node", lambda opts: pytest.fail("the launch went on"))
    code = launch.main(["--standalone", "pretrain_gpt.py", *BASE, *DEADPOOL, *flags])
    said = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE and len(said) == 1, said
    assert said[0].startswith("deadpool-launch: error: "), said
    return said[0]


def test_the_defaults_keep_the_timeouts_order():
    defaults.check_order()
    assert parse(DEADPOOL, 2, LAUNCHED).section(DeadpoolConfig).deadpool_mirror_timeout == 300


@pytest.mark.parametrize("flags, broken, fix", FLAG_ORDERS, ids=["stuck", "interval", "mirror"])
def test_flags_out_of_the_timeouts_order_are_refused_before_anything_starts(
    flags, broken, fix, monkeypatch, capsys
):
    """By the launcher, before any worker, and by a worker's own parse."""
    said = launcher_refusal(flags, monkeypatch, capsys)
    assert broken in said and fix in said
    assert error(DEADPOOL + flags, 2, LAUNCHED).startswith(broken)


@pytest.mark.parametrize("constants, broken", CONSTANT_ORDERS)
def test_constants_out_of_the_timeouts_order_are_refused_by_the_launcher(
    constants, broken, monkeypatch, capsys
):
    for name, value in constants.items():
        monkeypatch.setattr(defaults, name, value)
    said = launcher_refusal([], monkeypatch, capsys)
    assert broken in said and "change deadpool_ext/defaults.py" in said


def test_on_nan_acts_on_megatron_lms_check_and_is_refused_without_it():
    assert parse(DEADPOOL, 2, LAUNCHED).section(DeadpoolConfig).deadpool_on_nan is None  # rollback
    assert parse(DEADPOOL + ["--deadpool-on-nan", "stop"], 2, LAUNCHED)
    message = error(
        DEADPOOL + ["--deadpool-on-nan", "rollback", "--no-check-for-nan-in-loss-and-grad"],
        2,
        LAUNCHED,
    )
    assert "--no-check-for-nan-in-loss-and-grad turns it off" in message


def test_recovery_takes_the_place_of_megatron_cores_rerun_in_place(capsys):
    """Under --deadpool a rejected result reaches the rollback at once: the
    rerun state machine only checks; a rerun mode given is said to have no
    effect, the default is not."""
    environ = {"LOCAL_WORLD_SIZE": "4"}
    layout = TP2_PP2 + ["--use-tp-pp-dp-mapping"]
    quiet = parse(layout + DEADPOOL, 8, environ)
    assert quiet.training.rerun_mode == "disabled" and "--rerun-mode" not in capsys.readouterr().out
    given = ["--rerun-mode", "validate_results", "--error-injection-rate", "5"]
    config = parse(layout + DEADPOOL + given, 8, environ)
    printed = capsys.readouterr().out
    assert config.training.rerun_mode == "disabled"
    assert (
        "--rerun-mode validate_results, --error-injection-rate have no effect under --deadpool"
        in printed
    )
    # Control: without --deadpool the mode stays.
    assert parse(layout + given, 8, environ).training.rerun_mode == "validate_results"


def test_the_flex_dispatcher_is_refused_under_deadpool(monkeypatch):
    """megatron-core keeps DeepEP's buffer in a module global bound to the
    expert-parallel group, which a recovery replaces and cannot re-point
    there: refused under --deadpool, taken without it (on a GPU with DeepEP)."""
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 8)
    monkeypatch.setattr(host, "importable", lambda module: True)
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear"]
    moe += ["--moe-token-dispatcher-type", "flex"]
    message = error(DEADPOOL + moe + ["--deadpool-ranks-per-node", "4"], 8)
    assert "--moe-token-dispatcher-type flex" in message and "--deadpool" in message
    assert parse(["--use-distributed-optimizer"] + moe, 8)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], None),
        (["--cuda-graph-impl", "transformer_engine"], "--cuda-graph-impl transformer_engine"),
        (
            ["--offload-modules", "core_attn", "--fine-grained-activation-offloading"],
            None,
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear"]
            + ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
            None,
        ),
    ],
    ids=["tp-overlap", "cuda-graphs", "offloading", "moe-overlap"],
)
def test_the_gpu_only_features_are_refused_under_deadpool(monkeypatch, flags, named):
    """No recovery with them has been shown (each keeps state bound to the
    process groups or the schedule): refused under --deadpool by name, taken
    without it, on a GPU node with Transformer Engine."""
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 8)
    monkeypatch.setattr(host, "importable", lambda module: True)
    environ = {"LOCAL_WORLD_SIZE": "4"}
    gpu = ["--bf16", "--transformer-impl", "transformer_engine"]
    message = error(DEADPOOL + gpu + flags, 8, environ)
    assert (named or flags[-1]) in message and "drop it under --deadpool" in message
    assert parse(["--use-distributed-optimizer"] + gpu + flags, 8, environ)


def test_the_replicas_are_checked_every_iteration_under_deadpool_unless_told_otherwise():
    """Megatron-LM's --check-weight-hash-across-dp-replicas-interval: off by
    default, every iteration under --deadpool, and the flag's value wins."""
    interval = "--check-weight-hash-across-dp-replicas-interval"
    assert parse([], 2).training.check_weight_hash_across_dp_replicas_interval is None
    config = parse(DEADPOOL, 2, LAUNCHED)
    assert config.training.check_weight_hash_across_dp_replicas_interval == 1
    assert config.section(DeadpoolConfig).deadpool_on_sdc == "rollback"
    given = parse(DEADPOOL + [interval, "10", "--deadpool-on-sdc", "swap"], 2, LAUNCHED)
    assert given.training.check_weight_hash_across_dp_replicas_interval == 10
    assert given.section(DeadpoolConfig).deadpool_on_sdc == "swap"
    message = error(DEADPOOL + ["--deadpool-on-sdc", "ignore"], 2, LAUNCHED)
    assert "choose from 'rollback', 'swap', 'stop'" in message


def test_the_launcher_reads_the_flags_it_shares_with_the_workers():
    """The coordinator acts on the --deadpool flags as the workers read
    them, from the start: the script's other flags are the script's."""
    args = ["--num-layers", "2", "--deadpool", "--deadpool-events", "e.jsonl"]
    args += ["--deadpool-heartbeat-timeout=3", "--deadpool-on-spares-exhausted", "checkpoint"]
    got = coordinator_settings(args)
    assert (got.events, got.heartbeat_timeout, got.on_spares_exhausted) == (
        "e.jsonl",
        3.0,
        "checkpoint",
    )
    # Given twice, the last counts, as in the workers' argparse; the rest
    # are the flags' defaults (DeadpoolConfig's).
    again = coordinator_settings(args + ["--deadpool-heartbeat-timeout", "10"])
    assert (
        again.heartbeat_timeout == 10.0 and again.spare_wait == DeadpoolConfig().deadpool_spare_wait
    )
    with pytest.raises(ConfigError, match="--deadpool-spare-wait"):
        coordinator_settings(["--deadpool-spare-wait", "soon"])


def test_deadpool_takes_moe_whatever_its_expert_parallel_size(monkeypatch):
    """4 ranks on 2-rank nodes: EP 2 leaves expert-DP 2 (buddies hold the
    same experts), EP 4 leaves 1 (buddies hold others' snapshots)."""
    from deadpool_ext.config import parse_args as deadpool_parse, plan_buddies

    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = MOCK_GPT + MOE + ["--use-distributed-optimizer", "--deadpool"]
    flags += ["--deadpool-ranks-per-node", "2"]
    for ep, apart in ((2, False), (4, True)):
        config = deadpool_parse(flags + ["--expert-model-parallel-size", str(ep)], environ={})
        assert plan_buddies(config, environ={}).experts_apart is apart
