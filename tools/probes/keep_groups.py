"""Can a hot swap keep the groups it did not break? What torch 2.13's gloo
allows, with nothing of ours but the registry helpers partial rebuild uses
(``rank.regroup.set_aside`` and ``put_back``; issue 22, docs/scale.md
section 3).

``--ranks`` gloo processes make a default group and every pair of
neighbours {r, r+1} as a group. Then rank ``--replace`` exits and a new
process takes its rank. The survivors take every group without it out of
torch's registry, destroy the default group (which destroys the rest),
make the next generation's default group under a new store prefix, put
the kept groups back and make the others again: every rank calls
``new_group`` for every group that is not kept, in the same order, as
megatron-core does. Checked: each group's all-reduce gives its members'
sum, kept or made again, and a kept group is the same object.

Then what tells a kept group is safe to use (no member has an operation
on it that another member has not): gloo's per-group sequence number,
which counts the collectives and the sends and receives a member issued.
Two members agree after matching operations and disagree after a send
that was never received.

    python -m tools.probes.keep_groups --ranks 8 --replace 3

Prints one line per rank and "kept groups work" when every check passed;
exits 1 otherwise.
"""

import argparse
import datetime
import functools
import os
import sys
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
from deadpool_ext.control.ports import free_port
from deadpool_ext.control.zygote import ForkedProcess
from deadpool_ext.rank import regroup


def pairs(world: int) -> list:
    return [(r, r + 1) for r in range(world - 1)]


def open_store(port: int, master: bool):
    return dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        master,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
    )


def open_world(store, gen: int, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"gen{gen}/", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )


def check_groups(groups: dict, rank: int) -> list:
    """Every group this rank is in all-reduces its members' ranks and
    answers torch's questions megatron-core asks (its ranks, this rank's
    place), which only a registered group can."""
    wrong = []
    for ranks, group in groups.items():
        if rank in ranks:
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            try:
                registered = dist.get_process_group_ranks(group) == list(ranks)
                registered &= dist.get_rank(group) == ranks.index(rank)
            except (ValueError, RuntimeError):
                registered = False
            if value.item() != float(sum(ranks)) or not registered:
                wrong.append(ranks)
    return wrong


def worker(args, rank: int, fresh: bool) -> Optional[int]:
    world = args.ranks
    store = open_store(args.port, master=False)
    kept, wrong_before, aside = {}, [], None
    if not fresh:
        open_world(store, 0, rank, world)
        groups = {p: dist.new_group(list(p)) for p in pairs(world)}
        wrong_before = check_groups(groups, rank)
        if rank == args.replace:  # lost: leaves without a word to its groups
            store.set(f"gone/{rank}", "x")
            return None
        kept = {p: groups[p] for p in groups if args.replace not in p and rank in p}
        aside = regroup.set_aside(kept.values())
        seqs = {p: g._get_sequence_number_for_group() for p, g in kept.items()}
        groups = {}  # the others go with the default group
        dist.destroy_process_group()
        store.set(f"left/{rank}", "x")
    store.wait([f"left/{r}" for r in range(world) if r != args.replace])
    open_world(store, 1, rank, world)
    keep = [p for p in pairs(world) if args.replace not in p]  # every rank knows the set
    regroup.put_back(aside, 1)
    made = {p: dist.new_group(list(p)) for p in pairs(world) if p not in keep}
    current = {**made, **kept}
    wrong = check_groups(current, rank)
    same = all(current[p] is kept[p] for p in kept)
    after = {p: g._get_sequence_number_for_group() for p, g in kept.items()}
    counted = all(after[p] == seqs[p] + 1 for p in kept) if not fresh else True
    ok = not wrong_before and not wrong and same and counted
    print(
        f"rank {rank}{' (new)' if fresh else ''}: kept {sorted(kept)}, made again "
        f"{sorted(p for p in made if rank in p)}, all-reduces {'right' if not wrong else wrong}, "
        f"sequence numbers {'counted' if counted else 'off'}",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def sequence_probe(args, rank: int) -> int:
    """Two ranks: the counts after matching and unmatched operations."""
    store = open_store(args.port, master=rank == 0)
    open_world(store, 0, rank, 2)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)
    tensor = torch.zeros(1)
    if rank == 0:
        dist.send(tensor, 1, group=group)
    else:
        dist.recv(tensor, 0, group=group)
    counts = torch.tensor([float(group._get_sequence_number_for_group())])
    if rank == 0:
        dist.isend(tensor, 1, group=group)  # never received
    counts = torch.cat([counts, torch.tensor([float(group._get_sequence_number_for_group())])])
    everyone = [torch.zeros(2), torch.zeros(2)]
    dist.all_gather(everyone, counts)
    matched = everyone[0][0] == everyone[1][0]
    unmatched = everyone[0][1] != everyone[1][1]
    if rank == 0:
        print(
            f"sequence numbers after matching operations {everyone[0][0]:.0f} and "
            f"{everyone[1][0]:.0f}, after an unreceived send {everyone[0][1]:.0f} and "
            f"{everyone[1][1]:.0f}",
            flush=True,
        )
    return 0 if matched and unmatched else 1


def forked(call: Callable[[], Optional[int]]) -> ForkedProcess:
    """``call`` in a new process forked from this one, which has imported
    torch already (a rank made by Popen paid seconds for it). A rank
    leaves at once, groups and all, as a lost one does: torch's teardown at
    exit would wait on the unreceived send."""
    pid = os.fork()
    if pid:
        return ForkedProcess(pid)
    code = 1
    try:
        code = call() or 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(args) -> bool:
    """The replacement, then the sequence probe; True when all passed. Every
    rank is forked before this process opens the store (and its thread):
    the new one waits on the store until the survivors have left, the two
    of the sequence probe use a store of their own."""
    world, probe = free_port(), argparse.Namespace(**{**vars(args), "port": free_port()})
    args = argparse.Namespace(**{**vars(args), "port": world})
    ranks = [forked(functools.partial(worker, args, r, False)) for r in range(args.ranks)]
    ranks.append(forked(functools.partial(worker, args, args.replace, True)))
    ranks += [forked(functools.partial(sequence_probe, probe, r)) for r in (0, 1)]
    _store = open_store(world, master=True)  # the ranks' store, open until they end
    return not any([process.wait(timeout=120) for process in ranks])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--replace", type=int, default=3)
    args = parser.parse_args()
    if not 0 <= args.replace < args.ranks or args.ranks < 2:
        parser.error("--ranks must be 2 or more and --replace one of its ranks")
    ok = run(args)
    print("kept groups work" if ok else "kept groups FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
