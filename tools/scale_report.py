"""Write docs/scale.md and its figures: the planner's tables for the paper's
models at 512 GPUs, the goodput simulation at 512 and 16,384 GPUs, and the
time model of rebuilding the process groups (tools/scale_rebuild.py).

    .venv/bin/python -m tools.scale_report            # docs/scale.md, docs/scale_*.png

Every number in the page is computed here from tools/planning/scale.py,
tools/planning/goodput.py, the real layouts megatron-core builds
(tools/layout_probe.py, one subprocess) and our recorded measurements
(docs/data/bench_recovery.json, docs/data/bench_recovery_scale.json); the inputs that
are assumptions are in ``Scenario`` and are labelled so on the page.
Deterministic: fixed seeds.
"""

import argparse
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Dict, List, Sequence

from tools.planning import goodput as gp
from tools.planning import recipes
from tools.planning import scale as ps
from tools import layout_probe, scale_rebuild
from tools.bench.common import LARGE_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GiB, MiB = ps.GiB, ps.MiB
MEASURED, PUBLISHED, ASSUMED, DERIVED = "our measurement", "published", "assumption", "derived"

# LLaMA (Touvron et al. 2023, section 2.4): the 65B model trained at "around
# 380 tokens/sec/GPU on 2048 A100 GPU with 80GB of RAM".
LLAMA_65B_TOKENS_PER_GPU_S = 380


# ----- inputs -----
@dataclass(frozen=True)
class Scenario:
    """One simulated job. Times in seconds; the labels say where each comes from."""

    name: str
    gpus: int
    model: str  # key of scale.MODELS
    parallel: ps.Parallel
    hardware: str  # key of scale.HARDWARE
    mfu: float = 0.45  # assumption, a little under LLaMA-65B's own (published_mfu)
    checkpoint_gbps: float = 30.0  # assumption: the job's aggregate file-system bandwidth
    restart_s: float = 300.0  # assumption: checkpoint-restart, failure to training
    swap_s: float = 40.0  # hot swap, failure to first iteration
    swap_label: str = PUBLISHED
    spare_nodes: int = 2  # assumption: warm spares held by deadpool-launch
    repair_mean_s: float = 48 * gp.HOUR  # assumption: a failed node's time in repair
    days: float = 30.0
    daily_checkpoint_cap_s: float = 24 * gp.HOUR  # hot swap still saves at least daily


SCENARIOS = {
    512: Scenario(
        "512 A100-40GB (Perlmutter-like), LLaMA-65B",
        512,
        "llama-65b",
        ps.paper_layouts(512)["llama-65b"],
        "perlmutter-a100-40",
    ),
    16384: Scenario(
        "16,384 A100-80GB (hypothetical Perlmutter-like nodes), LLaMA-65B",
        16384,
        "llama-65b",
        ps.Parallel(4, 8, 512, 1, 8192, sequence_parallel=True),
        "perlmutter-a100-80",
        swap_s=120.0,
        swap_label=ASSUMED,
        spare_nodes=32,
    ),
}
# An MoE model on the 65B run's machine (its own layout: ps.paper_layouts).
MOE_SCENARIO = Scenario(
    "512 A100-40GB (Perlmutter-like), Mixtral 8x7B (MoE)",
    512,
    "mixtral-8x7b",
    ps.paper_layouts(512)["mixtral-8x7b"],
    "perlmutter-a100-40",
)


def per_gpu_year() -> float:
    return gp.FAILURES_PER_GPU_SECOND * 365 * gp.DAY


def llama_activation_coefficient() -> float:
    """LLaMA-65B's bytes kept per layer over s·b·h, before the division by t."""
    shape = ps.MODELS["llama-65b"]
    one = ps.layer_activation_bytes(shape, ps.Parallel(1, 1, 1), 1)
    return one / (shape.seq_length * shape.hidden_size)


def host_traffic_gbps(p: ps.Plan) -> float:
    """Host-memory bytes per second a node's mirrors move: five passes over
    each rank's snapshot per iteration."""
    return 5 * p.layout.snapshot_bytes * p.hardware.gpus_per_node / p.time.iteration / 1e9


def published_mfu() -> float:
    """LLaMA-65B's published A100 throughput as MFU, by the planner's FLOP
    count (attention included)."""
    peak = ps.HARDWARE["perlmutter-a100-80"].peak_tflops * 1e12
    return LLAMA_65B_TOKENS_PER_GPU_S * ps.flops_per_token(ps.MODELS["llama-65b"]) / peak


def checkpoint_bytes(shape: ps.ModelShape) -> int:
    """A full Megatron checkpoint: bf16 weights + fp32 main params + two Adam
    moments, 14 bytes per parameter."""
    return 14 * ps.total_parameters(shape)


@dataclass(frozen=True)
class Inputs:
    """A scenario's derived figures, shared by every strategy."""

    scenario: Scenario
    plan: ps.Plan
    mtbf_s: float
    checkpoint_s: float
    iteration_s: float
    tokens_per_s: float
    nodes: int


def inputs(sc: Scenario) -> Inputs:
    shape, hw = ps.MODELS[sc.model], ps.HARDWARE[sc.hardware]
    p = ps.plan(shape, sc.parallel, hw, sc.mfu)
    iteration = p.time.iteration
    checkpoint_s = checkpoint_bytes(shape) / (sc.checkpoint_gbps * 1e9)
    return Inputs(
        sc,
        p,
        gp.job_mtbf_s(sc.gpus),
        checkpoint_s,
        iteration,
        sc.parallel.global_batch * shape.seq_length / iteration,
        sc.gpus // hw.gpus_per_node,
    )


def strategies(x: Inputs) -> List[gp.Strategy]:
    """The four strategies of the page, from one scenario's inputs (three
    for an MoE model: it shrinks by whole expert-parallel blocks but does
    not grow back yet, which the simulated shrink does)."""
    sc, c, m = x.scenario, x.checkpoint_s, x.mtbf_s
    overhead = x.plan.time.exposed / x.iteration_s
    pair = 2 / (x.nodes - 1)  # a node's ranks mirror to one node and hold one node's mirrors
    rate = 1 / m
    no_spare = gp.probability_no_spare(rate, sc.repair_mean_s, sc.spare_nodes)
    swap_fallback_rate = rate * (no_spare + rate * sc.swap_s * pair)
    shrink_fallback_rate = rate * rate * sc.swap_s * pair
    cap = sc.daily_checkpoint_cap_s

    def hot(name, fallback_rate, shrink):
        interval = min(cap, gp.daly_interval(c, 1 / fallback_rate))
        return gp.Strategy(
            name,
            interval,
            c,
            sc.restart_s,
            hot_swap=True,
            iteration_s=x.iteration_s,
            mirror_overhead=overhead,
            swap_s=sc.swap_s,
            spares=sc.spare_nodes,
            repair_mean_s=sc.repair_mean_s,
            shrink_when_out=shrink,
            shrink_s=sc.swap_s,
            regrow_s=sc.swap_s,
            dp=sc.parallel.dp,
            pair_loss_probability=pair,
        )

    return [
        gp.Strategy(
            "checkpoint-restart", gp.daly_interval(c, m), c, sc.restart_s, iteration_s=x.iteration_s
        ),
        gp.Strategy(
            "in-process restart",
            gp.daly_interval(c, m),
            c,
            sc.swap_s + c,
            iteration_s=x.iteration_s,
        ),
        hot("hot swap", swap_fallback_rate, False),
    ] + ([hot("hot swap + shrink", shrink_fallback_rate, True)] if can_shrink(sc) else [])


