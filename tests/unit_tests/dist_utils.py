"""Launch real multi-process training runs and read what they leave."""

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A small GPT that still has every part: TP, PP, tied embeddings, dropout.
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3",
    "--lr-warmup-iters", "2", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--tokenizer-type", "ByteLevelTokenizer",
]


def worker_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def torchrun_command(nproc: int, args: List[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), os.path.join(REPO, "pretrain_gpt.py"), *args]


def run_pretrain(nproc: int, args: List[str], timeout: float = 300) -> str:
    """Run to completion; fail the test with the output if it fails."""
    proc = subprocess.run(torchrun_command(nproc, args), env=worker_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc.stdout


def read_metrics(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def curve(metrics: List[dict]) -> List[tuple]:
    """What must match bit for bit: per iteration loss, grad norm, lr."""
    return [(m["iteration"], m["lm_loss"], m["grad_norm"], m["lr"]) for m in metrics]


def checkpoint_files(directory: str, iteration: Optional[int] = None) -> Dict[str, dict]:
    if iteration is None:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
            iteration = int(f.read())
    folder = os.path.join(directory, f"iter_{iteration:07d}")
    return {name: torch.load(os.path.join(folder, name), weights_only=True)
            for name in sorted(os.listdir(folder))}


def assert_same_state(a, b, path: str = "") -> None:
    """Recursive, bitwise equality of two saved rank states."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ"
        for key in a:
            assert_same_state(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: dtype/shape differ"
        assert torch.equal(a, b), f"{path}: values differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def deadpool_args(tmp, layout: List[str], faults: List[str], iters: int,
                  heartbeat_timeout: float = 3) -> List[str]:
    """pretrain_gpt.py's arguments: TINY_GPT with --deadpool, writing to tmp."""
    return (TINY_GPT + layout + [
        "--use-distributed-optimizer", "--global-batch-size", "8", "--train-iters", str(iters),
        "--data-path", os.environ["HOT_SWAP_CORPUS"], "--save", str(tmp / "ckpt"),
        "--metrics-file", str(tmp / "metrics.jsonl"), "--deadpool",
        "--deadpool-events", str(tmp / "events.jsonl"), "--deadpool-heartbeat-timeout", str(heartbeat_timeout)]
        + [f"--deadpool-inject={f}" for f in faults])


def launch_command(launcher: List[str], args: List[str]) -> List[str]:
    return [sys.executable, "-m", "deadpool_ext.launch", *launcher,
            os.path.join(REPO, "pretrain_gpt.py"), *args]


def leftovers(tmp) -> str:
    """Processes still running that mention ``tmp`` (a run must leave none)."""
    return subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout


def launch_deadpool(tmp, layout: List[str], nodes: int, spares: int, per_node: int,
                    faults: List[str], iters: int, timeout: float = 420):
    """TINY_GPT through deadpool-launch on emulated nodes; returns the
    finished process and any process left behind that mentions ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    command = launch_command(["--standalone", "--nnodes", str(nodes), "--spare-nodes",
                              str(spares), "--nproc-per-node", str(per_node)],
                             deadpool_args(tmp, layout, faults, iters))
    proc = subprocess.run(command, env=worker_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    return proc, leftovers(tmp)


def must_succeed(result) -> None:
    proc, left = result
    assert proc.returncode == 0, f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert not left, f"processes left behind: {left}"
