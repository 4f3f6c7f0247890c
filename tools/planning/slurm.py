"""The layout of a Slurm job under deadpool-launch, worked out on paper: which
node hosts which (TP, PP, DP) ranks, which nodes are warm spares, every
rank's buddy, the memory plan, and the checks a job of that shape must pass.
tools/slurm_plan.py is its command line (the sbatch scripts' --dry-run).

Rank placement follows deadpool-launch: node k runs ranks k*G .. k*G+G-1
(G ranks per node); nodes nnodes .. nnodes+spares-1 start warm spares.

The training flags are parsed by pretrain_gpt.py's own parser, which imports
megatron; so that this module does not, the caller passes the parser in
(``make_plan``'s ``parse``) and the types below are for annotations only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from tools.planning import scale

if TYPE_CHECKING:
    from deadpool_ext.topology import BuddyMap
    from megatron.training.config import Config

# (training flags, world size, ranks per node, gpu) -> the parsed flags and
# the buddy map; raises PlanError where the job would refuse to start.
ParseTraining = Callable[[List[str], int, int, bool], Tuple["Config", "BuddyMap"]]


class PlanError(ValueError):
    """The script cannot run as written; the message says what to change."""


@dataclass(frozen=True)
class Rank:
    rank: int
    node: int
    local: int
    tp: int
    pp: int
    dp: int
    buddy: int  # holds this rank's mirror
    owner: int  # whose mirror this rank holds


# ----- ranks, nodes and buddies -----
def coordinates(rank: int, tp: int, pp: int, dp: int, tp_pp_dp: bool) -> tuple:
    """(tp, pp, dp) of a rank: the inverse of deadpool_ext.topology.rank_of."""
    t, rest = rank % tp, rank // tp
    if tp_pp_dp:
        return t, rest % pp, rest // pp
    return t, rest // dp, rest % dp


def rank_table(config: Config, ranks_per_node: int, buddies: BuddyMap) -> List[Rank]:
    p = config.parallel
    tp, pp, dp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        config.data_parallel_size,
    )
    table = []
    for r in range(config.world_size):
        t, s, d = coordinates(r, tp, pp, dp, p.use_tp_pp_dp_mapping)
        table.append(
            Rank(
                r,
                r // ranks_per_node,
                r % ranks_per_node,
                t,
                s,
                d,
                buddies.buddy[r],
                buddies.owner[r],
            )
        )
    return table


# ----- the model, for the planner -----
def vocabulary(config: Config) -> Optional[int]:
    """The tokenizer's vocabulary where it is known without loading files."""
    d = config.tokenizer
    if d.tokenizer_type == "NullTokenizer":
        return d.vocab_size + 1  # ids 0..V-1 and the end-of-document id V
    if d.tokenizer_type == "ByteLevelTokenizer":
        return d.vocab_size or 512
    if d.tokenizer_type == "GPT2BPETokenizer" and os.path.isfile(d.vocab_file or ""):
        with open(d.vocab_file, encoding="utf-8") as f:
            return len(json.load(f))  # GPT-2's vocab.json: token -> id
    return None


def model_shape(config: Config, name: str) -> Optional[scale.ModelShape]:
    m, vocab = config.model, vocabulary(config)
    if vocab is None:
        return None
    return scale.ModelShape(
        name,
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.ffn_hidden_size,
        vocab,
        m.seq_length,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        swiglu=m.swiglu,
        normalization=m.normalization,
        add_bias_linear=not m.disable_bias_linear,
        position_embedding=m.position_embedding_type,
        max_position_embeddings=m.max_position_embeddings,
        tied_embeddings=not m.untie_embeddings_and_output_weights,
        dropout=m.hidden_dropout > 0 or m.attention_dropout > 0,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        num_experts=config.moe.num_experts,
        moe_ffn_hidden_size=config.moe.moe_ffn_hidden_size,
        moe_router_topk=config.moe.moe_router_topk,
    )


