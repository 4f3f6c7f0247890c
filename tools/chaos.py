"""A seeded, randomized fault campaign against deadpool-launch.

Each trial draws a topology (TP/PP/DP on two emulated 4-rank nodes, with or
without a warm spare node), a model size (tiny to the demo's), a target (a
rank, a node, or a rank together with its buddy), the iteration, the phase,
and a delay within the phase in milliseconds. It runs the job as a user
would (mock data, Megatron's default data-loader workers) and checks:

  * hot swap (spares enough): the loss, grad-norm and lr curve and every
    rank's final checkpoint equal the failure-free run's bit for bit;
  * shrink (no spare): every iteration runs with the failure-free run's
    samples and lr, loss and grad norm within 1e-5 relative (dropout on:
    its masks follow the sample, --deadpool-sample-rng);
  * rank and buddy lost: the job stops with the documented reason;
  * always: every survivor tore its groups down within the heartbeat
    timeout of the failure's detection (the release bound), the job ended
    before the trial's time limit, no process was left behind, and no
    corruption check (every iteration: the replicas' digests; in grad mode
    the buddy's replay) raised a false alarm.

A hang is a failed trial: every worker's stacks are dumped (py-spy when
installed, else faulthandler through SIGUSR1) into the trial's folder.

    python -m tools.chaos --trials 100 --seed 1 [--workdir runs/chaos]
    python -m tools.chaos --seed 1 --only 37        # replay trial 37 of seed 1
    python -m tools.chaos --trials 50 --first 50     # trials 50 to 99, the second part
    python -m tools.chaos --trials 20 --seed 3 --target coordinator
    python -m tools.chaos --trials 40 --seed 1 --target network

``--target coordinator`` kills node 0 in every trial, with the coordinator: one
launcher per node (not --standalone), a spare node and node 1's standby
(--standby-addr), which must take over; the rest is drawn as usual, and the
check is the hot swap's.

``--target network`` runs every trial across emulated hosts
(tools/hosts.py: root and nftables) with a fault of the network instead of
a death: a host isolated (silently or with its link down), its link
flapping shorter or longer than the heartbeat timeout, losing packets or
slow (tools/chaos_network.py says which, and what each must end as); a hot
swap bit for bit where a node is lost, the failure-free run where none is,
one coordinator per generation.

``--target drain`` drains a node in every trial instead of killing anything
(the planned event deadpool-ctl drain sends, ``drain:node=N:iter=I``), in a
24-iteration job, at iteration 8 to 18 (from the drawn one), with or without
a spare node and spares never waited for (a spare still warming up makes it a
shrink): nothing may fail or be redone (every rank stops at the decision's
boundary), a swap keeps the curve and state bit for bit, a shrink keeps the
shrink's tolerance, and a drain the job cannot carry out leaves it as it was.

Failure-free references are run once per (topology, model, dropout, random
streams) and shared between trials.
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from deadpool_ext.topology import buddy_map, nodes_by_block
from tools import chaos_network, hosts
from tools.compare import curve, read_metrics, shrink_difference, state_difference
from megatron.training.checkpointing import read_whole as checkpoint_state
from deadpool_ext.defaults import STUCK_KILL_TIMEOUTS
from deadpool_ext.events import read_events
from deadpool_ext.control.ports import free_port
from deadpool_ext.wire import new_secret
from tools.workers import worker_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, PER_NODE, ITERS, HEARTBEAT_TIMEOUT = 2, 4, 8, 5.0
# --distributed-timeout-minutes: on gloo the last bound on a survivor stuck
# on a queued send that holds the only copy of a shard (docs/reliability.md);
# a minute is plenty for these models' slowest collective.
GROUP_TIMEOUT_MINUTES = 1
# (TP, PP) on 8 ranks; DP = 8 / (TP * PP) >= 2 so that buddies exist.
SHAPES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]
MODELS = {  # name: hidden, sequence, micro batch, global batch
    "tiny": (64, 32, 2, 16),
    "small": (96, 64, 2, 16),
    "demo": (128, 128, 4, 32),
    "issue": (64, 32, 2, 8),  # the runs of the issue that made recovery release ranks
}
DRAWN_MODELS = ["tiny", "small", "demo"]
PHASES = ["forward", "backward", "grad-reduce", "optimizer", "mirror"]
# The documented reasons a job stops when a rank and its buddy are lost (the
# second loss may also land while a shrink is being carried out).
ABORT_REASONS = (
    "buddy",
    "no complete data-parallel replica",
    "no copy of their",
    "while the job was being resized",
)


@dataclass(frozen=True)
class Trial:
    index: int
    seed: int
    tp: int
    pp: int
    spares: int
    model: str
    target: str  # rank, node, rank+buddy, coordinator (node 0, its launcher too), network
    victim: int  # the rank (or node) killed
    iteration: int
    phase: str
    delay_ms: int
    with_dropout: bool = True
    sample_rng: bool = True  # --deadpool-sample-rng (off: each rank's stream, as Megatron-LM)
    spare_wait: Optional[float] = None  # --deadpool-spare-wait, default the flag's
    expect: Optional[str] = None  # swap, shrink or stop; default from the draw
    iters: int = ITERS
    virtual_stages: int = 1  # model chunks per pipeline rank (the interleaved schedule)
    mirror_mode: str = "state"  # --deadpool-mirror-mode
    rebuild_groups: str = "all"  # --deadpool-rebuild-groups (a campaign's, not drawn)
    # The spare node's spares stay warming until this generation trains
    # (--deadpool-inject slow-warm); None: ready as soon as they are warm.
    spares_ready_gen: Optional[int] = None

    @property
    def dp(self) -> int:
        return NODES * PER_NODE // (self.tp * self.pp)

    @property
    def expected(self) -> str:
        if self.expect is not None:
            return self.expect
        if self.target == "network":
            return "swap" if network_fault(self).declares_a_loss else "nothing"
        if self.target == "rank+buddy":
            return "stop"
        return "swap" if self.spares else "shrink"

    @property
    def dropout(self) -> bool:
        return self.with_dropout

    @property
    def rank_drawn_dropout(self) -> bool:
        """Dropout masks drawn from each rank's stream: a shrink moves
        microbatches to ranks that draw other masks."""
        return self.with_dropout and not self.sample_rng

    def describe(self) -> str:
        vpp = f"·VPP{self.virtual_stages}" if self.virtual_stages > 1 else ""
        keep = "keep " if self.rebuild_groups == "changed" else ""
        job = (
            f"TP{self.tp}·PP{self.pp}{vpp}·DP{self.dp} spares={self.spares} {self.model} "
            f"mirror={self.mirror_mode}"
        )
        if self.target == "drain":
            return f"{job} drain node {self.victim} at iter={self.iteration}"
        if self.target == "network":
            return f"{job} {network_fault(self).describe()}"
        held = (
            "" if self.spares_ready_gen is None else f" spares held to gen {self.spares_ready_gen}"
        )
        return (
            f"{job} {keep}{self.target} {self.victim} iter={self.iteration} {self.phase}"
            f"+{self.delay_ms}ms{held}"
        )


def draw(seed: int, index: int) -> Trial:
    rng = random.Random(f"{seed}:{index}")
    tp, pp = rng.choice(SHAPES)
    target = rng.choices(["rank", "node", "rank+buddy"], weights=[5, 4, 1])[0]
    victim = rng.randrange(NODES) if target == "node" else rng.randrange(NODES * PER_NODE)
    delay = 0 if rng.random() < 0.3 else rng.randrange(1, 200)
    trial = Trial(
        index,
        seed,
        tp,
        pp,
        rng.choice([0, 1]),
        rng.choice(DRAWN_MODELS),
        target,
        victim,
        rng.randrange(2, ITERS),
        rng.choice(PHASES),
        delay,
    )
    # Drawn last, so the draws above are those of earlier campaigns: half
    # of the two-stage pipelines run the interleaved schedule (4 layers: a
    # layer per virtual stage; every drawn model gives each replica a
    # multiple of 2 microbatches at DP 4 and 2).
    if pp == 2 and rng.random() < 0.5:
        trial = dataclasses.replace(trial, virtual_stages=2)
    # Then the mirror mode, half and half.
    if rng.random() < 0.5:
        trial = dataclasses.replace(trial, mirror_mode="grad")
    return trial


def aimed_at_coordinator(trial: Trial) -> Trial:
    """The draw with node 0 killed, its coordinator with it: a standby needs
    a third node, so the spare node is always there."""
    return dataclasses.replace(trial, target="coordinator", victim=0, spares=1)


DRAIN_ITERS = 24


def aimed_at_drain(trial: Trial) -> Trial:
    """The draw with a planned drain of a node instead of a fault; the
    drawn node, or the drawn rank's node, at an iteration from the draw's."""
    node = trial.victim if trial.target == "node" else trial.victim // PER_NODE
    return dataclasses.replace(
        trial,
        target="drain",
        victim=node % NODES,
        iters=DRAIN_ITERS,
        iteration=4 + 2 * trial.iteration,
        spare_wait=0.0,
        expect="drain",
    )


def buddy_of(trial: Trial, rank: int) -> int:
    """Its DP peer on the other node (the buddy map of --use-tp-pp-dp-mapping
    with two nodes: the rank at the same place in the other node's block)."""
    world = NODES * PER_NODE
    plan = buddy_map(
        world,
        trial.tp,
        trial.pp,
        nodes_by_block(world, PER_NODE),
        allow_same_node=False,
        tp_pp_dp=True,
    )
    return plan.buddy[rank]


def faults(trial: Trial) -> List[str]:
    specs = planned_or_fatal(trial)
    if trial.spares_ready_gen is not None:  # the spare node's spares
        specs.append(f"slow-warm:node={NODES}:gen={trial.spares_ready_gen}")
    return specs


def planned_or_fatal(trial: Trial) -> List[str]:
    if trial.target == "network":
        return []  # the network's fault, not the processes' (chaos_network.bring)
    if trial.target == "drain":
        return [f"drain:node={trial.victim}:iter={trial.iteration}"]
    where = f"iter={trial.iteration}:phase={trial.phase}:delay={trial.delay_ms}"
    if trial.target in ("node", "coordinator"):
        # With one launcher per node, killing node 0 kills its launcher too.
        return [f"kill:node={trial.victim}:{where}"]
    specs = [f"kill:rank={trial.victim}:{where}"]
    if trial.target == "rank+buddy":
        # The buddy dies once it has reported for the first failure: both
        # are surely lost (a buddy killed at the same point could be
        # released and recover before its own fault fires).
        specs.append(f"kill:rank={buddy_of(trial, trial.victim)}:phase=recovery")
    return specs


def job_args(trial: Trial, out: str) -> List[str]:
    hidden, seq, micro, global_batch = MODELS[trial.model]
    args = [
        "--num-layers",
        "4",
        "--hidden-size",
        str(hidden),
        "--num-attention-heads",
        "4",
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        str(micro),
        "--global-batch-size",
        str(global_batch),
        "--tensor-model-parallel-size",
        str(trial.tp),
        "--pipeline-model-parallel-size",
        str(trial.pp),
        "--use-tp-pp-dp-mapping",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
        "--train-iters",
        str(trial.iters),
        "--lr",
        "1e-3",
        "--seed",
        "1234",
        "--use-distributed-optimizer",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--save",
        os.path.join(out, "ckpt"),
        "--metrics-file",
        os.path.join(out, "metrics.jsonl"),
        "--deadpool",
        "--deadpool-events",
        os.path.join(out, "events.jsonl"),
        "--deadpool-heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        "--distributed-timeout-minutes",
        str(GROUP_TIMEOUT_MINUTES),
    ]
    if not trial.dropout:
        args += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if not trial.sample_rng:
        args += ["--no-deadpool-sample-rng"]
    if trial.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(trial.virtual_stages)]
    args += ["--deadpool-mirror-mode", trial.mirror_mode]
    args += ["--deadpool-rebuild-groups", trial.rebuild_groups]
    if trial.spare_wait is not None:
        args += ["--deadpool-spare-wait", str(trial.spare_wait)]
    return args


