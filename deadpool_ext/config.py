"""The ``--deadpool*`` flags, and the checks that run before any process group.

The dataclass generates the flags (``megatron.training.arguments``); the
validator refuses layouts the mirror cannot protect, and timeouts out of the
order the watches rely on (``defaults.check_order``), and says what to change.
"""

import os
from dataclasses import dataclass, fields
from typing import List, Optional

from megatron.training import arguments
from megatron.training.arguments import ConfigError
from megatron.training.config import Config, arg
from megatron.training.schedule import interleaving_problem_at

from deadpool_ext.topology import (
    BuddyError,
    BuddyMap,
    Experts,
    buddy_map,
    nodes_by_block,
    shrink_unit,
)
from deadpool_ext.inject import Fault, InjectError, parse_faults
from deadpool_ext.defaults import (
    HEARTBEAT_TIMEOUT_S,
    METRICS_ADDR,
    MIRROR_TIMEOUT_S,
    ON_SDC,
    ON_SPARES_EXHAUSTED,
    ON_STRAGGLER,
    PROGRESS_TIMEOUT_S,
    RECOVERY_TIMEOUT_S,
    SPARE_WAIT_S,
    STRAGGLER_FACTOR,
    STRAGGLER_WINDOW,
    WEIGHT_CHECK_INTERVAL,
    OrderError,
    check_order,
)
from deadpool_ext.protocol import ERROR_FILE_ENV, CoordinatorSettings