def comparable(shape: scale.ModelShape) -> dict:
    """A shape's fields with defaults resolved, without its name."""
    fields = asdict(shape)
    del fields["name"]
    fields["num_query_groups"] = shape.groups
    fields["kv_channels"] = shape.head_dim
    fields["max_position_embeddings"] = shape.max_position_embeddings or shape.seq_length
    fields["moe_ffn_hidden_size"] = shape.expert_ffn if shape.num_experts else None
    return fields


def shape_differences(shape: scale.ModelShape, model: str) -> List[str]:
    want = comparable(scale.MODELS[model])
    got = comparable(shape)
    return [f"{k} {got[k]} (the planner's {model}: {want[k]})" for k in want if got[k] != want[k]]


def parallel_of(config: Config) -> scale.Parallel:
    p, b, t = config.parallel, config.batch, config.training
    return scale.Parallel(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        config.data_parallel_size,
        b.micro_batch_size,
        b.global_batch_size,
        sequence_parallel=p.sequence_parallel,
        recompute=t.recompute_granularity or "none",
        precision="bf16" if t.bf16 else "fp32",
        overlap_grad_reduce=p.overlap_grad_reduce,
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size,
        mirror_mode=deadpool_flags(config).deadpool_mirror_mode,
    )


def deadpool_flags(config: Config):
    """The job's --deadpool* flags: the training flags are parsed with
    deadpool_ext.config.parse_args (tools/slurm_plan.py), which always
    fills this section. Found by a flag it holds: this module imports
    neither megatron nor deadpool's config, whose type keys the section."""
    return next(s for s in config.extensions.values() if hasattr(s, "deadpool_mirror_mode"))


# ----- the script's #SBATCH header -----
def sbatch_directives(path: str) -> List[str]:
    """The options of the #SBATCH lines sbatch reads: those before the first
    line that is neither a comment nor blank."""
    options = []
    with open(path) as f:
        for line in f:
            text = line.strip()
            if text and not text.startswith("#"):
                break
            if text.startswith("#SBATCH"):
                options += text[len("#SBATCH") :].split()
    return options


def directive(options: List[str], *names: str) -> Optional[str]:
    """The value of --name=V, --name V or -n V among the options (last wins)."""
    value = None
    for i, option in enumerate(options):
        for name in names:
            if option.startswith(name + "=") and name.startswith("--"):
                value = option.split("=", 1)[1]
            elif option == name and i + 1 < len(options):
                value = options[i + 1]
    return value


def signal_lead(options: List[str]) -> Optional[int]:
    """Seconds before the time limit that --signal=[B:]SIG@T asks for."""
    value = directive(options, "--signal")
    match = re.fullmatch(r"(?:B:)?[A-Z0-9]+@(\d+)", value or "")
    return int(match.group(1)) if match else None


# ----- the plan -----
@dataclass
class JobPlan:
    script: Optional[str]
    model: Optional[str]
    hardware: Optional[str]
    nodes: int
    spare_nodes: int
    ranks_per_node: int
    hosts: List[str]
    config: Config
    ranks: List[Rank]
    buddy_shift: int
    shape: Optional[scale.ModelShape]
    memory: Optional[scale.Plan]
    sbatch: List[str]
    training: List[str]
    checks: Dict[str, bool]

    @property
    def spare_node_ids(self) -> List[int]:
        return list(range(self.nodes, self.nodes + self.spare_nodes))


def host_names(hosts: Optional[List[str]], total: int) -> List[str]:
    if not hosts:
        return [f"node{k}" for k in range(total)]
    if len(hosts) != total:
        raise PlanError(f"{len(hosts)} host names for {total} nodes")
    return list(hosts)


def check_counts(nodes: int, spare_nodes: int, ranks_per_node: int) -> None:
    if nodes < 1 or ranks_per_node < 1 or spare_nodes < 0:
        raise PlanError(
            "need NODES >= 1, RANKS_PER_NODE >= 1 and SPARE_NODES >= 0 "
            f"(got {nodes}, {ranks_per_node}, {spare_nodes})"
        )