def launch_commands(args: List[str], spares: int, per_node: bool) -> List[List[str]]:
    """One standalone launcher, or (``per_node``) one launcher per node on
    this host as on a cluster, node 1 keeping the standby."""
    script = [os.path.join(REPO, "pretrain_gpt.py"), *args]
    sizes = ["--nnodes", str(NODES), "--spare-nodes", str(spares), "--nproc-per-node"]
    sizes.append(str(PER_NODE))
    launcher = [sys.executable, "-m", "deadpool_ext.launch", *sizes]
    if not per_node:
        return [[*launcher, "--standalone", *script]]
    port = free_port(span=2)  # and the standby's
    where = ["--master-addr", "127.0.0.1", "--master-port", str(port), "--standby-addr"]
    where.append("127.0.0.1")
    return [
        [*launcher, *where, "--node-rank", str(node), *script] for node in range(NODES + spares)
    ]


def start_launcher(command: List[str], env: dict, log) -> subprocess.Popen:
    """One launcher, its node's session, writing to ``log``. (The test suite
    forks it from its session's fork server instead: a stand-in with the
    same signature, tests/common/forkserver.py.)"""
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def launch(
    args: List[str], spares: int, out: str, limit_s: float, per_node: bool = False
) -> Tuple[int, str, bool]:
    """Run one job; returns (exit code, its output's tail, timed out). With
    one launcher per node the job's code is the coordinator's at the end:
    node 1's, which took over from node 0 (the only one killed)."""
    os.makedirs(out, exist_ok=True)
    env = worker_env(DEADPOOL_SECRET=new_secret())
    with open(os.path.join(out, "log"), "w") as log:
        procs = [
            start_launcher(command, env, log) for command in launch_commands(args, spares, per_node)
        ]
        timed_out = not see_out(procs, out, limit_s)
    with open(os.path.join(out, "log")) as log:
        tail = log.read()[-3000:]
    return procs[1 if per_node else 0].returncode, tail, timed_out


