"""Buddy mirroring (--deadpool) on real gloo processes.

For each topology, precision and mirror mode (state: the whole shard every
iteration; grad: the step's gradients, replayed by the buddy): a failure-free
run without the mirror is the reference; a run with the mirror
(tests/common/mirror_worker.py) dumps, at several iterations, every
rank's live optimizer state and the snapshot it holds for its owner, and
at iteration K throws its model and optimizer away, fetches each rank's
snapshot back from its buddy into freshly built (and perturbed) objects and
trains on. The buddy's copy must equal the owner's
state bit for bit; the curve (the redone iteration included) and the final
state must equal the reference's bit for bit.
"""

import pytest
import torch

from dist_utils import (
    TINY_GPT,
    assert_same_state,
    saved_args,
    checkpoint_state,
    corpus_run,
    curve,
    forkrun,
    read_metrics,
    run_pretrain,
)
from deadpool_ext.state import snapshot as snap
from deadpool_ext.topology import buddy_map, nodes_by_block
from deadpool_ext.events import read_events

# Every test here starts real processes.
pytestmark = pytest.mark.integration

ITERS = 7
RESTORE_AT = 5
DUMP_AT = (2, 3, 5)
TOPOLOGIES = {
    # name: (ranks, flags, ranks per node)
    "tp2pp2dp2": (
        8,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--use-tp-pp-dp-mapping",
        ],
        4,
    ),
    "dp4": (4, [], 1),
}
CASES = [
    (topology, precision, mode)
    for mode in ("state", "grad")
    for topology in ("tp2pp2dp2", "dp4")
    for precision in ("fp32", "bf16")
]


def base_args(topology, precision, corpus, directory):
    ranks, flags, _ = TOPOLOGIES[topology]
    return (
        TINY_GPT
        + flags
        + [
            "--use-distributed-optimizer",
            *corpus_run(directory, corpus, ITERS),
            "--save",
            str(directory / "ckpt"),
        ]
        + (["--bf16"] if precision == "bf16" else [])
    )


def deadpool_args(topology, directory, mode="state"):
    return [
        "--deadpool",
        "--deadpool-mirror-mode",
        mode,
        "--deadpool-ranks-per-node",
        str(TOPOLOGIES[topology][2]),
        "--deadpool-events",
        str(directory / "events.jsonl"),
    ]


def run_worker(nproc, args, timeout=300):
    proc = forkrun(nproc, args, timeout, script="tests/common/mirror_worker.py")
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_prefix):
    """Failure-free runs without the mirror, by (topology, precision), made
    when a case first asks (both modes share them)."""
    made = {}

    def reference(topology, precision):
        if (topology, precision) not in made:
            directory = tmp_path_factory.mktemp(f"reference-{topology}-{precision}")
            ranks = TOPOLOGIES[topology][0]
            run_pretrain(ranks, base_args(topology, precision, corpus_prefix, directory))
            made[topology, precision] = directory
        return made[topology, precision]

    return reference


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def case(request, tmp_path_factory, corpus_prefix, references):
    """Reference and mirrored runs of one (topology, precision, mode)."""
    topology, precision, mode = request.param
    ranks = TOPOLOGIES[topology][0]
    reference = references(topology, precision)
    mirrored = tmp_path_factory.mktemp(f"mirrored-{topology}-{precision}-{mode}")
    (mirrored / "dumps").mkdir()
    run_worker(
        ranks,
        base_args(topology, precision, corpus_prefix, mirrored)
        + deadpool_args(topology, mirrored, mode)
        + [
            "--dump-at",
            *map(str, DUMP_AT),
            "--dump-dir",
            str(mirrored / "dumps"),
            "--restore-at",
            str(RESTORE_AT),
        ],
    )
    return {
        "topology": topology,
        "precision": precision,
        "mode": mode,
        "ranks": ranks,
        "reference": reference,
        "mirrored": mirrored,
    }


def expected_buddies(case):
    ranks, flags, per_node = TOPOLOGIES[case["topology"]]
    tp = int(flags[1]) if flags else 1
    pp = int(flags[3]) if flags else 1
    return buddy_map(
        ranks, tp, pp, nodes_by_block(ranks, per_node), tp_pp_dp="--use-tp-pp-dp-mapping" in flags
    )


def load_dump(case, t, rank):
    return torch.load(case["mirrored"] / "dumps" / f"t{t}_rank{rank}.pt", weights_only=True)


