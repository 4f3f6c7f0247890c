"""Launch real multi-process training runs and read what they leave."""

import json
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import forkserver

# Re-exported for the tests: how runs are compared lives in the package.
from tools.compare import curve, model_tensors, read_metrics  # noqa: F401
from megatron.training.checkpointing import read_args as saved_args  # noqa: F401
from megatron.training.checkpointing import read_whole as checkpoint_state  # noqa: F401
from tools.compare import state_difference
from tools.bench.common import MOE_LAYERS
from tools.workers import worker_env

COMMON = os.path.dirname(os.path.abspath(__file__))  # tests/common: these helpers
REPO = os.path.dirname(os.path.dirname(COMMON))

# The tests' model shape, whatever its depth and data.
GPT_SHAPE = [
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
]
# A small GPT that still has every part: TP, PP, tied embeddings, dropout.
TINY_GPT = (
    ["--num-layers", "4"]
    + GPT_SHAPE
    + [
        "--lr",
        "1e-3",
        "--lr-warmup-iters",
        "2",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ]
)


# TINY_GPT as a mixture of experts (4 experts, top-2, EP 2) on 8 ranks as
# PP2 x DP4 (expert-DP 2), for 4 emulated nodes of 2 ranks: in Megatron's
# default order (megatron-core refuses EP across replicas with
# --use-tp-pp-dp-mapping and PP > 1) node k holds replicas 2k, 2k+1 of
# stage k // 2. Ten processes start on two cores and compile the routers'
# kernels: a heartbeat thread may starve for more than 3 s.
MOE = ["--pipeline-model-parallel-size", "2"] + MOE_LAYERS
MOE += ["--deadpool-heartbeat-timeout", "10"]
# DeepSeek-V3's model state beside the parameters: the routers' expert
# biases (moved every iteration, far enough to change the routing within a
# few), group-limited routing, a dense first layer, one multi-token
# prediction layer on the last stage (with its copy of the embedding).
MOE += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
MOE += ["--moe-router-bias-update-rate", "1e-2", "--moe-layer-freq", "([0]+[1]*3)"]
MOE += ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
MOE += ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]
MOE += ["--untie-embeddings-and-output-weights"]

# A model of the same shape on megatron-core's mock data (no files).
MOCK_GPT = (
    ["--num-layers", "2"]
    + GPT_SHAPE
    + [
        "--global-batch-size",
        "8",
        "--lr",
        "1e-3",
        "--train-iters",
        "6",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
    ]
)


def corpus_run(directory, corpus: str, iters: int, global_batch: int = 8) -> List[str]:
    """Training on the corpus for ``iters`` iterations of ``global_batch``
    sequences, the metrics in ``directory``."""
    return [
        *("--global-batch-size", str(global_batch), "--data-path", corpus),
        *("--train-iters", str(iters), "--metrics-file", str(directory / "metrics.jsonl")),
    ]


# What starts ``nproc`` ranks of a script: torchrun, or the ranks forked
# from one zygote (forkrun.py: a quarter of the start) with torchrun's variables.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
FORKRUN = [sys.executable, "-u", os.path.join(COMMON, "forkrun.py")]


def torchrun_command(nproc: int, args: List[str], script: str = "pretrain_gpt.py") -> List[str]:
    """``script`` (relative to the repository) on ``nproc`` ranks, under torchrun."""
    return TORCHRUN + [str(nproc), os.path.join(REPO, script), *args]


def forkrun_command(nproc: int, args: List[str], script: str = "pretrain_gpt.py") -> List[str]:
    """What torchrun_command runs, on forked ranks."""
    return FORKRUN + [str(nproc), os.path.join(REPO, script), *args]