def see_out(procs: List[subprocess.Popen], out: str, limit_s: float) -> bool:
    """Wait for the job's launchers (False: it ran past ``limit_s``, its
    stacks are dumped); none is left running."""
    ended = wait_watching(procs, out, limit_s)
    if not ended:
        dump_stacks(out)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return ended


def wait_watching(procs: List[subprocess.Popen], out: str, limit_s: float) -> bool:
    """Wait for the job; False if it ran past ``limit_s``. A generation not
    decided well past the release bound means some survivor is stuck: its
    stacks are dumped then, while it still is."""
    deadline, dumped = time.monotonic() + limit_s, False
    events = os.path.join(out, "events.jsonl")
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
        if not dumped and undecided_for(read_jsonl(events)) > 4 * HEARTBEAT_TIMEOUT:
            dump_stacks(out)
            dumped = True
    return True


def undecided_for(events: List[dict]) -> float:
    """Seconds since the newest failure was detected, while no survivor is
    waiting for a decision about it for good reason (none yet, or spares)."""
    failures = [e for e in events if e["event"] == "failure_detected" and e["rank"] == -1]
    if not failures:
        return 0.0
    gen = failures[-1]["gen"]
    settled = ("decision", "waiting_for_spares", "abort")
    if any(e["event"] in settled and e.get("gen") == gen and e["rank"] == -1 for e in events):
        return 0.0
    return time.time() - failures[-1]["time"]