def dump_layout(dump) -> snap.ShardLayout:
    return snap.ShardLayout([], dump["numel"], dump["sidecar_capacity"])


def test_buddy_holds_the_owners_state_bit_for_bit(case):
    buddies = expected_buddies(case)
    for t in DUMP_AT:
        for owner in range(case["ranks"]):
            mine = load_dump(case, t, owner)
            held = load_dump(case, t, buddies.buddy[owner])["held"]
            layout = dump_layout(mine)
            assert snap.verify(held, layout, iteration=t, owner=owner) == t
            regions = snap.regions(held, layout)
            side = snap.read_sidecar(held, layout)
            assert side["progress"]["iteration"] == t
            assert len(mine["live"]) == len(side["steps"]) > 0
            for entry, step in zip(mine["live"], side["steps"]):
                where = slice(entry["offset"], entry["offset"] + entry["numel"])
                for index, name in enumerate(snap.STATES):
                    assert torch.equal(regions[index][where], entry[name].float()), (
                        f"t={t} owner={owner} {name} differs"
                    )
                assert step == float(entry["step"]) == t


def test_held_copies_change_every_iteration(case):
    """The check above can fail: two iterations' snapshots differ."""
    a, b = (load_dump(case, t, 0)["held"] for t in DUMP_AT[:2])
    assert not torch.equal(a, b)


def test_a_corrupted_copy_is_detected(case):
    held = load_dump(case, DUMP_AT[0], 0)["held"]
    layout = dump_layout(load_dump(case, DUMP_AT[0], 0))
    snap.verify(held, layout)
    floats = snap.regions(held, layout)[1]  # one bit of one exp_avg value
    corrupted = held.clone()
    snap.regions(corrupted, layout)[1].view(torch.int32)[floats.numel() // 2] ^= 1 << 7
    with pytest.raises(snap.SnapshotError, match="checksum"):
        snap.verify(corrupted, layout)


def test_restored_snapshot_continues_the_curve_bit_for_bit(case):
    reference = curve(read_metrics(case["reference"] / "metrics.jsonl"))
    mirrored = curve(read_metrics(case["mirrored"] / "metrics.jsonl"))
    assert len(reference) == ITERS
    # The last snapshot before the restore is of iteration RESTORE_AT - 1: the
    # iteration after it is redone, and must come out the same.
    assert len(mirrored) == ITERS + 1
    assert mirrored[RESTORE_AT] == mirrored[RESTORE_AT - 1] == reference[RESTORE_AT - 1]
    assert mirrored[:RESTORE_AT] + mirrored[RESTORE_AT + 1 :] == reference
    final_reference = checkpoint_state(str(case["reference"] / "ckpt"))
    final_mirrored = checkpoint_state(str(case["mirrored"] / "ckpt"))
    assert saved_args(str(case["reference"] / "ckpt")).world_size == case["ranks"]
    assert_same_state(final_reference, final_mirrored)


def test_events_record_what_the_mirror_did(case):
    events = read_events(case["mirrored"] / "events.jsonl")
    ready = [e for e in events if e["event"] == "mirror_ready"]
    assert sorted(e["rank"] for e in ready) == list(range(case["ranks"]))
    buddies = expected_buddies(case)
    assert all(e["buddy"] == buddies.buddy[e["rank"]] for e in ready)
    snapshots = [e for e in events if e["event"] == "mirror_snapshot"]
    per_rank = {
        r: [e["iteration"] for e in snapshots if e["rank"] == r] for r in range(case["ranks"])
    }
    # 0..RESTORE_AT-1, then again from the restored RESTORE_AT-1, then the end.
    expected = list(range(RESTORE_AT)) + list(range(RESTORE_AT - 1, ITERS + 1))
    assert all(its == expected for its in per_rank.values()), per_rank
    assert not [e for e in events if e["event"] in ("mirror_failed", "mirror_diverged")]
    # grad mode: a whole snapshot at the start and after the restore, packets
    # otherwise, each one replayed to the owner's digest.
    starts = (0, RESTORE_AT)
    kinds = ["state" if i in starts else case["mode"] for i in range(len(expected))]
    for r in range(case["ranks"]):
        mine = [e for e in snapshots if e["rank"] == r]
        assert [e["sent"] for e in mine] == kinds
        assert [e["received"] for e in mine] == kinds
    sizes = {e["sent"]: e["bytes"] for e in snapshots}
    if case["mode"] == "grad":  # 4 bytes per element instead of 12 (up to the padding)
        numel = load_dump(case, DUMP_AT[0], 0)["numel"]
        assert abs(sizes["state"] - sizes["grad"] - 8 * numel) < snap.CHUNK_WORDS * 8


def test_pretrain_gpt_with_deadpool_trains_the_same_curve(case, tmp_path, corpus_prefix):
    """Through the user's entry point: the mirror changes nothing in training,
    the log line shows what is held, and the buddies end holding the last state."""
    if (case["topology"], case["precision"], case["mode"]) != ("dp4", "fp32", "state"):
        pytest.skip("one entry-point run is enough; the worker covers the rest")
    args = base_args("dp4", "fp32", corpus_prefix, tmp_path) + deadpool_args("dp4", tmp_path)
    # The mirror alone: the reference, without --deadpool, draws dropout from
    # each rank's streams (--deadpool-sample-rng would seed them by sample).
    args += ["--no-deadpool-sample-rng"]
    stdout = run_pretrain(case["ranks"], args)
    assert curve(read_metrics(tmp_path / "metrics.jsonl")) == curve(
        read_metrics(case["reference"] / "metrics.jsonl")
    )
    final_reference = checkpoint_state(str(case["reference"] / "ckpt"))
    assert_same_state(final_reference, checkpoint_state(str(tmp_path / "ckpt")))
    assert f"iteration        {ITERS}/       {ITERS} |" in stdout
    assert f"mirror held: {ITERS - 1} |" in stdout
    done = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "mirror_done"]
    assert sorted(e["rank"] for e in done) == list(range(4))
    assert all(e["held"] == ITERS for e in done)