def can_shrink(sc: Scenario) -> bool:
    """As the simulator models it: one replica at a time, growing back."""
    return ps.MODELS[sc.model].num_experts is None


# ----- formatting -----
def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_s(seconds: float) -> str:
    if seconds >= 2 * gp.HOUR:
        return f"{seconds / gp.HOUR:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


# ----- planner section -----
def plans(hardware: str = "perlmutter-a100-40", mirror_in_device: bool = False) -> List[ps.Plan]:
    hw = ps.HARDWARE[hardware]
    return [
        ps.plan(ps.MODELS[k], par, hw, 0.45, mirror_in_device)
        for k, par in ps.paper_layouts(512).items()
    ]


def models_table(items: List[ps.Plan]) -> str:
    rows = []
    for p in items:
        par, m, t = p.parallel, p.memory, p.time
        rows.append(
            [
                p.model.name,
                f"{ps.total_parameters(p.model) / 1e9:.2f} B",
                f"{par.tp}·{par.pp}·{par.dp}" + (f" (EP {par.ep})" if p.model.num_experts else ""),
                gib(m.parts["weights"]),
                gib(m.parts["gradients"]),
                gib(m.parts["optimizer"]),
                gib(m.parts["activations"]),
                f"{m.total / GiB:.1f}",
                gib(m.mirror_bytes),
                f"{p.host_mirror_per_node / GiB:.1f}",
                f"{p.layout.snapshot_bytes / MiB:.0f}",
                f"{t.iteration:.2f}",
                f"{t.link * 1e3:.0f}",
                f"{t.link / t.iteration:.2%}",
                "yes" if t.hides else f"no ({t.exposed:.2f} s)",
            ]
        )
    return table(
        [
            "model",
            "params",
            "TP·PP·DP",
            "weights",
            "grads",
            "optimizer",
            "activations",
            "GPU total (GiB)",
            "mirror per GPU (GiB)",
            "mirror per node (GiB)",
            "sent per iteration (MiB)",
            "iteration (s)",
            "mirror on link (ms)",
            "share of iteration",
            "hides",
        ],
        rows,
    )


def hardware_rows() -> List[ps.Plan]:
    shape = ps.MODELS["llama-65b"]
    layouts = {
        "perlmutter-a100-40": ps.Parallel(4, 8, 16, 1, 2048, sequence_parallel=True),
        "perlmutter-a100-80": ps.Parallel(4, 8, 16, 1, 2048, sequence_parallel=True),
        "vista-gh200": ps.Parallel(1, 16, 32, 1, 2048),
    }
    out = []
    for key, par in layouts.items():
        for mode, device in (("state", False), ("state", True), ("grad", True)):
            mirrored = replace(par, mirror_mode=mode)
            out.append(ps.plan(shape, mirrored, ps.HARDWARE[key], 0.45, device))
    return out


def hardware_table(items: List[ps.Plan]) -> str:
    rows = []
    for p in items:
        t, m = p.time, p.memory
        rows.append(
            [
                p.hardware.name,
                f"{p.parallel.tp}·{p.parallel.pp}·{p.parallel.dp}",
                "device" if m.mirror_in_device else "host",
                p.parallel.mirror_mode,
                f"{m.total / GiB:.1f} / {p.hardware.gpu_memory_gib:.0f}",
                "yes" if p.fits else "NO",
                f"{p.host_mirror_per_node / GiB:.1f} / {p.hardware.host_memory_gib:.0f}"
                if not m.mirror_in_device
                else "-",
                f"{t.iteration:.1f}",
                f"{t.link * 1e3:.0f}",
                f"{t.copy * 1e3:.0f}",
                f"{t.cpu * 1e3:.0f}",
                f"{t.training_link:.2f}",
                f"{t.link / t.iteration:.2%}",
                "yes" if t.hides else "no",
            ]
        )
    return table(
        [
            "hardware",
            "TP·PP·DP",
            "mirror in",
            "mode",
            "GPU GiB used / total",
            "fits",
            "host GiB for mirrors / node",
            "iteration (s)",
            "link (ms)",
            "D2H copy (ms)",
            "CPU checksum+verify (ms)",
            "training's own link (s)",
            "mirror share",
            "hides",
        ],
        rows,
    )


# Configurations whose snapshot sizes real runs logged (docs/benchmarks.md,
# from the mirror_ready events): flags, world, planner inputs, MiB.
PROBED = {
    "demo (8 ranks, TP2·PP2·DP2)": (
        recipes.DEMO.model_flags()
        + ["--use-tp-pp-dp-mapping", "--train-iters", "1", "--lr", "1e-3"],
        8,
        recipes.DEMO.shape,
        recipes.DEMO.layout,
        (1.7, 6.8),
    ),
    "large (2 ranks, DP=2, 19.4 M params)": (
        LARGE_MODEL + ["--train-iters", "1", "--lr", "1e-4"],
        2,
        ps.ModelShape("large", 6, 512, 8, 2048, 512, 512),
        ps.Parallel(1, 1, 2, 2, 8),
        (111.5, 446.0),
    ),
}


def probe_layouts(flags: List[str], world: int) -> List[dict]:
    """Real layouts of every rank, from megatron-core."""
    ranks = [str(r) for r in range(world)]
    return layout_probe.in_subprocess(["--world-size", str(world), "--ranks", *ranks], flags)


def crosscheck_table(probe: bool) -> str:
    rows = []
    for name, (flags, world, shape, par, recorded) in PROBED.items():
        layouts = [ps.rank_layout(shape, par, s) for s in range(par.pp)]
        planned = max(layout.snapshot_bytes for layout in layouts)
        real = "not run"
        if probe:
            reals = probe_layouts(flags, world)
            real = f"{max(r['nbytes'] for r in reals):,}"
        rows.append(
            [
                name,
                f"{planned:,}",
                real,
                f"{planned / MiB:.1f} / {recorded[0]}",
                f"{4 * planned / MiB:.1f} / {recorded[1]}",
            ]
        )
    return table(
        [
            "configuration",
            "planner: snapshot bytes (largest rank)",
            "megatron-core layout: bytes",
            "sent per iteration, MiB: planner / recorded run",
            "extra memory, MiB: planner / recorded run",
        ],
        rows,
    )


