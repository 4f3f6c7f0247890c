"""The Slurm planner (tools/planning/slurm.py), in-process: it knows the GPT-2
vocabulary's size without building the tokenizer."""

from tests.unit_tests.training.test_tokenizer import build, corpus, fields  # noqa: F401  (a fixture)


def test_the_slurm_planner_knows_the_gpt2_vocabulary_without_building_it(corpus):  # noqa: F811
    from tools.planning.slurm import vocabulary
    from megatron.training.arguments import parse_args

    _, vocabularies, _ = corpus
    files = fields("GPT2BPETokenizer", vocabularies)
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
    argv += ["--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1"]
    argv += [
        "--mock-data",
        "--vocab-file",
        files["vocab_file"],
        "--merge-file",
        files["merge_file"],
    ]
    config = parse_args(argv, world_size=1)
    assert vocabulary(config) == build("GPT2BPETokenizer", vocabularies).vocab_size