def workers_of(out: str) -> List[int]:
    """Training processes of the job writing to ``out`` (not their data-loader children)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{parent}/cmdline", "rb") as f:
                parent_cmd = f.read()
        except OSError:
            continue
        zygote = b"deadpool_ext.control.zygote"  # a node's, which forks its workers
        if (
            b"pretrain_gpt.py" in cmd
            and out.encode() in cmd
            and b"-u\0" in cmd
            and zygote not in cmd
            and (b"-u\0" not in parent_cmd or zygote in parent_cmd)
        ):
            found.append(int(pid))
    return found


def dump_stacks(out: str) -> None:
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    with open(os.path.join(out, "stacks.txt"), "w") as f:
        for pid in workers_of(out):
            f.write(f"===== pid {pid}\n")
            f.flush()
            if py_spy:
                subprocess.run(
                    [py_spy, "dump", "--pid", str(pid)],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=60,
                )
            else:
                os.kill(pid, signal.SIGUSR1)  # faulthandler writes to the job's log
    time.sleep(1)


def leftovers(out: str, grace_s: float = 10.0) -> List[int]:
    """Processes of the job still alive ``grace_s`` after it ended (a killed
    or finished rank's data-loader workers notice within torch's 5 s check)."""
    deadline = time.monotonic() + grace_s
    while True:
        result = subprocess.run(["pgrep", "-f", out], capture_output=True, text=True)
        found = [int(p) for p in result.stdout.split()]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


# ----- checks -----
def read_jsonl(path: str) -> List[dict]:
    return read_events(path) if os.path.exists(path) else []


def check_swap(out: str, ref: str) -> Optional[str]:
    got, want = (
        read_jsonl(os.path.join(out, "metrics.jsonl")),
        read_metrics(os.path.join(ref, "metrics.jsonl")),
    )
    if curve(got) != curve(want):
        return "the curve differs from the failure-free run"
    got_state = checkpoint_state(os.path.join(out, "ckpt"))
    want_state = checkpoint_state(os.path.join(ref, "ckpt"))
    where = state_difference(got_state, want_state)
    return f"final state differs: {where}" if where else None


def check_shrink(trial: Trial, out: str, ref: str) -> Optional[str]:
    """The shrunk run kept the failure-free run's course (compare.py)."""
    got, want = (
        read_jsonl(os.path.join(out, "metrics.jsonl")),
        read_jsonl(os.path.join(ref, "metrics.jsonl")),
    )
    if [m["iteration"] for m in got] != list(range(1, trial.iters + 1)):
        return f"iterations {[m['iteration'] for m in got]}"
    return shrink_difference(got, want, trial.iteration, trial.rank_drawn_dropout)


