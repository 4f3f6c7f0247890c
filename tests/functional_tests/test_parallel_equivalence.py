"""TP, PP and DP compute the same model as one process (real processes,
gloo). --layout-invariant-init gives every layout the same initial weights."""

import re

import pytest

from dist_utils import TINY_GPT, read_metrics, run_pretrain

# Every test here starts real processes.
pytestmark = pytest.mark.integration

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--layout-invariant-init"]
NO_DROPOUT += ["--log-params-norm"]  # each parameter once, whatever the layout


def run_two_iterations(directory, name, nproc, layout, corpus):
    metrics = directory / f"{name}.jsonl"
    output = run_pretrain(
        nproc,
        TINY_GPT
        + NO_DROPOUT
        + layout
        + [
            "--global-batch-size",
            "4",
            "--train-iters",
            "2",
            "--lr-warmup-iters",
            "0",
            "--data-path",
            corpus,
            "--metrics-file",
            str(metrics),
        ],
    )
    # SDPA where asked for, and for context parallelism and multi-latent
    # attention (megatron-core's has neither).
    sdpa = any(
        flag in layout
        for flag in ("--attention-backend", "--context-parallel-size", "--multi-latent-attention")
    )
    assert ("core attention: TorchSdpaAttention" in output) == sdpa
    cp = layout[layout.index("--context-parallel-size") + 1] if sdpa and "cp" in name else "1"
    assert f"context-parallel size: {cp}," in output
    if "--decoder-first-pipeline-num-layers" in layout or "Ett|t|t|L" in layout:
        # Megatron-LM's parameter count per stage: the first holds 3 layers
        # and the embedding, the last 1 layer and the final norm.
        counts = dict(re.findall(r"model parallel rank \(0, (\d)\): (\d+)", output))
        assert int(counts["0"]) > 2 * int(counts["1"]), counts
    return [(m["lm_loss"], m["grad_norm"], m["params_norm"]) for m in read_metrics(metrics)]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, corpus_prefix):
    return run_two_iterations(tmp_path_factory.mktemp("single"), "single", 1, [], corpus_prefix)


@pytest.mark.parametrize(
    "name,nproc,layout",
    [
        ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
        ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
        # The interleaved schedule: chunks of one layer, virtual stages 0-3.
        (
            "pp2-interleaved",
            2,
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        ),
        # Uneven stages: 3 layers on the first, 1 on the last.
        (
            "pp2-uneven",
            2,
            ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"],
        ),
        # The embedding and the loss counted as layers, one per virtual
        # stage: the first chunk holds only the embedding, the last only
        # the output layer and loss.
        (
            "pp2-account-interleaved",
            2,
            ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"]
            + ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
        ),
        # The layers placed by a layout string: two virtual stages per rank
        # (the interleaved schedule), 2 + 1 + 1 layers, the loss alone in
        # the last chunk.
        (
            "pp2-layout",
            2,
            ["--pipeline-model-parallel-size", "2"]
            + ["--pipeline-model-parallel-layout", "Ett|t|t|L"],
        ),
        ("dp2", 2, ["--use-distributed-optimizer"]),
        # Gradient reduce-scatters started during the backward, all-gathers
        # in the forward, the first chunk's from the optimizer's step.
        (
            "pp2-interleaved-dp2-overlapped",
            4,
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
            + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
            + ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"]
            + ["--micro-batch-size", "1"],
        ),
        # Two distributed optimizers, each sharded over 2 of the 4 replicas.
        (
            "dp4-two-optimizers",
            4,
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
            + ["--micro-batch-size", "1"],
        ),
        # Context parallelism: each rank holds two chunks of every sequence
        # and attends to the keys and values gathered from the other.
        ("cp2", 2, ["--context-parallel-size", "2"]),
        ("cp2-dp2", 4, ["--context-parallel-size", "2", "--use-distributed-optimizer"]),
        # torch's SDPA (math kernel) as the core attention: the same model.
        ("tp2-sdpa", 2, ["--tensor-model-parallel-size", "2", "--attention-backend", "unfused"]),
    ],
)
def test_layout_matches_single_process(
    tmp_path, corpus_prefix, single_process, name, nproc, layout
):
    parallel = run_two_iterations(tmp_path, name, nproc, layout, corpus_prefix)
    (loss1, norm1, params1), (lossp, normp, paramsp) = single_process[0], parallel[0]
    # Same weights and data: only the order of fp32 reductions differs, so
    # agreement to a few ulps of fp32 (~1e-7 relative) is expected.
    assert lossp == pytest.approx(loss1, rel=2e-6, abs=0)
    assert normp == pytest.approx(norm1, rel=2e-5, abs=0)
    # The step taken from there lands in the same place.
    assert parallel[1][0] == pytest.approx(single_process[1][0], rel=2e-5, abs=0)
    # --log-params-norm counts each parameter once: tensor-parallel shards
    # summed, the tied output embedding of the last stage left out. With
    # --overlap-param-gather it is read (as in Megatron-LM) before the
    # all-gather the next forward starts: the other replicas' shards of the
    # weights are still those before the step.
    if "--overlap-param-gather" not in layout:
        assert paramsp == pytest.approx(params1, rel=2e-6, abs=0)


def test_parallel_runs_are_not_trivially_equal(single_process):
    """Guard against a vacuous pass: the two iterations really differ (the
    params norm by more than its tolerance: a step moves the weights)."""
    assert single_process[0][0] != single_process[1][0]
    first, second = single_process[0][2], single_process[1][2]
    assert abs(second - first) > 2e-6 * first


MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16"]
MLA += ["--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]


def test_multi_latent_attention_at_tp2_pp2_matches_single_process(
    tmp_path, corpus_prefix, single_process
):
    """MLA (low-rank queries, keys and values, values of another head size:
    torch's SDPA as the core attention on a CPU) computes one model at
    TP2·PP2 as in one process; a model other than the plain one."""
    single = run_two_iterations(tmp_path, "mla-single", 1, MLA, corpus_prefix)
    split = run_two_iterations(
        tmp_path,
        "mla-tp2-pp2",
        4,
        MLA + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        corpus_prefix,
    )
    assert split[0][0] == pytest.approx(single[0][0], rel=2e-6, abs=0)
    assert split[0][1] == pytest.approx(single[0][1], rel=2e-5, abs=0)
    assert split[1][0] == pytest.approx(single[1][0], rel=2e-5, abs=0)
    assert split[0][2] == pytest.approx(single[0][2], rel=2e-6, abs=0)
    assert abs(single[0][0] - single_process[0][0]) > 1e-3