CORRUPT_AT, CORRUPT_RANK = 3, 0


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory, corpus_prefix, references):
    """grad mode, DP=4: rank 0's packet at the start of iteration 3 carries a
    flipped bit; dumps before and after."""
    directory = tmp_path_factory.mktemp("corrupted-packet")
    (directory / "dumps").mkdir()
    run_worker(
        4,
        base_args("dp4", "fp32", corpus_prefix, directory)
        + deadpool_args("dp4", directory, "grad")
        + ["--dump-at", "2", "6", "--dump-dir", str(directory / "dumps")]
        + ["--corrupt-packet-at", str(CORRUPT_AT), str(CORRUPT_RANK)],
    )
    return {
        "topology": "dp4",
        "ranks": 4,
        "mirrored": directory,
        "reference": references("dp4", "fp32"),
    }


def test_a_diverged_replica_is_caught_and_sent_again_whole(corrupted):
    events = read_events(corrupted["mirrored"] / "events.jsonl")
    buddy = expected_buddies(corrupted).buddy[CORRUPT_RANK]
    diverged = [e for e in events if e["event"] == "mirror_diverged"]
    assert [(e["rank"], e["owner"], e["iteration"]) for e in diverged] == [
        (buddy, CORRUPT_RANK, CORRUPT_AT)
    ]
    assert "digest" in diverged[0]["error"]
    resync = [e for e in events if e["event"] == "mirror_resync"]
    assert [(e["rank"], e["buddy"], e["iteration"]) for e in resync] == [
        (CORRUPT_RANK, buddy, CORRUPT_AT)
    ]
    snapshots = [e for e in events if e["event"] == "mirror_snapshot"]
    sent = [e["sent"] for e in snapshots if e["rank"] == CORRUPT_RANK]
    received = [e["received"] for e in snapshots if e["rank"] == buddy]
    # whole at the start, packets, whole again right after the mismatch
    expected = ["state"] + ["grad"] * CORRUPT_AT + ["state"] + ["grad"] * (ITERS - CORRUPT_AT - 1)
    assert sent == received == expected
    # the replica matches its owner again, bit for bit; training never noticed
    mine, held = load_dump(corrupted, 6, CORRUPT_RANK), load_dump(corrupted, 6, buddy)["held"]
    layout = dump_layout(mine)
    assert snap.verify(held, layout, iteration=6, owner=CORRUPT_RANK) == 6
    regions = snap.regions(held, layout)
    for entry in mine["live"]:
        where = slice(entry["offset"], entry["offset"] + entry["numel"])
        for index, name in enumerate(snap.STATES):
            assert torch.equal(regions[index][where], entry[name].float())
    reference = curve(read_metrics(corrupted["reference"] / "metrics.jsonl"))
    assert curve(read_metrics(corrupted["mirrored"] / "metrics.jsonl")) == reference