# ----- goodput section -----
def run_all(x: Inputs, seeds: Sequence[int], trace: bool) -> Dict[str, List[gp.Outcome]]:
    rate, horizon = 1 / x.mtbf_s, x.scenario.days * gp.DAY
    return {s.name: gp.simulate_seeds(s, rate, horizon, seeds, trace) for s in strategies(x)}


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def results_table(x: Inputs, results: Dict[str, List[gp.Outcome]]) -> str:
    rows, base = [], gp.mean([o.ratio for o in results["checkpoint-restart"]])
    sc = x.scenario
    spare_gpus = sc.spare_nodes * ps.HARDWARE[sc.hardware].gpus_per_node
    for s in strategies(x):
        runs = results[s.name]
        ratio = gp.mean([o.ratio for o in runs])
        spent = {
            k: gp.mean([o.spent.get(k, 0.0) for o in runs]) / gp.HOUR
            for k in ("rework", "recovery", "checkpoint", "slowdown")
        }
        tokens = gp.mean([o.work_s for o in runs]) * x.tokens_per_s
        held = sc.gpus + (spare_gpus if s.hot_swap else 0)
        rows.append(
            [
                s.name,
                f"{ratio:.4f}",
                f"{quantile([o.ratio for o in runs], 0.1):.4f}"
                f"–{quantile([o.ratio for o in runs], 0.9):.4f}",
                f"{ratio * sc.gpus / held:.4f}",
                f"{tokens / 1e9:.1f}",
                f"{(ratio - base) * sc.days * 24 * sc.gpus:+,.0f}",
                fmt_s(s.checkpoint_interval_s),
                " / ".join(f"{spent[k]:.1f}" for k in spent),
            ]
        )
    return table(
        [
            "strategy",
            "effective training time ratio (mean)",
            "10th–90th pct",
            "per GPU held (spares counted)",
            "tokens in the horizon (B)",
            "GPU-hours vs checkpoint-restart",
            "durable checkpoint every",
            "hours lost: rework / recovery / checkpointing / slowdown",
        ],
        rows,
    )


def counts_table(results: Dict[str, List[gp.Outcome]]) -> str:
    kinds = [
        "restarts",
        "restarts_interrupted",
        "swaps",
        "shrinks",
        "regrows",
        "fallbacks",
        "pair_losses",
    ]
    rows = []
    for name, runs in results.items():
        rows.append(
            [name, f"{gp.mean([o.failures for o in runs]):.1f}"]
            + [f"{gp.mean([o.counts.get(k, 0) for o in runs]):.2f}" for k in kinds]
        )
    names = {
        "restarts_interrupted": "failures during a restart",
        "fallbacks": "no spare: restarts",
        "pair_losses": "mirror lost: restarts",
    }
    return table(["strategy", "failures"] + [names.get(k, k) for k in kinds], rows)


def inputs_table(x: Inputs, measured: dict) -> str:
    sc, p = x.scenario, x.plan
    shape = ps.MODELS[sc.model]
    hw = measured.get("hot_swap", {}).get("to_first_iteration_s")
    cr = measured.get("checkpoint_restart", {}).get("to_first_iteration_s")
    rows = [
        [
            "job MTBF",
            fmt_s(x.mtbf_s),
            DERIVED,
            f"Llama 3's {gp.LLAMA3['interruptions']} "
            f"unexpected interruptions in {gp.LLAMA3['days']} days on {gp.LLAMA3['gpus']:,} H100s "
            f"({PUBLISHED}), {per_gpu_year():.3f} per GPU-year, times {sc.gpus:,} GPUs; the H100 "
            f"rate applied per GPU to A100s is an {ASSUMED}",
        ],
        [
            "iteration",
            f"{x.iteration_s:.2f} s",
            DERIVED,
            f"planner: {ps.flops_per_token(shape) / 1e9:.0f} GFLOP/token × "
            f"{sc.parallel.global_batch * shape.seq_length / 1e6:.1f} M tokens at MFU "
            f"{sc.mfu} ({ASSUMED}, a little under the {published_mfu():.2f} of LLaMA-65B's "
            f"published {LLAMA_65B_TOKENS_PER_GPU_S} tokens/s per A100-80GB) of "
            f"{p.hardware.peak_tflops:.0f} TFLOP/s",
        ],
        [
            "mirror overhead per iteration",
            f"{p.time.exposed / x.iteration_s:.2%}",
            DERIVED,
            "planner: exposed mirror time (0 when it hides)",
        ],
        [
            "durable checkpoint",
            f"{checkpoint_bytes(shape) / 1e9:.0f} GB, {x.checkpoint_s:.1f} s",
            ASSUMED,
            f"14 B/param written at {sc.checkpoint_gbps:.0f} GB/s aggregate, on the slow side: "
            "Perlmutter's all-flash scratch is rated above 5 TB/s for the whole machine, Llama 3's "
            "storage sustained 2 TB/s (published); reading it back takes as long",
        ],
        [
            "checkpoint-restart: failure to training",
            fmt_s(sc.restart_s),
            ASSUMED,
            "detect + relaunch + init + load (NCCL's init alone took ~2.5 min above some thousand "
            "GPUs, nccl#1156); with the checkpoint above, ~90% at 16,384 GPUs, consistent with "
            'Llama 3\'s "more than 90%", a bound over all causes that does not fix C or R'
            + (f". Our CPU demo ({MEASURED}): {cr:.1f} s" if cr else ""),
        ],
        [
            "hot swap: failure to first iteration",
            fmt_s(sc.swap_s),
            sc.swap_label,
            (
                "DeadPool paper (arXiv 2607.01646): under 40 s at 512 A100s"
                if sc.swap_label == PUBLISHED
                else "communicator setup at thousands of GPUs takes minutes "
                "(nccl#1156: ~2.5 min); TrainMover reports ~20 s at 1,024 GPUs"
            )
            + (f". Our CPU demo ({MEASURED}): {hw:.1f} s" if hw else ""),
        ],
        ["hot swap: work lost", "the interrupted iteration", MEASURED, lost_text(measured)],
        [
            "in-process restart: failure to training",
            fmt_s(sc.swap_s + x.checkpoint_s),
            ASSUMED,
            "the hot swap's time + reading the checkpoint (processes live, as in "
            "NVIDIA's in-process restart; it rolls back to the checkpoint)",
        ],
        [
            "shrink / regrow",
            fmt_s(sc.swap_s),
            ASSUMED,
            "as a hot swap; after shrinking, "
            f"(DP-k)/DP throughput ({DERIVED}: the same global batch on DP-k replicas, as "
            "ReCoVer, arXiv 2605.11215, keeps the microbatch count)",
        ],
        [
            "warm spare nodes",
            f"{sc.spare_nodes} ({sc.spare_nodes * p.hardware.gpus_per_node} GPUs)",
            ASSUMED,
            "held by deadpool-launch",
        ],
        ["node repair", fmt_s(sc.repair_mean_s), ASSUMED, "exponential, mean shown"],
        [
            "mirror lost with a second failure",
            f"{2 / (x.nodes - 1):.4f}",
            DERIVED,
            "buddy or owner node hit during a swap: 2 of the other nodes",
        ],
    ]
    return table(["input", "value", "kind", "rests on"], rows)


def lost_text(measured: dict) -> str:
    """What our CPU recovery benchmark lost, beside the interrupted iteration."""
    hs, cr = measured.get("hot_swap", {}), measured.get("checkpoint_restart", {})
    if "iterations_lost" not in hs:
        return "deadpool_ext: every rank restores the start of the interrupted iteration"
    interval = measured.get("options", {}).get("save_interval", "?")
    return (
        f"docs/data/bench_recovery.json: hot swap redid {hs['iterations_lost']} iterations "
        f"beyond the interrupted one; checkpoint-restart lost {cr.get('iterations_lost')} "
        f"(checkpoint every {interval})"
    )


