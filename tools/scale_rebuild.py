"""docs/scale.md's section 3: what rebuilding the process groups costs after
a failure as the job grows, a full rebuild (what recovery does) against a
partial one (`--deadpool-rebuild-groups changed`), from

- megatron-core's real groups at each size (``tools.layout_probe --groups``,
  a fake world: nothing runs at scale),
- one group's costs measured on this machine and the rebuilds measured at
  8, 16 and 32 ranks (``tools.bench.recovery --scale``, recorded in
  docs/data/bench_recovery_scale.json),
- the arithmetic of ``tools/planning/rebuild_cost.py``.

Called by ``tools.scale_report``, which writes the page.
"""

import functools
import json
import os
from typing import Dict, List, Sequence

from tools.planning import rebuild_cost as rg
from deadpool_ext.topology import Grid
from tools import layout_probe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED_FILE = os.path.join(REPO, "docs", "data", "bench_recovery_scale.json")
MEASURE_COMMAND = (
    "python -m tools.bench.recovery --scale 8 16 32 --iters 12 --fail-at 8 "
    "--output docs/data/bench_recovery_scale.json"
)

# The layouts: LLaMA-65B's (TP 4, PP 8, Megatron's default rank order, a
# node is a TP group) and the demo's (TP 2, PP 2, one replica per node).
# Groups do not depend on the model's size; these shapes only satisfy the
# flags' checks.
LLAMA = Grid(4, 8, 1)
DEMO = Grid(2, 2, 1, tp_pp_dp=True)
NODE_GPUS = 4
SIZES = (128, 512, 2048, 8192, 16384)


def flags(grid: Grid, world: int) -> List[str]:
    shape = ["--num-layers", str(grid.pp), "--hidden-size", "128", "--num-attention-heads", "4"]
    shape += ["--seq-length", "128", "--max-position-embeddings", "128"]
    dp = world // (grid.tp * grid.pp)
    batch = ["--micro-batch-size", "1", "--global-batch-size", str(dp)]
    order = ["--use-tp-pp-dp-mapping"] if grid.tp_pp_dp else []
    parallel = ["--tensor-model-parallel-size", str(grid.tp)]
    parallel += ["--pipeline-model-parallel-size", str(grid.pp)]
    mirror = ["--deadpool", "--deadpool-ranks-per-node", str(NODE_GPUS)]
    return parallel + order + shape + batch + ["--train-iters", "1", "--lr", "1e-3"] + mirror


def probe(grid: Grid, world: int, ranks: Sequence[int]) -> List[dict]:
    """megatron-core's groups of ``ranks`` in a ``world``-rank job."""
    options = ["--groups", "--world-size", str(world), "--ranks", *map(str, ranks)]
    return layout_probe.in_subprocess(options, flags(grid, world))


