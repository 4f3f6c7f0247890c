"""deadpool-launch's command line: its flags, and the checks that run before anything starts.

The flags take torchrun's spellings where a job with warm spares has a use
for them (the others are refused with the reason); the checks take in the
training script's --deadpool* flags (read as its workers will read them).
"""

import argparse
import os
import sys

from megatron.training.arguments import ConfigError

from deadpool_ext.config import coordinator_settings
from deadpool_ext.protocol import SECRET_ENV

DESCRIPTION = "deadpool-launch: a torchrun-like launcher with warm spare nodes."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deadpool-launch", description=DESCRIPTION, allow_abbrev=False)
    env = os.environ
    p.add_argument(
        "--nnodes",
        type=node_count,
        default=int(env.get("DEADPOOL_NNODES", "1")),
        help="Active nodes (training ranks).",
    )
    p.add_argument("--spare-nodes", type=int, default=0, help="Warm spare nodes.")
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=ranks_per_node,
        default=1,
        help="Ranks per node: a number, or as torchrun gpu (the GPUs visible), auto (the "
        "GPUs, else the CPU cores) or cpu (the CPU cores).",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="The script is a module, run as python -m runs it (torchrun's flag).",
    )
    # torchrun's rendezvous spellings: node 0's store is the rendezvous.
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        help="HOST[:PORT] of node 0 (torchrun's spelling of --master-addr and --master-port).",
    )
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        help="c10d only (torchrun's default store): node 0 hosts the job's store.",
    )
    p.add_argument("--rdzv-id", "--rdzv_id", help="Accepted (torchrun's); no effect here.")
    # torchrun's that a job with spares has no use for: refused with the reason.
    for flags in (("--max-restarts", "--max_restarts"), ("--log-dir", "--log_dir"), ("--tee",)):
        p.add_argument(*flags, help=argparse.SUPPRESS)
    p.add_argument("-r", "--redirects", help=argparse.SUPPRESS)
    p.add_argument(
        "--standalone",
        action="store_true",
        help="Emulate every node on this host (one agent process per node).",
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",  # torchrun's spelling too
        type=int,
        default=int(env.get("SLURM_NODEID", "0")),
        help="This node's index (default SLURM_NODEID).",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",  # torchrun's spelling too
        default=env.get("MASTER_ADDR", "127.0.0.1"),
        help="Host of node 0 (store and coordinator).",
    )
    p.add_argument(
        "--master-port",
        "--master_port",  # torchrun's spelling too
        type=int,
        default=int(env.get("MASTER_PORT", "0")),
        help="Port of the store (0: a free one; standalone only).",
    )
    p.add_argument(
        "--standby-addr",
        default=env.get("DEADPOOL_STANDBY_ADDR"),
        help="Host of node 1, whose launcher then keeps a standby coordinator "
        "(its store at --master-port + 1) that takes over when node 0 dies "
        "(default DEADPOOL_STANDBY_ADDR; none without it).",
    )
    p.add_argument(
        "--takeover-file",
        default=env.get("DEADPOOL_TAKEOVER_FILE"),
        help="With --standby-addr: node 1's launcher writes why it took over "
        "here, so that a batch system knows whose exit status is the job's "
        "(examples/slurm/on_node.sh; default DEADPOOL_TAKEOVER_FILE).",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="Join a running job as a spare node (a repaired or new node); give "
        "--node-rank, --master-addr and --master-port.",
    )
    p.add_argument("script", help="The training script, e.g. pretrain_gpt.py.")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def node_count(text: str) -> int:
    low, _, high = text.partition(":")
    if high and low == high:  # torchrun's fixed size N:N
        return int(low)
    if high:
        raise argparse.ArgumentTypeError(
            f"elastic --nnodes {text}: deadpool-launch keeps the job at its size with warm "
            "spare nodes (--spare-nodes), shrinks it when they run out and grows it back "
            "when nodes join (--join): give the active nodes' count"
        )
    return int(text)


def ranks_per_node(text: str) -> int:
    """torchrun's --nproc-per-node: a number, gpu, auto or cpu."""
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0 and text == "gpu":
            raise argparse.ArgumentTypeError("--nproc-per-node gpu: no GPU is visible")
        return gpus or os.cpu_count() or 1
    return int(text)


def refuse_torchrun_flags(opts) -> None:
    """What torchrun offers that this launcher does otherwise, or not."""
    refusals = [
        (
            opts.max_restarts not in (None, "0"),
            f"--max-restarts {opts.max_restarts}: deadpool-launch never restarts the job: a "
            "failed rank is replaced in place by a warm spare (--spare-nodes), or the job "
            "shrinks: drop it",
        ),
        (
            opts.rdzv_backend not in (None, "c10d"),
            f"--rdzv-backend {opts.rdzv_backend}: node 0 hosts the job's store (c10d): "
            "give c10d, or drop it",
        ),
        (
            any(v is not None for v in (opts.log_dir, opts.tee, opts.redirects)),
            "--log-dir, --tee and --redirects: deadpool-launch writes no per-rank log files; "
            "every rank's output comes through the launcher's (its logger's lines marked "
            "[rank N]): redirect that instead",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)


def use_rendezvous_endpoint(opts) -> None:
    """torchrun's --rdzv-endpoint HOST[:PORT] is node 0's address (port 29400
    by default, as torchrun's)."""
    if opts.rdzv_id is not None:
        print(
            f"deadpool-launch: --rdzv-id {opts.rdzv_id} has no effect here: each job has a "
            "store of its own (node 0's), signed with its secret",
            file=sys.stderr,
        )
    if opts.rdzv_endpoint is None:
        return
    endpoint = opts.rdzv_endpoint
    host, _, port = (
        endpoint.rpartition(":")
        if endpoint.rfind(":") > endpoint.rfind("]")
        else (endpoint, "", "")
    )
    opts.master_addr, opts.master_port = host.strip("[]"), int(port or 29400)


def check(opts) -> None:
    refuse_torchrun_flags(opts)
    use_rendezvous_endpoint(opts)
    if opts.nnodes < 1 or opts.nproc_per_node < 1 or opts.spare_nodes < 0:
        raise ConfigError("--nnodes and --nproc-per-node must be >= 1, --spare-nodes >= 0")
    if opts.join and (opts.standalone or not opts.master_port or opts.node_rank < 1):
        raise ConfigError(
            "--join: give the running job's --master-addr and "
            "--master-port, and --node-rank >= 1 (node 0 hosts the coordinator); "
            "not --standalone"
        )
    if opts.standby_addr and (opts.standalone or opts.nnodes + opts.spare_nodes < 3):
        raise ConfigError(
            "--standby-addr: a standby coordinator needs a multi-node run "
            "(not --standalone, whose launcher is no node) of at least 3 nodes in all "
            "(--nnodes + --spare-nodes): with 2 no single loss leaves a majority"
        )
    if not opts.standalone and not os.environ.get(SECRET_ENV):
        raise ConfigError(
            f"set {SECRET_ENV} to the same random string on "
            "every node (e.g. export DEADPOOL_SECRET=$(openssl rand -hex 32) "
            "in the sbatch script)"
        )


def checked_options(argv) -> argparse.Namespace:
    """The launcher's options, checked, with the coordinator's settings
    read from the script's --deadpool* flags; ConfigError says what to change."""
    opts = build_parser().parse_args(argv)
    check(opts)
    # As the workers will read them.
    opts.settings = coordinator_settings(opts.script_args, opts.nnodes + opts.spare_nodes)
    if not opts.standalone and not opts.master_port:
        raise ConfigError("give --master-port (or MASTER_PORT) on a multi-node run")
    return opts