# Checkpoint write times C and restart times R the sensitivity tables try.
SENSITIVITY = {
    512: ((2, 10, 30, 120, 600), (120, 300, 900, 1800)),
    16384: ((1, 10, 30, 120), (120, 300, 900)),
}


def sensitivity(x: Inputs, seeds: Sequence[int]) -> Dict[tuple, Dict[str, float]]:
    """Checkpoint-restart (Daly's closed form and simulated) and hot swap
    (simulated) for each (C, R) of SENSITIVITY."""
    out = {}
    costs, restarts = SENSITIVITY[x.scenario.gpus]
    for cost in costs:
        for restart in restarts:
            sc = replace(
                x.scenario,
                restart_s=restart,
                checkpoint_gbps=checkpoint_bytes(ps.MODELS[x.scenario.model]) / (cost * 1e9),
            )
            y = inputs(sc)
            by_name = {s.name: s for s in strategies(y)}
            cr, hs = by_name["checkpoint-restart"], by_name["hot swap"]
            rate, horizon = 1 / y.mtbf_s, sc.days * gp.DAY
            out[cost, restart] = {
                s.name: gp.mean([o.ratio for o in gp.simulate_seeds(s, rate, horizon, seeds)])
                for s in (cr, hs)
            }
            out[cost, restart]["daly"] = gp.daly_ratio(
                cr.checkpoint_interval_s, cost, restart, y.mtbf_s
            )
    return out


def sensitivity_table(cells: Dict[tuple, Dict[str, float]]) -> str:
    rows = [
        [
            f"{cost} s",
            fmt_s(restart),
            f"{r['daly']:.4f}",
            f"{r['checkpoint-restart']:.4f}",
            f"{r['hot swap']:.4f}",
        ]
        for (cost, restart), r in cells.items()
    ]
    return table(
        [
            "checkpoint write",
            "restart",
            "checkpoint-restart (Daly, analytic)",
            "checkpoint-restart (simulated)",
            "hot swap (simulated)",
        ],
        rows,
    )


def spares_table(x: Inputs, seeds: Sequence[int], counts: Sequence[int]) -> str:
    rows = []
    for spares in counts:
        y = inputs(replace(x.scenario, spare_nodes=spares))
        _, _, hs, shrink = strategies(y)
        rate, horizon = 1 / y.mtbf_s, y.scenario.days * gp.DAY
        r = {
            s.name: gp.mean([o.ratio for o in gp.simulate_seeds(s, rate, horizon, seeds)])
            for s in (hs, shrink)
        }
        p = gp.probability_no_spare(rate, y.scenario.repair_mean_s, spares)
        gpus = y.scenario.gpus
        held = gpus / (gpus + spares * y.plan.hardware.gpus_per_node)
        rows.append(
            [
                str(spares),
                f"{p:.3f}",
                f"{r[hs.name]:.4f}",
                f"{r[hs.name] * held:.4f}",
                f"{r[shrink.name]:.4f}",
                f"{r[shrink.name] * held:.4f}",
            ]
        )
    return table(
        [
            "warm spare nodes",
            "share of failures finding no spare (analytic)",
            "hot swap, restart when out",
            "per GPU held",
            "hot swap + shrink when out",
            "per GPU held",
        ],
        rows,
    )