@functools.lru_cache(maxsize=None)
def first_rank(grid: Grid, world: int) -> dict:
    """Rank 0's groups in a ``world``-rank job of ``grid``'s TP and PP."""
    (rank,) = probe(grid.with_dp(world // (grid.tp * grid.pp)), world, [0])
    return rank


def measured_costs(measured: dict) -> rg.GroupCosts:
    """One group's costs from the floor with the fewest processes: on this
    machine's two cores every process of a group competes for them, so a
    member's cost grows with the group's size (the floors show it); on a
    cluster each rank has cores of its own."""
    floor = min(measured["floor"], key=lambda f: f["ranks"])
    return rg.GroupCosts(per_call=floor["per_call"], per_member=floor["per_member"])


def node_of(rank: int) -> List[int]:
    first = rank - rank % NODE_GPUS
    return list(range(first, first + NODE_GPUS))


def replica_ranks(grid: Grid, dp: int) -> List[int]:
    return [grid.rank(t, dp, p) for p in range(grid.pp) for t in range(grid.tp)]


def kinds_table(grid: Grid, dp: int) -> str:
    """Per group kind, how many survivors rebuild their group of that kind
    in a partial rebuild when node 1 is lost: hot swap (its ranks replaced),
    shrink (its replica leaves), grow back (a replica joins)."""
    before, after = grid.with_dp(dp), grid.with_dp(dp + 1)
    lost = node_of(NODE_GPUS)
    dropped = replica_ranks(before, before.replica(lost[0]))
    added = replica_ranks(after, dp)
    old = probe(before, before.world_size, range(before.world_size))
    new = probe(after, after.world_size, range(after.world_size))
    rows = []
    for role, ranks in old[0]["held"].items():
        swap = _rebuilding(old, role, set(lost))
        shrink = _rebuilding(old, role, set(dropped))
        grow = _rebuilding(new, role, set(added))
        rows.append([f"`{role}`", len(ranks), swap, shrink, grow])
    header = [
        "group (role)",
        "members",
        f"hot swap: survivors rebuilding, of {before.world_size - len(lost)}",
        f"shrink: of {before.world_size - len(dropped)}",
        f"grow: of {before.world_size}",
    ]
    return _table(header, rows)


def _rebuilding(probes: List[dict], role: str, changed: set) -> int:
    """Survivors (not in ``changed``) whose group of ``role`` has a changed member."""
    return sum(
        1
        for p in probes
        if p["rank"] not in changed and role in p["held"] and changed & set(p["held"][role])
    )


def time_rows(costs: rg.GroupCosts) -> List[list]:
    """Full vs partial rebuild of a hot swap at each size, LLaMA's layout.
    The slowest rank of a partial rebuild is the spare, which builds every
    group of its position; the world-spanning groups (every rank a member)
    are where the time goes, so the last column prices each of them as a
    two-rank group (what connecting them lazily or editing them in place
    would buy: a rendezvous, and the peers a rank talks to)."""
    rows = []
    for world in SIZES:
        rank = first_rank(LLAMA, world)
        held, created = rank["held"], rank["groups_created"]
        spread = {r: m for r, m in held.items() if len(m) == world}
        local = {r: m for r, m in held.items() if r not in spread}
        everything, cost = set(range(world)), costs.per_member
        rows.append(
            [
                f"{world:,}",
                f"{created:,}",
                len(held),
                f"{rg.members(held):,}",
                _s(rg.full_rebuild_s(held, created, costs)),
                _s(rg.partial_rebuild_s(held, everything, costs)),
                _s(rg.partial_rebuild_s(local, everything, costs) + 2 * len(spread) * cost),
            ]
        )
    return rows


def calls_at_largest(costs: rg.GroupCosts) -> float:
    rank = first_rank(LLAMA, SIZES[-1])
    return (rank["groups_created"] - len(rank["held"])) * costs.per_call


def check_rows(measured: dict, costs: rg.GroupCosts) -> List[list]:
    """The model against the measured rebuilds (the demo's layout)."""
    rows = []
    for run in measured["scale"]:
        world = run["ranks"]
        rank, m = first_rank(DEMO, world), run["median"]
        rows.append(
            [
                world,
                f"{m['groups_created']:.0f} / {rank['groups_created']}",
                f"{m['groups_ms']:.0f} ms",
                f"{rg.full_rebuild_s(rank['held'], rank['groups_created'], costs) * 1e3:.0f} ms",
                f"{run['to_first_iteration_s']:.2f} s",
            ]
        )
    return rows


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def read_measured() -> Dict:
    with open(MEASURED_FILE) as f:
        return json.load(f)


def section(probe_layouts: bool = True) -> str:
    """The page's section 3 (a pointer to the command where it is skipped)."""
    try:
        measured = read_measured()
    except (OSError, ValueError):
        missing = "No docs/data/bench_recovery_scale.json."
        return f"## 3. Recovery time: rebuilding the groups\n\n{missing}\n"
    costs = measured_costs(measured)
    if not probe_layouts:
        return (
            "## 3. Recovery time: rebuilding the groups\n\n"
            "Skipped (`--no-probe`): it needs megatron-core's groups at each size.\n"
        )
    return SECTION.format(
        measured=_table(
            [
                "ranks",
                "groups created / held per rank",
                "connections per rank",
                "groups (median rank, slowest)",
                "rebuild stage",
                "fault to first iteration",
                "iteration",
            ],
            [
                [
                    r["ranks"],
                    f"{r['median']['groups_created']:.0f} / {r['median']['groups_held']:g}",
                    f"{r['median']['connections']:.0f}",
                    f"{r['median']['groups_ms']:.0f} ms, {r['slowest']['groups_ms']:.0f} ms",
                    f"{dict(r['breakdown_ms'])['rebuild groups']} ms",
                    f"{r['to_first_iteration_s']:.2f} s",
                    f"{r['iteration_s']:.2f} s",
                ]
                for r in measured["scale"]
            ],
        ),
        floor=_table(
            ["gloo processes", "a group the rank is not in", "a member's cost, by group size"],
            [
                [
                    f["ranks"],
                    f"{f['per_call'] * 1e3:.3f} ms",
                    ", ".join(f"{n} ranks: {t * 1e3:.1f} ms" for n, t in f["member"].items()),
                ]
                for f in measured["floor"]
            ],
        ),
        per_call=costs.per_call * 1e3,
        per_member=costs.per_member * 1e3,
        check=_table(
            [
                "ranks",
                "groups created: run / megatron-core",
                "measured",
                "model",
                "fault to first iteration",
            ],
            check_rows(measured, costs),
        ),
        kinds=kinds_table(LLAMA, 4),
        times=_table(
            [
                "GPUs",
                "groups created per rank",
                "held",
                "members of its groups",
                "full rebuild",
                "partial (the spare builds its groups)",
                "partial, world-spanning groups not connected eagerly",
            ],
            time_rows(costs),
        ),
        command=MEASURE_COMMAND,
        calls_s=_s(calls_at_largest(costs)),
    )


SECTION = """## 3. Recovery time: rebuilding the groups (`tools/planning/rebuild_cost.py`)

A hot swap, a shrink and a grow each rebuild every process group of every rank: each rank
takes part in creating every group of the world (torch's `new_group` is called by all ranks,
in the same order, members or not), and for each group it holds reads every member's address
from the store and connects to each (gloo connects a full mesh when a group is made). The
mirror's groups are pairs, a rank with its buddy and with its owner: a rank holds two, with
one peer each, at any size.
Measured on this machine (**our measurement**, `{command}`: the demo's model on TP2·PP2 with
one replica per emulated 4-rank node and one spare node, node 1 killed in iteration 8; the
2 cores serve every process, so the iteration grows with the ranks; medians over ranks, and
the last pipeline stage's ranks hold one group fewer than the first's):

{measured}

One group's cost to a rank, measured alone on as many gloo processes with a TCP store (the
same command's floor: 8 groups of each size, made of the first ranks; the other ranks'
calls are the first column):

{floor}

The model: {per_call:.3f} ms for each group a rank does not hold, and {per_member:.2f} ms per
member for each group it holds, from the floor with the fewest processes. On this machine a
member's cost grows with the group (a group of n makes n(n-1) connection ends, all on the same
two cores): a cluster gives each rank cores of its own, which the smallest floor is closest
to. Against the runs above (groups counted by the runs and by megatron-core in a fake world of
the same size; the gap that grows with the ranks is that sharing, made worse in the job by
the spares, agents and store on the same cores):

{check}

Which groups a partial rebuild would create again, per kind, for LLaMA-65B's layout (TP 4, PP
8, Megatron's default rank order) at 128 GPUs (DP 4) on 4-GPU nodes, node 1 lost (megatron-
core's groups of every rank, in a fake world; `deadpool_mirror_to_buddy` is the mirror's
pair group of a rank and its buddy, which with DP 4 is not the one of its owner,
`deadpool_mirror_from_owner`; `WORLD` the default group). A group is kept where no member
changed: a hot swap replaces node 1's ranks, a shrink removes node 1's whole replica, a grow
adds a replica:

{kinds}

What the slowest rank of a hot swap's rebuild spends at LLaMA-65B's layout as the job grows,
with the costs above (gloo on this machine's cores: the absolute seconds are not a GPU
cluster's, the shape is the model's point). A partial rebuild's slowest rank is the spare,
which holds no group and builds every group of its position; the world-spanning groups
(`WORLD`, megatron-core's `_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP` with one optimizer
instance) contain the spare in every rebuild and cost a member per rank of the job, so they
set both lines. The last column prices each of them as a two-rank group (what
connecting lazily or editing them in place would buy: a rendezvous and the peers a rank
talks to):

{times}

What this says, and what partial rebuild (`--deadpool-rebuild-groups changed`) does and
does not buy:
- Keeping unchanged groups spares every survivor the kinds that do not contain the lost node
  and every rank its calls for groups it does not hold ({calls_s} at 16,384 GPUs), but not
  the spare's own groups, which bound the recovery: the time is in the world-spanning
  groups, which grow with the job in both the full and the partial line. Without them what
  still grows is the data-parallel kinds (`_DATA_PARALLEL_GROUP`,
  `_TENSOR_AND_DATA_PARALLEL_GROUP` and their twins, DP and TP x DP members), which a hot
  swap changes by one member: edited in place too, the spare's rebuild would be its
  tensor- and pipeline-parallel groups alone, the same at every size.
- Those groups must stop connecting every pair at once. Gloo can connect on first use
  (`TORCH_GLOO_LAZY_INIT=1`: an 8-rank world group took 2-4 ms per rank instead of 19-24 ms
  on this machine), and NCCL communicators can be split, shrunk (`torch.distributed.
  shrink_group`, NCCL 2.27+) or grown (NCCL 2.29) from a live one. Our release of a generation
  now reads its connections at each release (every socket opened since it began, the
  control plane's aside), so pairs connected on first use are released too; with lazy
  pairs the rebuild stage fell by 40-58% at 16 and 32 ranks (docs/benchmarks.md). They are
  not used: torch 2.13's gloo sometimes never completes a lazily connected pair (`python -m
  tools.probes.gloo_lazy_pairs`: 4 trials of 20 hung lazily, none of 14 with the full mesh).
- Torch 2.13's gloo cannot shrink (`supports_shrinking` is false), and torch's own
  `shrink_group` of the default group destroys every other group. A hot swap need not go
  through it: a group taken out of torch's registry before the default group is destroyed,
  and registered again once the next generation's default group exists, keeps its object
  and its connections and works in the new world. `python -m tools.probes.keep_groups --ranks 8
  --replace 3` shows it with nothing of ours but our two registry helpers
  (`regroup.set_aside`, `put_back`): 8 gloo processes, every neighbour pair a group,
  rank 3 replaced by a new process; the 5 pairs without rank 3 are kept, the 2 with it made
  again (every rank calls `new_group` for those alone, in the same order), and every
  group's all-reduce and torch's answers about it (its ranks, a member's place) are right.
  Left out of the registry, a kept group still all-reduces but `get_rank` on it fails
  (the negative control). It uses torch's private registry helpers, the ones its
  `shrink_group` uses.
- A kept group may have a collective in flight when the failure comes (a survivor in a
  tensor-parallel all-reduce with a peer that left for the recovery): it can be kept only if
  every member is between two operations of it. Gloo's per-group sequence number says so:
  it counts each collective, send and receive a member issued (the same command's two-rank
  probe: 2 and 2 after an all-reduce and a matched send, 3 and 2 after a send the peer never
  received). Equal counts prove matched operations only where every member issues the same
  ones: collectives. In a group with sends and receives among more than two members (a
  pipeline), equal counts can hide a receive posted for a send that never came, so
  pipeline groups (and the mirror's pairs) are always made again.
- How `--deadpool-rebuild-groups changed` does it (docs/recovery.md, "Rebuild"): each group is named
  as it is made by its members and how many groups of the same members came before it in
  the generation, with the sockets it connected; a survivor that stops shuts down every
  connection but those of its groups without a lost member, and reports each one's count;
  the coordinator's decision lists the groups whose every member reported the same count;
  a rank shuts down and drops the rest, sets the kept ones aside from torch's registry,
  makes the new default group, registers them in it, and hands each back when
  megatron-core asks for a group of its members (every rank skips the same groups). A
  rank still blocked in a collective is released by its heartbeat thread after the grace,
  as before, and every group it holds is made again. Measured (docs/benchmarks.md,
  "Partial rebuild"): at 8, 16 and 32 ranks a rank made 48, 64 and 88 groups instead of
  70, 130 and 242, and the rebuild stage was no shorter, as the model says: the spare's
  groups, the world-spanning ones above all, bound it.
- NCCL (measured on one H200, torch 2.11.0+cu130, NCCL 2.28.9; `python -m tools.probes.nccl_groups`
  on a GPU): the NCCL backend reports `supports_shrinking` and `supports_splitting`, so
  on that software a shrink can edit a communicator in place. A communicator of one rank
  took 18.2 ms to make split from the default one and 19.7 ms not split (medians of 19),
  the default group 520 ms with the CUDA context; that is a rank's local share of a
  group, without the network part, which one GPU cannot show (it cannot host two NCCL
  ranks).
- The time the goodput simulation above takes for a hot swap (40 s at 512 GPUs, published;
  2 min at 16,384, assumed) is the whole recovery, of which this is one stage.
"""