@dataclass(kw_only=True)
class DeadpoolConfig:
    """DeadPool: buddy mirroring of the distributed-optimizer shard."""

    deadpool: bool = arg(
        False,
        help="Mirror each rank's distributed-optimizer shard to a "
        "data-parallel buddy on another node every iteration.",
    )
    deadpool_events: Optional[str] = arg(
        help="Append structured events (JSONL, one line per event, all ranks) to this file."
    )
    deadpool_mirror_memory: str = arg(
        "host",
        help="Where the buddy keeps the mirror: host memory (default) or device memory (GPU only).",
        choices=["host", "device"],
    )
    deadpool_mirror_mode: str = arg(
        "state",
        help="What travels to the buddy every iteration: the whole shard (state: 12 bytes "
        "per parameter) or the step's gradients (grad: 4 bytes), which the buddy replays "
        "with the owner's optimizer and checks against the owner's digest.",
        choices=["state", "grad"],
    )
    deadpool_rebuild_groups: str = arg(
        "all",
        help="Which process groups a hot swap makes again: all of them (default), or only "
        "those with a replaced member (changed): a group whose members all survived, each "
        "between two of its operations, keeps its connections. A shrink or grow makes all.",
        choices=["all", "changed"],
    )
    deadpool_allow_same_node_buddy: bool = arg(
        False,
        help="Accept buddies on the same node when no other-node buddy exists "
        "(warns: a node failure then loses that state).",
    )
    deadpool_ranks_per_node: Optional[int] = arg(
        help="Ranks per node for buddy placement; nodes hold contiguous rank blocks. "
        "Default: LOCAL_WORLD_SIZE (torchrun), SLURM_NTASKS_PER_NODE (srun), or the "
        "launcher's emulated node size."
    )
    deadpool_mirror_timeout: float = arg(
        MIRROR_TIMEOUT_S,
        help="Seconds a mirror send/receive may take before the buddy counts as lost.",
    )
    deadpool_heartbeat_timeout: float = arg(
        HEARTBEAT_TIMEOUT_S,
        help="Seconds without a heartbeat after which the coordinator declares a "
        "node lost or a worker hung (hung workers are killed and replaced).",
    )
    deadpool_recovery_timeout: float = arg(
        RECOVERY_TIMEOUT_S,
        help="Seconds the survivors may take to report after a failure is detected, and a "
        "decided generation to resume, before the job stops (a stuck rank that holds a "
        "shard's only copy is waited for longer: its group timeout).",
    )
    deadpool_progress_timeout: float = arg(
        PROGRESS_TIMEOUT_S,
        help="Seconds a training rank may go without finishing an iteration while its main "
        "thread computes (in no collective, send or receive, and no checkpoint) and a peer "
        "waits in one, before it counts as hung (a blocked driver call, a stuck kernel: its "
        "heartbeat thread beats on) and is killed and replaced; 0: never.",
    )
    deadpool_on_nan: Optional[str] = arg(
        help="When a rank's loss or local gradient norm is NaN or Inf "
        "(--check-for-nan-in-loss-and-grad): rollback (the default) takes every rank back to "
        "the iteration's start from the in-memory snapshots and redoes it once (a clean redo: "
        "a transient fault; NaN again: the job stops), or stop, as Megatron-LM's check.",
        choices=["rollback", "stop"],
    )
    deadpool_on_sdc: str = arg(
        ON_SDC,
        help="When two copies that must agree differ (a parameter between data-parallel "
        "replicas: --check-weight-hash-across-dp-replicas-interval, every iteration by default "
        "under --deadpool; a step and the buddy's replay of it: --deadpool-mirror-mode grad): "
        "rollback takes every rank back to the iteration's start from memory and redoes it, "
        "and swaps a rank caught again within a window for a spare (or shrinks); swap replaces "
        "the suspect rank at once; stop ends the job, as Megatron-LM's check.",
        choices=["rollback", "swap", "stop"],
    )
    deadpool_sample_rng: bool = arg(
        True,
        flag="--no-deadpool-sample-rng",
        help="Draw Megatron-LM's per-rank random streams instead of seeding each training "
        "microbatch's draws (dropout) from its first sample, stage and model chunk: then a "
        "shrink, a grow or a resume at another data-parallel size changes the masks of the "
        "microbatches that move, and the curve drifts with dropout on.",
    )
    deadpool_on_spares_exhausted: str = arg(
        ON_SPARES_EXHAUSTED,
        help="When a rank is lost and no spare is left: shrink (drop the "
        "data-parallel replicas that lost a rank and go on with the rest, same global batch), "
        "checkpoint (gather every shard on the survivors, save the newest iteration to --save "
        "and stop with exit code 3; --load it at any data-parallel size), or abort (exit "
        "non-zero; resume from the last --save checkpoint).",
        choices=["shrink", "checkpoint", "abort"],
    )
    deadpool_spare_wait: float = arg(
        SPARE_WAIT_S,
        help="Seconds a recovery may wait for warm spares that are still starting "
        "(imports, device, data) when too few are ready, to swap once instead of applying "
        "--deadpool-on-spares-exhausted and growing back; 0 never waits.",
    )
    deadpool_straggler_factor: float = arg(
        STRAGGLER_FACTOR,
        help="A node whose compute time per iteration (forward and backward, without waits "
        "for peers), over the last --deadpool-straggler-window iterations, is this many times "
        "the other nodes' median is a straggler: reported in the events, on the dashboards "
        "and in the metrics; 0: no watch.",
    )
    deadpool_straggler_window: int = arg(
        STRAGGLER_WINDOW,
        help="Iterations over which each node's compute time is taken (its median) for "
        "--deadpool-straggler-factor.",
    )
    deadpool_on_straggler: str = arg(
        ON_STRAGGLER,
        help="When a straggler is found: report it (the default), or swap its node for a "
        "ready spare node at the next iteration boundary, handing its ranks' state over "
        "without redoing an iteration (a drain, as deadpool-ctl drain).",
        choices=["report", "swap"],
    )
    deadpool_metrics_port: Optional[int] = arg(
        help="Serve the coordinator's state as Prometheus metrics on this port (node 0's "
        "launcher; docs/operations.md lists them); none by default."
    )
    deadpool_metrics_addr: str = arg(
        METRICS_ADDR,
        help="The address the --deadpool-metrics-port endpoint listens on (loopback by "
        "default; 0.0.0.0 for every interface).",
    )
    deadpool_inject: Optional[List[str]] = arg(
        help="Fault injection, repeatable: kill:rank=R:iter=N[:phase=P], kill:node=K:iter=N, "
        "hang:rank=R:iter=N, stall:rank=R:iter=N[:phase=P]; phases forward, backward, "
        "grad-reduce, optimizer, mirror, recovery (deadpool-launch runs only).",
        action="append",
    )


