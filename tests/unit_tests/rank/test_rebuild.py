"""A resized job's world (deadpool_ext/rank/rebuild.py), in-process: the
config a survivor of a shrink or a grow trains on."""

from deadpool_ext.config import DeadpoolConfig
from deadpool_ext.rank.rebuild import world_config
from megatron.training.arguments import parse_args


def test_a_resized_world_config_keeps_the_launched_size_and_leaves_the_old_one_alone():
    config = parse_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
        + ["--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10"]
        + ["--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer"]
        + ["--vocab-size", "100", "--deadpool", "--use-distributed-optimizer"],
        extra_sections={"deadpool": DeadpoolConfig},
        world_size=8,
    )
    assert world_config(config, None) is config
    shrunk = world_config(config, {"size": 6, "nodes": ["node0"] * 4 + ["node2"] * 2})
    assert (shrunk.world_size, shrunk.planned_world_size) == (6, 8)
    assert shrunk.world.rank_nodes == ["node0"] * 4 + ["node2"] * 2
    assert shrunk.section(DeadpoolConfig).deadpool_allow_same_node_buddy
    shrunk.run.padded_vocab_size = 128  # its trainer's, not the old world's
    assert config.run.padded_vocab_size is None and config.world.rank_nodes is None
    assert not config.section(DeadpoolConfig).deadpool_allow_same_node_buddy
    again = world_config(shrunk, {"size": 4, "nodes": ["node0"] * 4})
    assert (again.world_size, again.planned_world_size) == (4, 8)