def check_drain(trial: Trial, out: str, ref: str, events: List[dict]) -> Optional[str]:
    """Nothing failed or was redone; a swap bit for bit, a shrink within the
    tolerance, a refused drain the job as it was."""
    if any(e["event"] == "failure_detected" for e in events):
        return "a failure was detected in a planned drain"
    decisions = [e for e in events if e["event"] == "decision"]
    if not decisions:
        ended = [e for e in events if e["event"] == "drain_refused"]
        return None if ended else "neither drained nor refused"
    decision = decisions[0]
    stopped = {e["iteration"] for e in events if e["event"] == "failure_seen"}
    if stopped != {decision["rollback_to"]}:
        went_on = decision["rollback_to"]
        return f"ranks stopped at {sorted(stopped)}, the decision went on after {went_on}"
    if decision["action"] == "shrink":
        got = read_jsonl(os.path.join(out, "metrics.jsonl"))
        want = read_jsonl(os.path.join(ref, "metrics.jsonl"))
        return shrink_difference(got, want, decision["rollback_to"] + 1, trial.rank_drawn_dropout)
    if not decision["drained"] and not any(e["event"] == "drain_refused" for e in events):
        return "not drained, and no drain_refused event says why"
    return check_swap(out, ref)


def stuck_survivors(events: List[dict]) -> List[int]:
    """Survivors still training after a failure was announced (their stacks
    are in the events: 'stuck'): killed by the coordinator, or, holding the
    only copy of a shard, waited for until the groups' timeout freed them."""
    killed = [
        rank
        for e in events
        if e["event"] == "failure_detected" and e["rank"] == -1 and "stuck" in e["reason"]
        for rank in e["ranks"]
    ]
    return killed + [rank for e in events if e["event"] == "stuck_waited" for rank in e["ranks"]]


def check_release_bound(events: List[dict]) -> Optional[str]:
    """Every survivor was released within the bound: it reported within the
    heartbeat timeout of the coordinator's detection, or, stuck where no
    release reaches (gloo's queued send, docs/reliability.md), it was
    killed STUCK_KILL_TIMEOUTS heartbeat timeouts after (plus one timeout of
    slack for the coordinator's checks and the kill)."""
    detected = {e["gen"]: e for e in events if e["event"] == "failure_detected" and e["rank"] == -1}
    waited = {
        (e["gen"], rank) for e in events if e["event"] == "stuck_waited" for rank in e["ranks"]
    }
    for e in events:
        if e["event"] != "reported" or e.get("for_gen") not in detected:
            continue
        took = e["time"] - detected[e["for_gen"]]["time"]
        bound = HEARTBEAT_TIMEOUT
        if (e["for_gen"], e["rank"]) in waited:  # freed by the groups' timeout
            bound = GROUP_TIMEOUT_MINUTES * 60 + 2 * HEARTBEAT_TIMEOUT
        if took > bound:
            return f"rank {e['rank']} reported {took:.1f} s after the failure was detected"
    for gen, e in detected.items():
        if "stuck" in e["reason"] and gen - 1 in detected:
            waited = e["time"] - detected[gen - 1]["time"]
            if waited > (STUCK_KILL_TIMEOUTS + 1) * HEARTBEAT_TIMEOUT:
                return f"a stuck survivor was killed {waited:.1f} s after the failure"
    return None