# ----- figures -----
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_goodput(x: Inputs, results: Dict[str, List[gp.Outcome]], path: str) -> None:
    """Cumulative effective training time ratio against days, mean and the
    10th-90th percentile band over seeds."""
    plt = _pyplot()
    days = [d / 4 for d in range(1, int(x.scenario.days * 4) + 1)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, runs in results.items():
        curves = [
            [w / (d * gp.DAY) for w, d in zip(gp.work_at(o, [d * gp.DAY for d in days]), days)]
            for o in runs
        ]
        columns = list(zip(*curves))
        ax.plot(days, [gp.mean(c) for c in columns], label=name)
        ax.fill_between(
            days,
            [quantile(c, 0.1) for c in columns],
            [quantile(c, 0.9) for c in columns],
            alpha=0.2,
        )
    ax.set_xlabel("days of training")
    ax.set_ylabel("effective training time ratio so far")
    ax.set_title(f"{x.scenario.name}: MTBF {fmt_s(x.mtbf_s)}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_young_daly(x: Inputs, seeds: Sequence[int], path: str) -> List[tuple]:
    """Checkpoint-restart's ratio against its checkpoint interval: Daly's
    closed form and the simulator, with Young's and Daly's optima."""
    plt = _pyplot()
    cr = strategies(x)[0]
    c, r, m = cr.checkpoint_cost_s, cr.restart_s, x.mtbf_s
    young, daly = gp.young_interval(c, m), gp.daly_interval(c, m)
    grid = [young * f for f in (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)]
    rate, horizon = 1 / m, x.scenario.days * gp.DAY
    sim = [
        gp.mean(
            [
                o.ratio
                for o in gp.simulate_seeds(
                    replace(cr, checkpoint_interval_s=t), rate, horizon, seeds
                )
            ]
        )
        for t in grid
    ]
    fine = [young * (0.2 + 0.02 * i) for i in range(200)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [t / 60 for t in fine],
        [gp.daly_ratio(t, c, r, m) for t in fine],
        label="Daly 2006, closed form",
    )
    ax.plot([t / 60 for t in grid], sim, "o", label=f"simulated ({len(seeds)} seeds)")
    ax.axvline(young / 60, color="grey", ls="--", label=f"Young √(2CM) = {young / 60:.1f} min")
    ax.axvline(daly / 60, color="black", ls=":", label=f"Daly = {daly / 60:.1f} min")
    ax.set_xscale("log")
    ticks = [t for t in (2, 5, 10, 20, 50, 100, 200) if fine[0] / 60 <= t <= fine[-1] / 60]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("checkpoint interval (min, log scale)")
    ax.set_ylabel("effective training time ratio")
    ax.set_title(
        f"checkpoint-restart at {x.scenario.gpus:,} GPUs "
        f"(C = {c:.0f} s, R = {fmt_s(r)}, M = {fmt_s(m)})"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return list(zip(grid, sim))


def plot_memory(items: List[ps.Plan], path: str) -> None:
    plt = _pyplot()
    parts = ["weights", "gradients", "optimizer", "activations", "reserved"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [p.model.name.split(" (")[0] for p in items]
    bottom = [0.0] * len(items)
    for part in parts:
        values = [p.memory.parts[part] / GiB for p in items]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar(
        names,
        [p.memory.mirror_bytes / GiB for p in items],
        bottom=bottom,
        hatch="//",
        color="white",
        edgecolor="black",
        label="mirror (if kept in GPU memory)",
    )
    ax.axhline(items[0].hardware.gpu_memory_gib, color="red", ls="--", label="A100-40GB")
    ax.set_ylabel("GiB per GPU (worst pipeline stage)")
    ax.set_ylim(0, items[0].hardware.gpu_memory_gib * 1.35)
    ax.set_title("512 A100-40GB: memory per GPU, bf16, selective recompute")
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- the page -----
SOURCES = """\
- DeadPool: arXiv 2607.01646 (hot swap under 40 s at 512 A100s, 65B).
- ReCoVer: arXiv 2605.11215 (goes on with the survivors, the microbatch count per iteration
  kept and redistributed over them; 2.23× the effective throughput of checkpoint-restart at
  up to 512 GPUs).
- Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783, section
  3.3.4 and table 5 (466 interruptions in a 54-day snapshot on 16,384 H100s, 419
  unexpected, 54 of them software bugs and 35 network switch or cable faults; more than 90%
  effective training time).
- Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9);
  Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3).
- LLaMA: Touvron et al. 2023 (arXiv 2302.13971), section 2.4: 65B at about 380 tokens/s per
  GPU on 2,048 A100-80GB.
- Megatron-LM README (2022-23 versions; A100-80GB, Selene): MFU 41.5% (22B), 51.4% (175B),
  56.0% (530B), 56.3% (1T), benchmark runs at data-parallel size one; Narayanan et al. 2021
  (arXiv 2104.04473): 502 PFLOP/s on 3,072 A100s for 1T, 52% of peak, counting the FLOPs of
  full activation recomputation (hardware FLOPs; model FLOPs are about 3/4 of them).
- Korthikanti et al. 2022 (arXiv 2205.05198): activation memory per layer sbh(34 + 5as/h)
  bytes, 34·sbh with selective recomputation, /t with sequence parallelism; 530B on 2,240
  A100s at 54.2% MFU (42.1% with full recomputation).
- PaLM (Chowdhery et al. 2022, appendix B): model FLOPs 6N + 12·L·H·Q·T per token.
- GPT-3 (Brown et al. 2020, table 2.1; 16 heads for 1.3B as Megatron configures it) and
  LLaMA (Touvron et al. 2023, table 2): shapes.
- NERSC Perlmutter architecture page (1,536 GPU nodes with 4 A100-40GB, 256 with 4
  A100-80GB, 4 Slingshot 11 NICs per GPU node, 256 GB) and system page (35 PB all-flash
  Lustre scratch, more than 5 TB/s); Slingshot 11's Cassini NIC: 200 Gb/s; A100 datasheet
  (312 TFLOP/s dense bf16, PCIe 4.0: 32 GB/s each way); AMD EPYC 7003: eight DDR4-3200
  channels, 204.8 GB/s.
- TACC Vista (GH200: 96 GB HBM3, 120 GB LPDDR5X, NVLink-C2C 900 GB/s, NDR InfiniBand; the
  400 Gb/s per node used here is an assumption, not checked against TACC's pages).
- Llama 3's storage: Tectonic, 2 TB/s sustained, 7 TB/s peak (Dubey et al. 2024, section
  3.3.1).
- NVIDIA/nccl#1156 (communicator setup ~2.5 min at thousands of GPUs, at launch and at
  restarts), TrainMover (arXiv 2412.12636: ~20 s of downtime at 1,024 GPUs), NVIDIA's
  in-process restart (nvidia-resiliency-ext's documentation).
- Ours: docs/benchmarks.md (snapshot sizes of real runs, checksum speed) and
  docs/data/bench_recovery.json (hot swap vs checkpoint-restart on CPU).
"""


def read_measured() -> dict:
    try:
        with open(os.path.join(REPO, "docs", "data", "bench_recovery.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def headline(x: Inputs, results: Dict[str, List[gp.Outcome]]) -> Dict[str, float]:
    ratios = {k: gp.mean([o.ratio for o in v]) for k, v in results.items()}
    p = x.plan
    return {
        "mirror_gib": p.memory.mirror_bytes / GiB,
        "share": p.time.link / p.time.iteration,
        "exposed": p.time.exposed,
        "cr": ratios["checkpoint-restart"],
        "ipr": ratios["in-process restart"],
        "hs": ratios["hot swap"],
        "hs_shrink": ratios["hot swap + shrink"],
    }


def mirror_share_formula(x: Inputs) -> str:
    """Why the share hardly depends on the model: bytes per GPU and FLOPs per
    GPU both scale with parameters per GPU."""
    sc, p = x.scenario, x.plan
    tokens = sc.parallel.global_batch * ps.MODELS[sc.model].seq_length
    achieved = p.hardware.peak_tflops * 1e12 * sc.mfu
    approx = 12 * achieved / (6 * tokens * p.hardware.nic_gbps * 1e9)
    return (
        f"12 B / (6 FLOP × {tokens / 1e6:.1f} M tokens) × {achieved / 1e12:.0f} TFLOP/s "
        f"achieved / {p.hardware.nic_gbps:.0f} GB/s = {approx:.2%}"
    )


def large_scale_text(
    x: Inputs, results: Dict[str, List[gp.Outcome]], cells: Dict[tuple, Dict[str, float]]
) -> str:
    h, sc = headline(x, results), x.scenario
    gain = h["hs"] - h["cr"]
    return (
        f"At {sc.gpus:,} GPUs (one failure every {fmt_s(x.mtbf_s)}) the same model "
        f"goes from {h['cr']:.4f} with checkpoint-restart ({h['ipr']:.4f} in-process) to "
        f"{h['hs']:.4f} with hot swap ({h['hs_shrink']:.4f} with shrink): {gain:.1%} more "
        f"training, {gain * sc.days * 24 * sc.gpus / 1e6:.2f} M GPU-hours in "
        f"{sc.days:.0f} days, for {sc.spare_nodes} spare nodes "
        f"({sc.spare_nodes * x.plan.hardware.gpus_per_node / sc.gpus:.2%} of the GPUs); "
        f"the mirror is {x.plan.memory.mirror_bytes / GiB:.2f} GiB per GPU there "
        f"(DP={sc.parallel.dp} splits the optimizer finer). {fast_text(x, cells)}"
    )


def fast_text(x: Inputs, cells: Dict[tuple, Dict[str, float]]) -> str:
    """What the gain becomes with a fast file system, from the sensitivity table."""
    cost = min(SENSITIVITY[x.scenario.gpus][0])
    fast = cells[cost, x.scenario.restart_s]
    gbps = checkpoint_bytes(ps.MODELS[x.scenario.model]) / cost / 1e9
    return (
        f"Much of the gain rests on the assumed {x.checkpoint_s:.0f} s checkpoint write: "
        f"written in {cost} s ({gbps:,.0f} GB/s, within what Perlmutter's scratch and "
        f"Llama 3's storage are rated for), checkpoint-restart reaches "
        f"{fast['checkpoint-restart']:.4f} and hot swap's gain is "
        f"{fast['hot swap'] - fast['checkpoint-restart']:.2%} (sensitivity table below)."
    )


def headline_text(
    x: Inputs, results: Dict[str, List[gp.Outcome]], cells: Dict[tuple, Dict[str, float]]
) -> str:
    h, p, sc = headline(x, results), x.plan, x.scenario
    hours = (h["hs"] - h["cr"]) * sc.days * 24
    return "\n".join(
        [
            f"- **Mirror memory per GPU: {h['mirror_gib']:.2f} GiB** (four snapshots of "
            f"{p.layout.snapshot_bytes / MiB:.0f} MiB: two own, two held), in host memory by "
            f"default: {p.host_mirror_per_node / GiB:.1f} GiB of a node's "
            f"{p.hardware.host_memory_gib:.0f} GB. In GPU memory instead the worst stage would "
            f"use {(p.memory.total + p.memory.mirror_bytes) / GiB:.1f} of "
            f"{p.hardware.gpu_memory_gib:.0f} GiB.",
            f"- **Mirror share of the iteration: {h['share']:.2%}**: a snapshot spends "
            f"{p.time.link * 1e3:.0f} ms on the NIC in a {p.time.iteration:.1f} s iteration at MFU "
            f"{sc.mfu}; with training's own {p.time.training_link:.2f} s of traffic on the same "
            f"NIC it still fits in the iteration, so the exposed cost is "
            f"{h['exposed']:.0f} s: zero, on paper.",
            f"- **Effective training time ratio over {sc.days:.0f} days: checkpoint-restart "
            f"{h['cr']:.4f}, in-process restart {h['ipr']:.4f}, hot swap {h['hs']:.4f}, hot swap "
            f"+ shrink {h['hs_shrink']:.4f}** (means of {len(results['hot swap'])} simulated "
            f"jobs): hot swap gives back {hours:.1f} h of the {sc.days * 24:.0f} h, "
            f"{hours * sc.gpus:,.0f} GPU-hours, at the price of {sc.spare_nodes} spare nodes "
            f"({sc.spare_nodes * p.hardware.gpus_per_node} GPUs, "
            f"{sc.spare_nodes * p.hardware.gpus_per_node * sc.days * 24:,.0f} GPU-hours) held "
            f"warm. {spare_verdict(h, sc, p)} {fast_text(x, cells)}",
        ]
    )


def spare_verdict(h: Dict[str, float], sc: Scenario, p: ps.Plan) -> str:
    """Whether the time won pays for the spares, said plainly."""
    spare_share = sc.spare_nodes * p.hardware.gpus_per_node / sc.gpus
    gain = h["hs"] - h["cr"]
    if gain > spare_share:
        return (
            f"The gain ({gain:.2%} of the run) exceeds the spares' share of the GPUs "
            f"({spare_share:.2%})."
        )
    return (
        f"At this scale the gain ({gain:.2%} of the run) is smaller than the spares' "
        f"share of the GPUs ({spare_share:.2%}): hot swap pays off here only if the "
        "spares are shared with other jobs or do other work while they wait; at "
        "16,384 GPUs it pays several times over (below)."
    )


def goodput_section(
    x: Inputs,
    results: Dict[str, List[gp.Outcome]],
    measured: dict,
    seeds: Sequence[int],
    png: str,
    cells: Dict[tuple, Dict[str, float]],
) -> str:
    sc = x.scenario
    counts = (0, 1, 2, 4) if sc.gpus <= 1024 else (0, 8, 16, 32, 64)
    extra = (
        f"\n\nHow many warm spares pay off (repair {fmt_s(sc.repair_mean_s)}; "
        f'{len(seeds[:16])} jobs each; "per GPU held" divides by the spares\' GPUs '
        "too):\n\n" + spares_table(x, seeds[:16], counts)
    )
    extra += (
        "\n\nSensitivity to the two assumptions checkpoint-restart rests on (write "
        f"time C of the {checkpoint_bytes(ps.MODELS[sc.model]) / 1e9:.0f} GB checkpoint, "
        f"restart time R), each cell {len(seeds[:16])} simulated jobs:\n\n"
        + sensitivity_table(cells)
    )
    return f"""### {sc.name}

Inputs:

{inputs_table(x, measured)}

Results ({len(seeds)} simulated jobs of {sc.days:.0f} days, same failure times for every
strategy within a seed; tokens at {x.tokens_per_s / 1e6:.2f} M tokens/s failure-free):

{results_table(x, results)}

Events per job (means):

{counts_table(results)}

![goodput over time, {sc.gpus} GPUs]({png}){extra}
"""


def moe_section(
    x: Inputs, results: Dict[str, List[gp.Outcome]], measured: dict, seeds: Sequence[int]
) -> str:
    sc, p = x.scenario, x.plan
    par, shape = sc.parallel, ps.MODELS[sc.model]
    tensors = ps.stage_parameters(shape, par.tp, par.pp, 0, par.etp, par.ep)
    experts = sum(t.numel for t in tensors if t.expert)
    return f"""### {sc.name}

Layout: TP {par.tp}, PP {par.pp}, DP {par.dp}, EP {par.ep} (each of 8 nodes holds one expert,
split over its 4 GPUs), expert TP {par.expert_tp}, expert-DP {par.edp};
{par.global_batch} × {shape.seq_length}
tokens per iteration (the 4M tokens of the dense runs). The dense tensors' optimizer state is
sharded over DP {par.dp}, the experts' over expert-DP {par.edp}: of a GPU's
{sum(t.numel for t in tensors) / 1e9:.2f} B parameters, {experts / 1e9:.2f} B are its expert's,
and its shard of {p.layout.shard_numel / 1e6:.1f} M elements is mostly theirs. Memory at the
worst stage {p.memory.total / GiB:.1f} GiB of 40 (weights {gib(p.memory.parts["weights"])},
gradients {gib(p.memory.parts["gradients"])}, optimizer {gib(p.memory.parts["optimizer"])},
activations {gib(p.memory.parts["activations"])} GiB, an estimate: each token's top-2 copies
and their expert activations); snapshot {p.layout.snapshot_bytes / MiB:.0f} MiB sent per
iteration, mirror {gib(p.memory.mirror_bytes)} GiB per GPU ({p.host_mirror_per_node / GiB:.1f}
GiB of host memory per node). Iteration {p.time.iteration:.2f} s (FLOPs of the active
parameters: top-2 of 8 experts); the mirror takes {p.time.link * 1e3:.0f} ms of the link
({p.time.link / p.time.iteration:.2%} of the iteration, about 3.6 times a dense model's share:
its bytes follow all 46.7 B parameters, its FLOPs the 12.9 B active ones) and
{"hides" if p.time.hides else "does not hide"} beside training's own traffic (the token
all-to-alls of EP included). An MoE job shrinks by whole expert-parallel blocks (here
{par.shrink_unit} replicas at a time) and does not grow back yet; the simulated
shrink drops one replica and grows back, so it is left out for this model.

Inputs:

{inputs_table(x, measured)}

Results ({len(seeds)} simulated jobs of {sc.days:.0f} days):

{results_table(x, results)}

![goodput over time, Mixtral 8x7B](scale_goodput_mixtral.png)
"""


def page(
    items,
    hw_items,
    crosscheck,
    xs,
    results,
    yd,
    measured,
    seeds,
    cells,
    hs_check,
    moe_text,
    rebuild_text,
) -> str:
    x512 = xs[512]
    lines = [
        f"""# Scale on paper: memory, bandwidth, goodput and the groups' rebuild

Generated by `.venv/bin/python -m tools.scale_report` (this page and `docs/scale_*.png`;
do not edit by hand). Nothing here ran at scale: the planner
(`tools/planning/scale.py`) is arithmetic on model shapes and published hardware
figures, checked against layouts megatron-core builds and sizes our runs logged; the
simulator (`tools/planning/goodput.py`) plays failures against each recovery
strategy. Each input is labelled **{MEASURED}** (this project's benchmarks), **{PUBLISHED}**
(source at the end), **{DERIVED}** (computed from those) or **{ASSUMED}** (our choice,
with the reason).

## LLaMA-65B on 512 A100s

{headline_text(x512, results[512], cells[512])}

{large_scale_text(xs[16384], results[16384], cells[16384])}

## 1. Memory and bandwidth (`tools/planning/scale.py`)

The mirror's size follows our code exactly: a rank's snapshot is a 64-byte header, 12
bytes per element of its distributed-optimizer shard (fp32 main parameter, `exp_avg`,
`exp_avg_sq`), a sidecar reserve of 256 KiB + 64 B per parameter tensor, rounded up to 32
KiB; the shard is the sum over megatron-core's gradient buckets of bucket size / DP, with
the buckets' padding (each tensor starts at a multiple of 64 elements, each bucket ends at
a multiple of lcm(DP, 128), a tied embedding split across pipeline stages gets a bucket of
its own). A rank keeps four snapshots (two own, two held for its owner) and sends one per
iteration. Checked against the real thing:

{crosscheck}

`tests/functional_tests/test_plan_scale.py` also compares, rank by rank, the planner's tensors and
shard size with the layouts megatron-core builds for a LLaMA-style model (SwiGLU, RMSNorm,
grouped-query attention, no biases, untied output, bf16, padded vocabulary, DP=3).

Memory per GPU for the paper's models on 512 A100-40GB (4 GPUs per node; TP inside the
node first, then PP, the first layout whose worst stage stays under two thirds of 40 GB, as
the activations are an estimate; bf16 with fp32 gradients and main parameters; distributed
optimizer; selective recompute with sequence parallelism; micro-batch 1; 2048 × 2048-token
global batch; MFU {x512.scenario.mfu} (**{ASSUMED}**: LLaMA-65B itself trained at
{LLAMA_65B_TOKENS_PER_GPU_S} tokens/s per GPU on 2,048 A100-80GB, {published_mfu():.2f} by our
FLOP count, and Megatron's A100 benchmarks reached 41.5% at 22B and 51.4% at 175B, all
**{PUBLISHED}**; we take a little less for 8 pipeline stages on 40 GB GPUs); 2 GiB "reserved"
for CUDA context, NCCL buffers and allocator slack (**{ASSUMED}**)). GiB per GPU at the worst
pipeline stage:

{models_table(items)}

![memory per GPU](scale_memory.png)

The mirror's share of the iteration is nearly the same for every model: a GPU sends 12
bytes per element of its shard, and a shard is parameters / (TP·PP·DP) = parameters / GPUs;
per iteration a GPU computes 6 FLOPs per parameter it holds (parameters / (TP·PP)) for each
of its replica's tokens (global tokens / DP), again parameters / GPUs times 6 per global
token. The share is therefore about {mirror_share_formula(x512)} for the 65B run. It
shrinks with larger batches and grows with MFU and slower links, never with model size.

Weights, gradients, optimizer and mirror are exact for megatron-core's layout; the
activations are an estimate after Korthikanti et al. 2022. A layer keeps sbh(34 + 5as/h)
bytes for backward without recomputation (16-bit activations, one-byte dropout masks),
34·sbh with selective recomputation (the attention scores recomputed), and sequence
parallelism divides all of it by t. The planner uses the selective form with sequence
parallelism (flash attention never stores the scores either), counted term by term so that
it carries over to SwiGLU, grouped-query attention and no dropout: 34·sbh/t per layer for
the GPT models (tested against the closed forms) and {llama_activation_coefficient():.1f}·sbh/t
for LLaMA-65B, times the {x512.scenario.parallel.pp} microbatches 1F1B keeps in flight on
the first stage.

LLaMA-65B on the three presets, mirror in host or in device memory, and in device memory
with `--deadpool-mirror-mode grad` too, which sends the step's gradients (a third of the
bytes) and keeps two packets beside the four snapshots; grad mode keeps the replica in
device memory on a GPU, where the buddy replays the step (GH200 has one GPU per node, so TP
stays 1):

{table_note()}

{hardware_table(hw_items)}

"Hides" means the exchange that starts with iteration t (copy to host, checksum, send,
receive, verify; step t waits for it, `deadpool_ext/state/mirror.py`) fits in the iteration
together with training's own traffic on the same NIC (distributed-optimizer reduce-scatter
and all-gather, pipeline sends). The CPU time applies our checksum speed (**{MEASURED}**:
9.1 ms per 111.5 MiB on one core of the development machine, docs/benchmarks.md) to the
snapshot; a node has tens of cores, so it runs beside training. Kept in host memory, the
mirror passes over each snapshot five times an iteration (copy in, checksum, send, receive,
verify): {host_traffic_gbps(x512.plan):.1f} GB/s per node for the 65B run, against the
204.8 GB/s peak of an EPYC 7763's eight DDR4-3200 channels (**{PUBLISHED}**, AMD, if all eight
are populated).

## 2. Goodput under failures (`tools/planning/goodput.py`)

Failures are a Poisson process at Llama 3's rate per GPU (419 unexpected interruptions in 54
days on 16,384 GPUs, {per_gpu_year():.3f} per GPU-year), each
taking one node out. Strategies:

- **checkpoint-restart**: durable checkpoints at Daly's optimum interval for the job's
  MTBF; a failure rolls back to the last one and costs the restart time (failures during a
  restart restart it).
- **in-process restart**: the same checkpoints and rollback, a shorter restart (processes
  live; groups rebuilt, checkpoint reloaded).
- **hot swap** (this project): the interrupted iteration is redone on a warm spare node;
  with no spare free (nodes come back after repair) the job falls back to checkpoint-restart
  (`--deadpool-on-spares-exhausted abort`); a second failure during a swap on the lost
  node's buddy or owner node loses the mirror (checkpoint-restart). Durable checkpoints are
  kept at Daly's interval for the failures the mirror cannot absorb, at least daily.
- **hot swap + shrink** (`--deadpool-on-spares-exhausted shrink`): as hot swap, but with no
  spare the job drops a DP replica and goes on at (DP-k)/DP throughput, growing back when a
  repaired node returns (growing back is modelled here; in the code it is the next step).

The ratio is useful work (full-throughput compute never rolled back) over wall time; the
lost hours split into rework, recovery, checkpointing and slowdown (shrunk throughput,
mirror overhead), which with the useful work add up to the horizon exactly (tested).
"""
    ]
    lines.append(
        goodput_section(x512, results[512], measured, seeds, "scale_goodput_512.png", cells[512])
    )
    lines.append(
        goodput_section(
            xs[16384], results[16384], measured, seeds, "scale_goodput_16384.png", cells[16384]
        )
    )
    lines.append(moe_text)
    lines.append(young_daly_text(xs[16384], yd, hs_check))
    lines.append(rebuild_text)
    lines.append(limits_text(xs, cells))
    lines.append("## Sources\n\n" + SOURCES)
    return "\n".join(lines)


def table_note() -> str:
    return (
        "Columns: GPU memory of the worst stage with the mirror where it is kept; host "
        "memory the mirrors of one node's ranks take; per-iteration times per rank."
    )


def hot_swap_check(x: Inputs, seeds: Sequence[int]) -> Dict[str, float]:
    """The scenario's hot swap with a spare always free and no durable
    checkpoints: closed form and simulated."""
    hs = replace(
        strategies(x)[2], checkpoint_interval_s=math.inf, spares=None, pair_loss_probability=0.0
    )
    runs = gp.simulate_seeds(hs, 1 / x.mtbf_s, x.scenario.days * gp.DAY, seeds)
    return {
        "closed": gp.hot_swap_ratio(hs.iteration_s, hs.swap_s, x.mtbf_s),
        "simulated": gp.mean([o.ratio for o in runs]),
        "jobs": len(runs),
    }


def young_daly_text(x: Inputs, yd: List[tuple], hs: Dict[str, float]) -> str:
    cr = strategies(x)[0]
    c, m = cr.checkpoint_cost_s, x.mtbf_s
    best = max(yd, key=lambda p: p[1])
    return f"""### Checking the simulator against closed forms

With checkpoint-restart at 16,384 GPUs (C = {c:.0f} s, R = {fmt_s(cr.restart_s)}, M =
{fmt_s(m)}), the simulated ratio follows Daly's closed form for the expected time of a
segment under exponential failures, and is highest near Young's √(2CM) =
{fmt_s(gp.young_interval(c, m))} and Daly's {fmt_s(gp.daly_interval(c, m))} (best simulated
grid point: {fmt_s(best[0])}, ratio {best[1]:.4f}). Hot swap with a spare always free and
no durable checkpoints keeps the whole iterations of each stretch between failures and pays
the swap S, restarted by a failure during it: (T/M)·e^(−S/M) / (e^(T/M) − 1) =
{hs["closed"]:.4f} here (T = {x.iteration_s:.2f} s, S = {fmt_s(x.scenario.swap_s)}), and the
simulator gives {hs["simulated"]:.4f} ({hs["jobs"]} jobs). The tests check both closed forms
against the simulator where the terms are large, and the failure-free ratio τ/(τ+C), the
exact loss of one failure at a known time, and the accounting identity.

![Young/Daly check](scale_young_daly.png)
"""


def limits_text(xs: Dict[int, Inputs], cells: Dict[int, Dict[tuple, Dict[str, float]]]) -> str:
    x, big = xs[512], xs[16384]
    r = x.scenario.restart_s
    fast = {g: cells[g][min(SENSITIVITY[g][0]), r] for g in cells}
    return f"""## What the numbers rest on, and what they leave out

- The failure rate is Llama 3's, on H100s at 700 W, applied per GPU to A100s (we found no
  published per-GPU rate of a comparable A100 run): a job's rate is its GPU count times
  {per_gpu_year():.3f} per GPU-year, so 512 GPUs fail 32 times less often than 16,384, and
  every interruption takes one 4-GPU node out. Among Llama 3's 419, 54 were software bugs
  (12.9%), which a spare may not cure, and 35 network switch or cable faults, which may take
  more than one node; here failures are independent (no correlated rack or switch failures).
- Checkpoint-restart's two inputs are assumptions: {x.checkpoint_s:.0f} s to write the
  {checkpoint_bytes(ps.MODELS[x.scenario.model]) / 1e9:.0f} GB checkpoint and
  {fmt_s(r)} from failure to training, at both scales. Together they give ~90% at 16,384
  GPUs, consistent with Llama 3's "more than 90%" but not fixed by it. The write time is the
  weak one: storage like Llama 3's (2 TB/s sustained) writes this checkpoint in under a
  second, and with C = {min(SENSITIVITY[16384][0])} s checkpoint-restart reaches
  {fast[16384]["checkpoint-restart"]:.4f} at 16,384 GPUs against hot swap's
  {fast[16384]["hot swap"]:.4f}, and at 512 GPUs with C = {min(SENSITIVITY[512][0])} s
  {fast[512]["checkpoint-restart"]:.4f} against {fast[512]["hot swap"]:.4f} (sensitivity
  tables, R = {fmt_s(r)}). R, on the other hand, is likely longer at 16,384 GPUs than at 512.
  Asynchronous checkpointing would cut C, not R.
- The hot swap's {fmt_s(x.scenario.swap_s)} at 512 GPUs is the DeadPool paper's upper bound,
  not our measurement (ours is CPU-only: a few seconds for 8 ranks); at 16,384 GPUs its
  {fmt_s(xs[16384].scenario.swap_s)} is an assumption. Warm spares cost GPUs: the "per GPU held"
  column divides by them.
- Iteration times come from an assumed MFU; the mirror's share grows with MFU and falls
  with batch size and link bandwidth: in the 65B run it would reach 1% only at an MFU of
  {0.01 / (x.plan.time.link / x.plan.time.iteration) * x.scenario.mfu:.1f}, which no GPU
  reaches. At 16,384 GPUs the same MFU is optimistic: {big.scenario.parallel.microbatches}
  microbatches per pipeline of {big.scenario.parallel.pp} stages leave a 1F1B bubble of
  {big.scenario.parallel.pp - 1}/{big.scenario.parallel.microbatches}; that changes the tokens,
  hardly the ratios.
- Not modelled: contention of the D2H copy with GPU-direct network traffic on PCIe, queue
  wait for a relaunch, planned maintenance (Llama 3's 47 more interruptions).
"""


def write_page(out_dir: str, seeds: Sequence[int], probe: bool = True) -> Dict[str, float]:
    os.makedirs(out_dir, exist_ok=True)
    measured = read_measured()
    items, hw_items = plans(), hardware_rows()
    crosscheck = crosscheck_table(probe)
    plot_memory(items, os.path.join(out_dir, "scale_memory.png"))
    xs = {g: inputs(SCENARIOS[g]) for g in SCENARIOS}
    results = {g: run_all(xs[g], seeds, trace=True) for g in xs}
    for g in xs:
        plot_goodput(xs[g], results[g], os.path.join(out_dir, f"scale_goodput_{g}.png"))
    yd = plot_young_daly(xs[16384], seeds[:32], os.path.join(out_dir, "scale_young_daly.png"))
    moe = inputs(MOE_SCENARIO)
    moe_results = run_all(moe, seeds, trace=True)
    plot_goodput(moe, moe_results, os.path.join(out_dir, "scale_goodput_mixtral.png"))
    cells = {g: sensitivity(xs[g], seeds[:16]) for g in xs}
    text = page(
        items,
        hw_items,
        crosscheck,
        xs,
        results,
        yd,
        measured,
        seeds,
        cells,
        hot_swap_check(xs[16384], seeds[:16]),
        moe_section(moe, moe_results, measured, seeds),
        scale_rebuild.section(probe),
    )
    with open(os.path.join(out_dir, "scale.md"), "w") as f:
        f.write(text)
    numbers = headline(xs[512], results[512])
    print(json.dumps({k: round(v, 5) for k, v in numbers.items()}))
    return numbers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=os.path.join(REPO, "docs"))
    parser.add_argument("--seeds", type=int, default=64, help="simulated jobs per strategy")
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="skip building the real layouts (megatron-core, ~10 s)",
    )
    opts = parser.parse_args(argv)
    seeds = range(opts.seeds)
    write_page(opts.output_dir, seeds, probe=not opts.no_probe)


if __name__ == "__main__":
    main()