def check_header(options: List[str], total_nodes: int) -> None:
    """sbatch allocates what the header says; the launch assumes NODES + SPARE_NODES."""
    asked = directive(options, "-N", "--nodes")
    if asked is not None and asked != str(total_nodes):
        raise PlanError(
            f"#SBATCH -N {asked}, but NODES + SPARE_NODES = {total_nodes}: make them agree"
        )


def layout_checks(plan: JobPlan) -> Dict[str, bool]:
    """What a job of this shape must satisfy; printed, and tested."""
    ranks, per_node = plan.ranks, plan.ranks_per_node
    by_node = {r.rank: r.node for r in ranks}
    tp_nodes: Dict[tuple, set] = {}
    for r in ranks:
        tp_nodes.setdefault((r.pp, r.dp), set()).add(r.node)
    return {
        "world size = active nodes x ranks per node": len(ranks) == plan.nodes * per_node,
        "every active node runs ranks per node ranks": all(
            sum(r.node == k for r in ranks) == per_node for k in range(plan.nodes)
        ),
        "each tensor-parallel group inside one node": all(
            len(nodes) == 1 for nodes in tp_nodes.values()
        ),
        "every buddy on another node": all(by_node[r.buddy] != r.node for r in ranks),
        "spare nodes hold no rank": all(r.node < plan.nodes for r in ranks),
        "at least one spare node": plan.spare_nodes >= 1,
    }


def make_plan(
    nodes: int,
    spare_nodes: int,
    ranks_per_node: int,
    argv: List[str],
    parse: ParseTraining,
    hardware: Optional[str] = None,
    model: Optional[str] = None,
    script: Optional[str] = None,
    hosts: Optional[List[str]] = None,
    mfu: float = 0.45,
) -> JobPlan:
    """The job's plan; the cheap checks of the request come before ``parse``
    reads the training flags, so a bad request fails first and fast."""
    check_counts(nodes, spare_nodes, ranks_per_node)
    if model is not None and model not in scale.MODELS:
        raise PlanError(f"unknown model {model!r}: one of {', '.join(scale.MODELS)}")
    if hardware is not None and hardware not in scale.HARDWARE:
        raise PlanError(f"unknown hardware {hardware!r}: one of {', '.join(scale.HARDWARE)}")
    options = sbatch_directives(script) if script else []
    check_header(options, nodes + spare_nodes)
    config, buddies = parse(argv, nodes * ranks_per_node, ranks_per_node, hardware is not None)
    shape = model_shape(config, model or "this script's model")
    memory = None
    if hardware is not None and shape is not None:
        in_device = deadpool_flags(config).deadpool_mirror_memory == "device"
        memory = scale.plan(shape, parallel_of(config), scale.HARDWARE[hardware], mfu, in_device)
    plan = JobPlan(
        script,
        model,
        hardware,
        nodes,
        spare_nodes,
        ranks_per_node,
        host_names(hosts, nodes + spare_nodes),
        config,
        rank_table(config, ranks_per_node, buddies),
        buddies.shift,
        shape,
        memory,
        options,
        list(argv),
        {},
    )
    plan.checks = layout_checks(plan)
    if model is not None and shape is not None:
        name = f"shape of {model} (tools/planning/scale.py)"
        plan.checks[name] = not shape_differences(shape, model)
    if memory is not None:
        plan.checks[f"fits in {memory.hardware.gpu_memory_gib:g} GiB per GPU"] = memory.fits
    return plan


# ----- output -----
def rank_cell(r: Rank, plan: JobPlan) -> str:
    buddy_node = plan.ranks[r.buddy].node
    return f"{r.rank}({r.tp},{r.pp},{r.dp})->{r.buddy}@{buddy_node}"


def node_lines(plan: JobPlan) -> List[str]:
    width = max(len(h) for h in plan.hosts)
    lines = [f"{'node':>5}  {'host':<{width}}  role    rank(tp,pp,dp)->buddy@node"]
    by_node: Dict[int, List[Rank]] = {}
    for r in plan.ranks:
        by_node.setdefault(r.node, []).append(r)
    for k, host in enumerate(plan.hosts):
        if k in by_node:
            cells = "  ".join(rank_cell(r, plan) for r in by_node[k])
            lines.append(f"{k:>5}  {host:<{width}}  active  {cells}")
        else:
            lines.append(
                f"{k:>5}  {host:<{width}}  spare   {plan.ranks_per_node} warm spare "
                "processes: take a lost node's ranks, its buddies' mirrors restore them"
            )
    return lines