def false_alarms(events: List[dict]) -> Optional[str]:
    """No bit flipped in a chaos trial: any corruption caught is a false one."""
    caught = [e for e in events if e["event"] == "sdc_detected"]
    if not caught:
        return None
    return f"false alarm: {caught[0]['check']} check in iteration {caught[0]['iteration']}"


def check(trial: Trial, out: str, ref: Optional[str], code: int, tail: str) -> Optional[str]:
    events = read_jsonl(os.path.join(out, "events.jsonl"))
    alarm = false_alarms(events)
    if alarm:
        return alarm
    if trial.expected == "stop":
        if code == 0:
            return "the job finished although a rank and its buddy were lost"
        if not any(reason in tail for reason in ABORT_REASONS):
            return "stopped without the documented reason"
        return check_release_bound(events)
    if code != 0:
        return f"exit code {code}"
    bound = check_release_bound(events)
    if bound:
        return bound
    if not any(e["event"] == "fault_injected" for e in events):
        return "the fault never fired"
    if trial.expected == "drain":
        return check_drain(trial, out, ref, events)
    return check_swap(out, ref) if trial.expected == "swap" else check_shrink(trial, out, ref)


# ----- the network target (tools/chaos_network.py) -----
NETWORK_ITERS = 12


def aimed_at_network(trial: Trial) -> Trial:
    """The draw across emulated hosts with the spare node (a standby needs
    three nodes) and a longer run for the fault to land in; nothing is
    injected into the processes: the fault is the network's."""
    return dataclasses.replace(trial, target="network", spares=1, iters=NETWORK_ITERS)


def network_fault(trial: Trial) -> chaos_network.NetworkFault:
    return chaos_network.draw_fault(
        trial.seed, trial.index, NODES + 1, trial.iters, HEARTBEAT_TIMEOUT
    )