def captured(
    command: List[str], timeout: float, env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """``command`` run to its end in the repository, in ``env`` (the
    workers' by default); output captured. Served by the fork server where
    it can be."""
    return forkserver.run(command, env or worker_env(), REPO, timeout)


def torchrun(
    nproc: int, args: List[str], timeout: float = 300, script: str = "pretrain_gpt.py"
) -> subprocess.CompletedProcess:
    return captured(torchrun_command(nproc, args, script), timeout)


def forkrun(
    nproc: int, args: List[str], timeout: float = 300, script: str = "pretrain_gpt.py"
) -> subprocess.CompletedProcess:
    return captured(forkrun_command(nproc, args, script), timeout)


def run_pretrain(nproc: int, args: List[str], timeout: float = 300) -> str:
    """Run to completion on forked ranks; fail the test with the output if
    it fails."""
    proc = forkrun(nproc, args, timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


def gpt2_bpe_data(corpus_prefix: str) -> Tuple[str, List[str]]:
    """The corpus in GPT-2 BPE ids beside ``corpus_prefix`` (the conftest's
    corpus), and the --vocab-file and --merge-file flags of its tokenizer
    (GPT2BPETokenizer, Megatron-LM's default type)."""
    folder = os.path.dirname(corpus_prefix)
    gpt2 = os.path.join(folder, "tokenizers", "gpt2")
    files = ["--vocab-file", os.path.join(gpt2, "vocab.json")]
    files += ["--merge-file", os.path.join(gpt2, "merges.txt")]
    return os.path.join(folder, "corpus_gpt2_text_document"), files


def assert_same_state(a, b, path: str = "") -> None:
    """Recursive, bitwise equality of two saved rank states."""
    difference = state_difference(a, b, path)
    assert difference is None, difference


def assert_same_run(run_dir, reference_dir, iters: int, checkpoints: str = "ckpt") -> None:
    """The run in ``run_dir`` trained iterations 1 .. ``iters`` on the
    reference's curve to its final state (in ``checkpoints``), bit for bit."""
    got = read_metrics(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in got] == list(range(1, iters + 1))
    assert curve(got) == curve(read_metrics(reference_dir / "metrics.jsonl"))
    assert_same_state(
        checkpoint_state(str(run_dir / checkpoints)),
        checkpoint_state(str(reference_dir / checkpoints)),
    )


def mirror_mode_args() -> List[str]:
    """DEADPOOL_TEST_MIRROR_MODE=grad runs every launched test in that mirror
    mode (the default mode's runs are CI's)."""
    mode = os.environ.get("DEADPOOL_TEST_MIRROR_MODE")
    return ["--deadpool-mirror-mode", mode] if mode else []


def deadpool_args(
    tmp,
    layout: List[str],
    faults: List[str],
    iters: int,
    heartbeat_timeout: float = 3,
    schedule: Optional[List[str]] = None,
) -> List[str]:
    """pretrain_gpt.py's arguments: TINY_GPT with --deadpool, writing to tmp;
    ``schedule`` replaces the global batch of 8 for ``iters`` iterations;
    ``layout`` may set the heartbeat timeout again (the last one counts)."""
    schedule = schedule or ["--global-batch-size", "8", "--train-iters", str(iters)]
    return (
        TINY_GPT
        + ["--deadpool-heartbeat-timeout", str(heartbeat_timeout)]
        + layout
        + schedule
        + [
            "--use-distributed-optimizer",
            "--data-path",
            os.environ["HOT_SWAP_CORPUS"],
            "--save",
            str(tmp / "ckpt"),
            "--metrics-file",
            str(tmp / "metrics.jsonl"),
            "--deadpool",
            "--deadpool-events",
            str(tmp / "events.jsonl"),
            "--tensorboard-dir",
            str(tmp / "tb"),
        ]
        + mirror_mode_args()
        + [f"--deadpool-inject={f}" for f in faults]
    )


def launch_command(
    launcher: List[str], args: List[str], script: str = "pretrain_gpt.py"
) -> List[str]:
    """deadpool-launch with ``launcher``'s flags running ``script`` (relative
    to the repository)."""
    return [
        sys.executable,
        "-m",
        "deadpool_ext.launch",
        *launcher,
        os.path.join(REPO, script),
        *args,
    ]


def leftovers(tmp) -> str:
    """Processes still running that mention ``tmp`` (a run must leave none)."""
    return subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout


def launch_deadpool(
    tmp,
    layout: List[str],
    nodes: int,
    spares: int,
    per_node: int,
    faults: List[str],
    iters: int,
    timeout: float = 420,
    schedule: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
):
    """TINY_GPT through deadpool-launch on emulated nodes; returns the
    finished process and any process left behind that mentions ``tmp``.
    ``env``: variables beside the workers' usual ones."""
    tmp.mkdir(parents=True, exist_ok=True)
    command = launch_command(
        [
            "--standalone",
            "--nnodes",
            str(nodes),
            "--spare-nodes",
            str(spares),
            "--nproc-per-node",
            str(per_node),
        ],
        deadpool_args(tmp, layout, faults, iters, schedule=schedule),
    )
    proc = forkserver.run(command, {**worker_env(), **(env or {})}, REPO, timeout)
    return proc, leftovers(tmp)


def launch_on_nodes(
    tmp, args: List[str], nodes: int, spares: int, per_node: int, timeout: float = 420
) -> List[int]:
    """One deadpool-launch per node, as on a cluster (not --standalone), all
    on this host: node 0 hosts the store and the coordinator, node 1 the
    standby (--standby-addr). Each launcher's process group is its node
    (``kill:node=N`` kills it all). Returns the launchers' exit codes; their
    output is in ``tmp/node{N}.log``."""
    import secrets

    from deadpool_ext.control.ports import free_port

    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port(span=2)  # and the standby's
    env = dict(worker_env(), DEADPOOL_SECRET=secrets.token_hex(32))
    launchers = []
    for node in range(nodes + spares):
        flags = launcher_flags(node, nodes, spares, per_node, port, "127.0.0.1", "127.0.0.1")
        with open(tmp / f"node{node}.log", "w") as log:
            launchers.append(forkserver.start_logged(launch_command(flags, args), env, REPO, log))
    return wait_for(launchers, timeout)


def launcher_flags(node: int, nodes: int, spares: int, per_node: int, port: int, addr, standby):
    """deadpool-launch's flags for ``node`` as on a cluster: node 0 at
    ``addr`` hosts the store and the coordinator, the standby at ``standby``."""
    flags = ["--nnodes", str(nodes), "--spare-nodes", str(spares)]
    flags += ["--nproc-per-node", str(per_node), "--node-rank", str(node)]
    flags += ["--master-addr", addr, "--master-port", str(port)]
    return flags + ["--standby-addr", standby]


def start_on_hosts(lab, tmp, args: List[str], nodes: int, spares: int, per_node: int):
    """One deadpool-launch per emulated host of ``lab`` (tools/hosts.py),
    node N on host N, as on a cluster; their output in ``tmp/node{N}.log``.
    Returns the launchers, started; ``wait_for`` waits for them."""
    import secrets

    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(worker_env(), DEADPOOL_SECRET=secrets.token_hex(32))
    addr, standby = lab.hosts[0].address, lab.hosts[1].address
    launchers = []
    for node in range(nodes + spares):
        flags = launcher_flags(node, nodes, spares, per_node, 29500, addr, standby)
        with open(tmp / f"node{node}.log", "w") as log:
            command = launch_command(flags, args)
            launchers.append(lab.start(node, command, env=env, cwd=REPO, stdout=log, stderr=log))
    return launchers


def wait_for(launchers, timeout: float = 420) -> List[int]:
    """The launchers' exit codes; any left running after ``timeout`` is
    killed with its process group, its node (-9)."""
    import time

    deadline = time.monotonic() + timeout
    codes = []
    for proc in launchers:
        try:
            codes.append(proc.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            codes.append(proc.wait())
    return codes


def metrics_reach(path, iteration: int) -> bool:
    """Whether the metrics file at ``path`` has logged ``iteration``."""
    try:
        return any(m["iteration"] >= iteration for m in read_metrics(path))
    except (OSError, ValueError, KeyError):
        return False


# torch's native stack traces: pages of them when a store's server dies,
# which is what a node's log ends with in every takeover.
NATIVE_TRACE = re.compile(
    r"\s*(frame #\d+:|<omitting python frames>|Exception raised from )|\[W\d+ .*\] \[c10d\]"
)


def readable_logs(tmp, nodes: int, lines: int = 40) -> str:
    """What a failed assertion on a launch_on_nodes job shows: the last
    ``lines`` of each node's log without torch's native stack traces, then
    the coordinator's events (who was lost, what was decided)."""
    parts = []
    for node in range(nodes):
        log = tmp / f"node{node}.log"
        text = log.read_text(errors="replace").splitlines() if log.exists() else ["(no log)"]
        kept = [line for line in text if line.strip() and not NATIVE_TRACE.match(line)]
        parts.append(f"===== node {node}\n" + "\n".join(kept[-lines:]))
    events = tmp / "events.jsonl"
    said = []
    for line in events.read_text().splitlines() if events.exists() else []:
        try:  # a line the killed coordinator was writing may be cut
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("rank") == -1:
            said.append(json.dumps(event, sort_keys=True)[:400])
    return "\n".join([*parts, "===== the coordinator's events", *said[-lines:]])


def must_succeed(result) -> None:
    proc, left = result
    assert proc.returncode == 0, f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert not left, f"processes left behind: {left}"


def tensorboard_scalars(directory):
    """{tag: [(step, value)]} as TensorBoard shows them (purges applied), of
    the directory and its 'vs-samples' run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for run in (directory, os.path.join(directory, "vs-samples")):
        events = EventAccumulator(run, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in events.Scalars(tag)]
    return scalars


def tensorboard_texts(directory, tag):
    """The text entries written under ``tag``, in step order (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory, size_guidance={"tensors": 0})
    events.Reload()
    name = next(t for t in events.Tags()["tensors"] if t.startswith(tag))
    return [e.tensor_proto.string_val[0].decode() for e in events.Tensors(name)]


def float32(value):
    import numpy

    return float(numpy.float32(value))