def experts_of(c: Config) -> str:
    """An MoE job's expert layout (its buddies stay within expert-DP)."""
    if c.moe.num_experts is None:
        return ""
    return scale.experts_of(parallel_of(c))


def headline(plan: JobPlan) -> str:
    c, p = plan.config, plan.config.parallel
    order = " (rank order tp, pp, dp)" if p.use_tp_pp_dp_mapping else ""
    return (
        f"{plan.script or 'job'}: {plan.nodes} active + {plan.spare_nodes} spare nodes x "
        f"{plan.ranks_per_node} ranks = {c.world_size} ranks, "
        f"TP{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size} "
        f"DP{c.data_parallel_size}{experts_of(c)}, micro-batch {c.batch.micro_batch_size}, "
        f"global batch "
        f"{c.batch.global_batch_size}{order}"
    )


def describe(plan: JobPlan) -> str:
    lines = [
        headline(plan),
        f"buddies: each rank mirrors its optimizer shard to the rank {plan.buddy_shift} "
        "step(s) along its data-parallel ring",
    ]
    lines += node_lines(plan)
    if plan.memory is not None:
        lines.append("memory (tools/planning/scale.py, an estimate):")
        lines += ["  " + line for line in scale.describe(plan.memory).splitlines()]
    lead = signal_lead(plan.sbatch)
    if lead is not None:
        lines.append(
            f"SIGTERM {lead} s before the time limit (--signal): the running iteration"
            " and a checkpoint save must fit in it (--exit-signal-handler)"
        )
    if plan.model and plan.shape is not None:
        lines += [f"  differs: {d}" for d in shape_differences(plan.shape, plan.model)]
    lines += [f"check: {'ok  ' if ok else 'FAIL'} {name}" for name, ok in plan.checks.items()]
    return "\n".join(lines)


def to_json(plan: JobPlan) -> dict:
    c, p = plan.config, plan.config.parallel
    out = {
        "script": plan.script,
        "model": plan.model,
        "hardware": plan.hardware,
        "nodes": plan.nodes,
        "spare_nodes": plan.spare_nodes,
        "ranks_per_node": plan.ranks_per_node,
        "world_size": c.world_size,
        "tp": p.tensor_model_parallel_size,
        "pp": p.pipeline_model_parallel_size,
        "dp": c.data_parallel_size,
        "ep": p.expert_model_parallel_size,
        "expert_tp": p.expert_tensor_parallel_size,
        "micro_batch": c.batch.micro_batch_size,
        "global_batch": c.batch.global_batch_size,
        "sequence_parallel": p.sequence_parallel,
        "tp_pp_dp_mapping": p.use_tp_pp_dp_mapping,
        "buddy_shift": plan.buddy_shift,
        "hosts": plan.hosts,
        "spare_node_ids": plan.spare_node_ids,
        "ranks": [asdict(r) for r in plan.ranks],
        "sbatch": plan.sbatch,
        "training_args": plan.training,
        "signal_lead_s": signal_lead(plan.sbatch),
        "checks": plan.checks,
        "shape": asdict(plan.shape) if plan.shape else None,
        "memory": None,
    }
    if plan.memory is not None:
        m = plan.memory
        out["memory"] = {
            "worst_stage": m.memory.stage,
            "total_gib": m.memory.total / 2**30,
            "limit_gib": m.hardware.gpu_memory_gib,
            "fits": m.fits,
            "mirror_gib_per_gpu": m.memory.mirror_bytes / 2**30,
            "mirror_in_device": m.memory.mirror_in_device,
            "sent_mib_per_iteration": m.layout.sent_bytes / 2**20,
            "iteration_s": m.time.iteration,
        }
    return out