def section(config: Config) -> DeadpoolConfig:
    return config.section(DeadpoolConfig)


def coordinator_settings(
    script_args: List[str], nodes: Optional[int] = None
) -> CoordinatorSettings:
    """What the coordinator acts on, read from the training script's flags
    as its own parser reads them (the last of a flag given twice counts;
    the script's other flags are left to it). Raises ConfigError on a bad
    value, as the script would. ``nodes``: the job's, spare nodes too (the
    launcher's), to check what only it knows."""
    parser = arguments.build_parser({"deadpool": DeadpoolConfig})
    namespace, _ = parser.parse_known_args(script_args)
    dp = DeadpoolConfig(**{f.name: getattr(namespace, f.name) for f in fields(DeadpoolConfig)})
    check_operations(dp)  # the launcher refuses them before anything starts
    check_timeout_order(dp)
    if nodes is not None:
        check_spare_faults(dp, nodes)
    return CoordinatorSettings(
        heartbeat_timeout=dp.deadpool_heartbeat_timeout,
        recovery_timeout=dp.deadpool_recovery_timeout,
        progress_timeout=dp.deadpool_progress_timeout,
        spare_wait=dp.deadpool_spare_wait,
        on_spares_exhausted=dp.deadpool_on_spares_exhausted,
        events=dp.deadpool_events,
        straggler_factor=dp.deadpool_straggler_factor,
        straggler_window=dp.deadpool_straggler_window,
        on_straggler=dp.deadpool_on_straggler,
        metrics_port=dp.deadpool_metrics_port,
        metrics_addr=dp.deadpool_metrics_addr,
    )


