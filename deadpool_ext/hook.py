"""The mirror as a training-loop hook: snapshot at every iteration start,
hold the optimizer step until the shard is copied out, report in the log line.
"""

import dataclasses
import socket
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.training import checkpointing
from megatron.training.config import Config
from megatron.training.log import get_logger
from megatron.training.training import Hook, Trainer

from deadpool_ext import snapshot as snap
from deadpool_ext.buddies import BuddyError, BuddyMap, buddy_map
from deadpool_ext.config import nodes_are_emulated, plan_buddies, section
from deadpool_ext.events import EventLog
from deadpool_ext.mirror import Mirror, new_mirror_group


def replay_state(trainer: Trainer) -> dict:
    """What exact replay needs beside the optimizer shard, as of now (the
    start of an iteration)."""
    return {"progress": dataclasses.asdict(trainer.progress),
            "rng": checkpointing.rng_state(), **checkpointing.schedule_state(trainer.state)}


def runtime_buddies(config: Config) -> BuddyMap:
    """The plan checked in parse_args, confirmed with real hostnames unless
    nodes are emulated (a multi-node job whose hosts hold uneven rank blocks
    gets its buddies from the hostnames)."""
    planned = plan_buddies(config)
    if nodes_are_emulated(config):
        return planned
    hosts: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    p, dp = config.parallel, section(config)
    try:
        return buddy_map(config.world_size, p.tensor_model_parallel_size,
                         p.pipeline_model_parallel_size, hosts,
                         allow_same_node=dp.deadpool_allow_same_node_buddy,
                         tp_pp_dp=p.use_tp_pp_dp_mapping)
    except BuddyError as error:
        raise SystemExit(f"--deadpool: {error}") from None


def mirror_backend(config: Config) -> str:
    """Host-memory mirrors travel over gloo, device-memory ones over NCCL."""
    return "nccl" if section(config).deadpool_mirror_memory == "device" else "gloo"


class MirrorHook(Hook):
    def __init__(self, config: Config):
        self.config = config
        self.mirror: Optional[Mirror] = None
        self.layout: Optional[snap.ShardLayout] = None
        self.events: Optional[EventLog] = None
        self.buddies: Optional[BuddyMap] = None

    def on_setup(self, trainer: Trainer) -> None:
        dp, rank = section(self.config), trainer.runtime.rank
        logger = get_logger(rank)
        self.events = EventLog(dp.deadpool_events, rank)
        self.layout = snap.build_layout(trainer.state.optimizer)
        device = None if trainer.runtime.on_cpu else torch.device("cuda",
                                                                   torch.cuda.current_device())
        in_device = dp.deadpool_mirror_memory == "device"
        group = new_mirror_group(mirror_backend(self.config), dp.deadpool_mirror_timeout)
        if self.config.data_parallel_size < 2:
            # Only a job shrunk to one replica gets here (parse_args refuses
            # DP=1): there is no peer to mirror to, and a lost rank ends the
            # job. Own snapshots are still taken: a grow starts from them.
            logger.warning("deadpool mirror: one data-parallel replica is left; own "
                           "snapshots only, no buddy")
            self.events.emit("mirror_local", reason="one data-parallel replica left")
            self.mirror = Mirror(trainer.state.optimizer, self.layout, rank, rank, rank, group,
                                 self.events, device)
            self.mirror.allocate("device" if in_device else "cpu")
            return
        buddies = self.buddies = runtime_buddies(self.config)
        self.mirror = Mirror(trainer.state.optimizer, self.layout, rank, buddies.buddy[rank],
                             buddies.owner[rank], group, self.events, device)
        self.mirror.allocate("device" if in_device else "cpu")
        if buddies.same_node:
            logger.warning("--deadpool-allow-same-node-buddy: some buddies share a node with "
                           "their owner; losing that node loses their state")
        logger.info("deadpool mirror: buddy %d, owner %d, snapshot %.1f MB, %.1f MB extra "
                    "(%s memory)", buddies.buddy[rank], buddies.owner[rank],
                    self.layout.nbytes / 2**20, self.mirror.extra_bytes / 2**20,
                    dp.deadpool_mirror_memory)
        self.events.emit("mirror_ready", buddy=buddies.buddy[rank], owner=buddies.owner[rank],
                         shard_elements=self.layout.numel, snapshot_bytes=self.layout.nbytes,
                         extra_bytes=self.mirror.extra_bytes, memory=dp.deadpool_mirror_memory,
                         same_node=buddies.same_node)

    def rebind(self, trainer: Trainer) -> None:
        """Point the mirror at rebuilt model and optimizer objects (same layout)."""
        self.mirror.wait_idle()
        layout = snap.build_layout(trainer.state.optimizer)
        if (layout.numel, layout.nbytes) != (self.layout.numel, self.layout.nbytes):
            raise snap.SnapshotError("the rebuilt optimizer has another shard layout")
        self.layout = self.mirror.layout = layout
        self.mirror.optimizer = trainer.state.optimizer

    def before_step(self, trainer: Trainer) -> None:
        if self.mirror is not None:
            self.mirror.start(trainer.progress.iteration, replay_state(trainer))

    def before_optimizer_step(self, trainer: Trainer) -> None:
        if self.mirror is not None:
            self.mirror.wait_exchanged()

    def log_fields(self, trainer: Trainer) -> List[str]:
        if self.mirror is None:
            return ["mirror: off"]
        if self.mirror.local:
            return ["mirror: local"]
        held = self.mirror.held_iteration()
        return [f"mirror held: {'-' if held is None else held}"]

    def on_train_end(self, trainer: Trainer) -> None:
        """Mirror the final state too, so the buddies hold where training ended."""
        if self.mirror is None:
            self.events.close()
            return
        self.mirror.start(trainer.progress.iteration, replay_state(trainer))
        self.mirror.wait_idle()
        self.events.emit("mirror_done", iteration=trainer.progress.iteration,
                         held=self.mirror.held_iteration())
        self.mirror.close()
        self.events.close()


def deadpool_hooks(config: Config) -> list:
    return [MirrorHook(config)] if section(config).deadpool else []