def launch_on_hosts(trial: Trial, out: str, limit_s: float) -> Tuple[List[int], bool]:
    """The trial's job, one launcher per emulated host, and its network
    fault; returns (every launcher's exit code, timed out)."""
    os.makedirs(out, exist_ok=True)
    script = [os.path.join(REPO, "pretrain_gpt.py"), *job_args(trial, out)]
    env = worker_env(DEADPOOL_SECRET=new_secret())
    with hosts.Lab(NODES + 1) as lab, open(os.path.join(out, "log"), "w") as log:
        procs = [
            lab.start(node, command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            for node, command in enumerate(chaos_network.launchers(lab, NODES, PER_NODE, script))
        ]
        chaos_network.bring(lab, network_fault(trial), out, limit_s)
        timed_out = not see_out(procs, out, limit_s)
    return [proc.returncode for proc in procs], timed_out


def check_network(trial: Trial, out: str, ref: str, codes: List[int]) -> Optional[str]:
    events = read_jsonl(os.path.join(out, "events.jsonl"))
    problem = chaos_network.network_problem(network_fault(trial), events, codes)
    return problem or false_alarms(events) or check_swap(out, ref)


# ----- the campaign -----
def reference(trial: Trial, workdir: str, limit_s: float) -> str:
    key = (
        f"ref-tp{trial.tp}-pp{trial.pp}-vpp{trial.virtual_stages}-{trial.model}-"
        f"{'drop' if trial.dropout else 'nodrop'}{'' if trial.sample_rng else '-rankrng'}"
        f"-{trial.iters}"
    )
    out = os.path.join(workdir, key)
    if not os.path.exists(os.path.join(out, "done")):
        shutil.rmtree(out, ignore_errors=True)
        code, tail, timed_out = launch(job_args(trial, out), 0, out, limit_s)
        if code != 0:
            raise RuntimeError(f"failure-free run {key} failed ({code}):\n{tail}")
        open(os.path.join(out, "done"), "w").close()
    return out


def run_trial(trial: Trial, workdir: str, limit_s: float) -> dict:
    # A job that must stop is checked by its exit and events, not by a curve.
    ref = None if trial.expected == "stop" else reference(trial, workdir, limit_s)
    out = os.path.join(workdir, f"trial-{trial.seed}-{trial.index:03d}")
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    if trial.target == "network":
        codes, timed_out = launch_on_hosts(trial, out, limit_s)
    else:
        code, tail, timed_out = launch(
            job_args(trial, out) + [f"--deadpool-inject={spec}" for spec in faults(trial)],
            trial.spares,
            out,
            limit_s,
            per_node=trial.target == "coordinator",
        )
    seconds = time.monotonic() - start
    if timed_out:
        problem = f"hung: no end within {limit_s:.0f} s (stacks in {out}/stacks.txt)"
    elif trial.target == "network":
        problem = check_network(trial, out, ref, codes)
    else:
        problem = check(trial, out, ref, code, tail)
    left = leftovers(out)
    if left and not problem:
        problem = f"processes left behind: {left}"
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stuck = stuck_survivors(read_jsonl(os.path.join(out, "events.jsonl")))
    return dict(
        asdict(trial),
        draw=trial.describe(),
        expected=trial.expected,
        passed=problem is None,
        problem=problem,
        stuck=stuck,
        seconds=round(seconds, 1),
        folder=out,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument(
        "--first",
        type=int,
        default=0,
        help="index of the first trial: a campaign may run in parts "
        "(--first 50 --trials 50 is the second half of --trials 100)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, nargs="*", help="replay these trial indices")
    parser.add_argument("--workdir", default=os.path.join(REPO, "runs", "chaos"))
    parser.add_argument("--limit", type=float, default=400, help="seconds a job may take")
    parser.add_argument("--output", help="write every trial's result here (JSON)")
    parser.add_argument(
        "--target",
        choices=["drawn", "coordinator", "drain", "network"],
        default="drawn",
        help="coordinator: kill node 0 with the coordinator in every trial; drain: drain a "
        "node in every trial, nothing killed; network: a fault of the network across "
        "emulated hosts (root and nftables: tools/hosts.py), nothing killed",
    )
    parser.add_argument(
        "--rebuild-groups",
        choices=["all", "changed"],
        default="all",
        help="--deadpool-rebuild-groups of every trial (the draws stay the same)",
    )
    args = parser.parse_args(argv)
    indices = args.only if args.only else range(args.first, args.first + args.trials)
    os.makedirs(args.workdir, exist_ok=True)
    results = []
    print(
        f"{'trial':>5} {'seed':>5}  {'draw':<72} {'expected':<8} {'result':<6} seconds", flush=True
    )
    for index in indices:
        trial = draw(args.seed, index)
        if args.target == "coordinator":
            trial = aimed_at_coordinator(trial)
        elif args.target == "drain":
            trial = aimed_at_drain(trial)
        elif args.target == "network":
            trial = aimed_at_network(trial)
        trial = dataclasses.replace(trial, rebuild_groups=args.rebuild_groups)
        result = run_trial(trial, args.workdir, args.limit)
        results.append(result)
        verdict = ("pass*" if result["stuck"] else "pass") if result["passed"] else "FAIL"
        print(
            f"{index:>5} {args.seed:>5}  {trial.describe():<72} {trial.expected:<8} "
            f"{verdict:<6} {result['seconds']:.0f}",
            flush=True,
        )
        if not result["passed"]:
            print(
                f"      {result['problem']}  (replay: python -m tools.chaos --seed {args.seed} "
                f"--only {index})",
                flush=True,
            )
    failed = [r for r in results if not r["passed"]]
    stuck = [r["index"] for r in results if r["passed"] and r["stuck"]]
    print(
        f"trials: {len(results)}, passed: {len(results) - len(failed)}, failed: {len(failed)}"
        + (f" (seed {args.seed}, trials {[r['index'] for r in failed]})" if failed else "")
    )
    if stuck:
        print(
            f"pass*: {len(stuck)} passed with a survivor stuck on gloo's queued send, "
            f"killed and restored from its buddy or, holding the only copy of a shard, "
            f"freed by the groups' timeout (trials {stuck}; stacks: event 'stuck')"
        )
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"seed": args.seed, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