def ranks_per_node(dp: DeadpoolConfig, world_size: int, environ=os.environ) -> int:
    """Node size from the flag, then from the launcher's environment."""
    if dp.deadpool_ranks_per_node is not None:
        return dp.deadpool_ranks_per_node
    for name in ("DEADPOOL_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world_size


def nodes_are_emulated(config: Config, environ=os.environ) -> bool:
    """The flag or the launcher says where node boundaries are (otherwise
    the hostnames do, and are checked once groups exist)."""
    return (
        section(config).deadpool_ranks_per_node is not None or "DEADPOOL_RANKS_PER_NODE" in environ
    )


def node_names(config: Config, environ=os.environ) -> List[str]:
    if config.world.rank_nodes:  # a shrunk job: nodes as the coordinator placed them
        return list(config.world.rank_nodes)
    dp = section(config)
    per_node = ranks_per_node(dp, config.world_size, environ)
    return nodes_by_block(config.world_size, per_node)


def experts_of(config: Config) -> Optional[Experts]:
    """An MoE job's expert layout; None for a dense model."""
    if config.moe.num_experts is None:
        return None
    p = config.parallel
    return Experts(p.expert_tensor_parallel_size, p.expert_model_parallel_size)


def plan_buddies(config: Config, environ=os.environ, hosts: Optional[List[str]] = None) -> BuddyMap:
    """The buddy map this run will use (on ``hosts``, the rank's node names,
    when given), or ConfigError saying why there is none."""
    p = config.parallel
    try:
        return buddy_map(
            config.world_size,
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            hosts or node_names(config, environ),
            allow_same_node=section(config).deadpool_allow_same_node_buddy,
            tp_pp_dp=p.use_tp_pp_dp_mapping,
            experts=experts_of(config),
        )
    except BuddyError as error:
        raise ConfigError(str(error)) from None


def resize_limits(config: Config, buddies: Optional[BuddyMap]) -> dict:
    """What the coordinator must know to shrink or grow this job (the
    fields of protocol.Plan): the interleaved schedule runs only at some
    data-parallel sizes; an MoE model drops whole expert-parallel blocks
    of replicas, needs buddies holding the same experts, and does not grow
    back yet."""
    limits = {}
    if config.virtual_pipeline_model_parallel_size is not None:
        p = config.parallel
        per_replica = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        planned = config.planned_world_size // per_replica
        limits["data_parallel_sizes"] = [
            d for d in range(1, planned + 1) if interleaving_problem_at(config, d) is None
        ]
    experts = experts_of(config)
    if experts is None:
        return limits
    limits.update(
        shrink_unit=shrink_unit(config.parallel.tensor_model_parallel_size, experts),
        cannot_grow="growing an MoE model's job back is not built yet",
    )
    if buddies is not None and buddies.experts_apart:
        limits["cannot_resize"] = (
            "a buddy holds other experts than its owner (no rank holding the same "
            "experts is on another node), so a shrink could not re-cut them"
        )
    return limits


def validate_deadpool(config: Config, environ=os.environ) -> None:
    """Runs in parse_args, before any process group exists."""
    dp = section(config)
    if not dp.deadpool:
        return
    check_recoverable_layout(config)
    per_node = check_nodes(config, dp, environ)
    check_hardware(config, dp)
    check_timeouts(dp)
    check_numeric_faults(config, dp)
    check_operations(dp)
    check_what_recovery_needs(config, dp)
    check_injected_faults(config, dp, environ, world_size_in_nodes=config.world_size // per_node)
    plan_buddies(config, environ)


def check_recoverable_layout(config: Config) -> None:
    """The optimizer, parallelism and features a recovery can rebuild."""
    if not config.parallel.use_distributed_optimizer:
        raise ConfigError(
            "--deadpool mirrors the distributed optimizer's shard: add --use-distributed-optimizer"
        )
    if config.parallel.num_distributed_optimizer_instances > 1:
        raise ConfigError(
            "--deadpool with --num-distributed-optimizer-instances "
            f"{config.parallel.num_distributed_optimizer_instances}: the mirror holds shards "
            "of one distributed optimizer over the whole data-parallel group; use 1 under "
            "--deadpool"
        )
    if config.parallel.context_parallel_size > 1:
        raise ConfigError(
            f"--deadpool with --context-parallel-size {config.parallel.context_parallel_size}: "
            "a recovery rebuilds tensor, pipeline, data and expert-parallel groups, no "
            "context-parallel one yet; use --context-parallel-size 1 under --deadpool"
        )
    if config.moe.moe_token_dispatcher_type == "flex":
        # megatron-core keeps DeepEP's buffer in a module global bound to the
        # expert-parallel group, out of reach of a recovery's re-pointing.
        raise ConfigError(
            "--deadpool with --moe-token-dispatcher-type flex: DeepEP's and HybridEP's "
            "buffer holds the expert-parallel group that a recovery replaces; use alltoall "
            "(or allgather) under --deadpool"
        )
    if config.parallel.overlap_param_gather_with_optimizer_step:
        raise ConfigError(
            "--deadpool with --overlap-param-gather-with-optimizer-step: its optimizer is "
            "two distributed optimizers (the first model chunk's apart), whose mirrors and "
            "recoveries are not tested yet; drop the flag under --deadpool"
        )
    gpu_features = arguments.gpu_features_given(config)
    if gpu_features:
        # TE's userbuffers and graphs hold the process groups a recovery
        # replaces; the combined 1F1B plans, the offload manager's copies and
        # TE's random-state tracker are state no recovery has been run with.
        raise ConfigError(
            f"--deadpool with {', '.join(gpu_features)}: no recovery with it has been "
            "shown yet (GPU only; it keeps state a recovery would have to rebuild); drop it "
            "under --deadpool"
        )


def check_nodes(config: Config, dp: DeadpoolConfig, environ) -> int:
    """The node size, which must divide the world; returns it."""
    if dp.deadpool_ranks_per_node is not None and dp.deadpool_ranks_per_node < 1:
        raise ConfigError("--deadpool-ranks-per-node must be >= 1")
    per_node = ranks_per_node(dp, config.world_size, environ)
    if config.world_size % per_node:
        raise ConfigError(
            f"world size {config.world_size} is not a whole number of nodes of "
            f"{per_node} ranks: fix --deadpool-ranks-per-node or the launch"
        )
    return per_node


def check_hardware(config: Config, dp: DeadpoolConfig) -> None:
    """What this run's devices allow: where the mirror lies and what it
    sends, bit-exact redos, and which groups a hot swap keeps."""
    on_cpu = config.parallel.cpu or config.parallel.distributed_backend == "gloo"
    if dp.deadpool_mirror_memory == "device" and on_cpu:
        raise ConfigError(
            "--deadpool-mirror-memory device needs a GPU: use host (the default) on CPU runs"
        )
    if dp.deadpool_mirror_mode == "grad" and not on_cpu and dp.deadpool_mirror_memory == "host":
        raise ConfigError(
            "--deadpool-mirror-mode grad replays the optimizer step where the replica lies, "
            "and the host's arithmetic differs from the GPU's in the last bits: add "
            "--deadpool-mirror-memory device, or use --deadpool-mirror-mode state"
        )
    if not on_cpu and not config.training.deterministic_mode:
        arguments._warn(
            "--deadpool on GPUs without --deterministic-mode: a redone iteration equals the "
            "failure-free one bit for bit only with deterministic kernels (torch's fused "
            "attention and Transformer Engine's sum in another order each time); the "
            "recovered run is otherwise one of the runs the job could have made"
        )
    if dp.deadpool_rebuild_groups == "changed" and not on_cpu:
        # A kept group is known intact by gloo's count of completed
        # operations per group and the sockets it opened when made; NCCL
        # counts operations enqueued, not completed, and connects lazily.
        raise ConfigError(
            "--deadpool-rebuild-groups changed keeps gloo groups only, and this run's "
            "groups are NCCL's: use --deadpool-rebuild-groups all (the default)"
        )


def check_timeouts(dp: DeadpoolConfig) -> None:
    """Each timeout's own range, then their order."""
    if dp.deadpool_mirror_timeout <= 0:
        raise ConfigError("--deadpool-mirror-timeout must be > 0 seconds")
    if dp.deadpool_heartbeat_timeout <= 0:
        raise ConfigError("--deadpool-heartbeat-timeout must be > 0 seconds")
    if dp.deadpool_progress_timeout < 0:
        raise ConfigError("--deadpool-progress-timeout must be >= 0 seconds (0: no watch)")
    if dp.deadpool_recovery_timeout <= 0:
        # Counted from the detection (reports) and the decision (resume): any
        # heartbeat timeout fits.
        raise ConfigError("--deadpool-recovery-timeout must be > 0 seconds")
    if dp.deadpool_spare_wait < 0:
        raise ConfigError(
            "--deadpool-spare-wait must be >= 0 seconds (0: never wait for "
            "spares that are still starting)"
        )
    check_timeout_order(dp)


def check_timeout_order(dp: DeadpoolConfig) -> None:
    """The order the watches rely on (defaults.check_order), as a usage error."""
    try:
        check_order(
            dp.deadpool_heartbeat_timeout, dp.deadpool_mirror_timeout, dp.deadpool_recovery_timeout
        )
    except OrderError as error:
        raise ConfigError(str(error)) from None


def check_numeric_faults(config: Config, dp: DeadpoolConfig) -> None:
    """NaNs and corruptions are redone from memory under --deadpool."""
    if dp.deadpool_on_nan is not None and not config.training.check_for_nan_in_loss_and_grad:
        raise ConfigError(
            f"--deadpool-on-nan {dp.deadpool_on_nan} acts on what --check-for-nan-in-loss-and-grad "
            "finds, which is off (--no-check-for-nan-in-loss-and-grad turns it off, and so "
            "does --fp16 without --loss-scale, as Megatron-LM): drop --deadpool-on-nan"
        )
    take_over_result_validation(config)
    check_replicas_every_iteration(config)


def check_what_recovery_needs(config: Config, dp: DeadpoolConfig) -> None:
    """What a recovery asks of the training's own flags."""
    if dp.deadpool_on_spares_exhausted == "checkpoint" and not config.checkpoint.save:
        raise ConfigError(
            "--deadpool-on-spares-exhausted checkpoint writes the job's state to "
            "--save when spares run out: add --save DIR"
        )
    if (config.training.clip_grad or 0) <= 0:
        raise ConfigError(
            "--deadpool needs --clip-grad > 0: the grad-norm all-reduce over "
            "all ranks in every step keeps ranks within one iteration of each "
            "other, which the rollback after a failure relies on"
        )


def check_injected_faults(
    config: Config, dp: DeadpoolConfig, environ, world_size_in_nodes: int
) -> None:
    """--deadpool-inject: under the launcher, and each fault able to fire."""
    faults = checked_faults(dp)
    if faults and "DEADPOOL_SLOT" not in environ:
        raise ConfigError(
            "--deadpool-inject needs the deadpool launcher: run through "
            "python -m deadpool_ext.launch (deadpool-launch)"
        )
    for fault in faults:
        check_fault_can_fire(fault, config, world_size_in_nodes=world_size_in_nodes)


def checked_faults(dp: DeadpoolConfig) -> List[Fault]:
    """The --deadpool-inject specs parsed; a bad one is a usage error."""
    try:
        return parse_faults(dp.deadpool_inject)
    except InjectError as error:
        raise ConfigError(str(error)) from None


def check_spare_faults(dp: DeadpoolConfig, nodes: int) -> None:
    """A slow-warm fault names a spare node, which only the launcher knows
    (the workers check that it does not train)."""
    for fault in checked_faults(dp):
        if fault.action == "slow-warm" and fault.node >= nodes:
            raise ConfigError(
                f"--deadpool-inject slow-warm: node {fault.node} does not exist (the job has "
                f"nodes 0 to {nodes - 1}, spare nodes included)"
            )


def check_operations(dp: DeadpoolConfig) -> None:
    """The straggler watch's and the metrics endpoint's values."""
    if dp.deadpool_straggler_factor < 0 or 0 < dp.deadpool_straggler_factor <= 1:
        raise ConfigError(
            "--deadpool-straggler-factor must be > 1 (how many times slower than the other "
            "nodes), or 0 for no watch"
        )
    if dp.deadpool_straggler_window < 1:
        raise ConfigError("--deadpool-straggler-window must be at least 1 iteration")
    if dp.deadpool_on_straggler == "swap" and dp.deadpool_straggler_factor == 0:
        raise ConfigError(
            "--deadpool-on-straggler swap needs the watch: drop --deadpool-straggler-factor 0"
        )
    if dp.deadpool_metrics_port is not None and not 0 <= dp.deadpool_metrics_port < 65536:
        raise ConfigError("--deadpool-metrics-port must be a TCP port (0 to 65535)")


def take_over_result_validation(config: Config) -> None:
    """Under --deadpool a NaN or Inf is redone from the buddies' mirror
    (--deadpool-on-nan): megatron-core's rerun state machine only checks
    (disabled mode), so a rejected result reaches the recovery at once."""
    t = config.training
    given = [f"--rerun-mode {t.rerun_mode}"] if t.rerun_mode not in (None, "disabled") else []
    given += ["--error-injection-rate"] if t.error_injection_rate else []
    if given:
        arguments._warn(
            f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect under "
            "--deadpool: --deadpool-on-nan redoes an iteration whose loss or gradients went "
            "NaN or Inf from the buddies' mirror, in place of megatron-core's rerun in place"
        )
    t.rerun_mode = "disabled"


def check_replicas_every_iteration(config: Config) -> None:
    """Megatron-LM's weight-hash check, every iteration under --deadpool
    unless the flag asks for another interval: a difference is redone from
    memory (--deadpool-on-sdc), and the digest costs one read of the
    parameters (docs/benchmarks.md)."""
    t = config.training
    if t.check_weight_hash_across_dp_replicas_interval is None:
        t.check_weight_hash_across_dp_replicas_interval = WEIGHT_CHECK_INTERVAL


def check_fault_can_fire(fault, config: Config, world_size_in_nodes: int) -> None:
    """A fault that could never fire is a test that cannot fail: refused."""
    where = f"--deadpool-inject {fault.action}"
    if fault.action == "slow-warm":
        if fault.node < world_size_in_nodes:
            raise ConfigError(
                f"{where}: node {fault.node} trains (nodes 0 to {world_size_in_nodes - 1} do): "
                "name a spare node, whose spares warm up"
            )
        return
    if fault.rank is not None and fault.rank >= config.world_size:
        raise ConfigError(
            f"{where}: rank {fault.rank} does not exist (world size {config.world_size})"
        )
    if fault.node is not None and fault.node >= world_size_in_nodes:
        raise ConfigError(
            f"{where}: node {fault.node} does not train (nodes 0 to {world_size_in_nodes - 1} "
            "do; spare nodes hold no rank until one dies)"
        )
    p = config.parallel
    started_in_forward = p.overlap_param_gather and not p.overlap_param_gather_with_optimizer_step
    if fault.phase == "optimizer" and started_in_forward:
        raise ConfigError(
            f"{where}: phase=optimizer never comes with --overlap-param-gather (each bucket's "
            "all-gather starts in the next forward, not after the step): choose another phase"
        )
    last = config.training.train_iters
    if fault.phase != "recovery" and fault.iteration > last:
        raise ConfigError(f"{where}: iter={fault.iteration} comes after the last one ({last})")
    c = config.checkpoint
    saves = c.save and (
        fault.iteration == last
        or (c.save_interval and fault.iteration % c.save_interval == 0)
        or (
            c.non_persistent_save_interval and fault.iteration % c.non_persistent_save_interval == 0
        )
    )
    if fault.phase == "save" and not saves:
        raise ConfigError(
            f"{where}: phase=save at iter={fault.iteration}, but no checkpoint is saved after "
            "that iteration: give --save and a --save-interval that divides it"
        )


def parse_args(
    argv=None,
    environ=os.environ,
    world_size: Optional[int] = None,
    defaults: Optional[dict] = None,
    extra_args_provider=None,
) -> Config:
    """Megatron's flags plus the --deadpool ones, all checked before any
    process group starts. Under deadpool-launch a refusal is also written
    where the agent reads it, so the launcher says why the job stopped.
    ``world_size``: a job of that size (the tools' probes), not this one;
    ``defaults``, ``extra_args_provider``: a Megatron-LM script's
    (arguments.parse_args)."""
    try:
        return arguments.parse_args(
            argv,
            extra_sections={"deadpool": DeadpoolConfig},
            extra_validators=[validate_deadpool],
            world_size=world_size,
            defaults=defaults,
            extra_args_provider=extra_args_provider,
        )
    except ConfigError as error:
        if environ.get(ERROR_FILE_ENV):
            with open(environ[ERROR_FILE_ENV], "w") as f:
                f.write(str(error))
        raise
