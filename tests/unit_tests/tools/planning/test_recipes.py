"""The training recipes (tools/planning/recipes.py), in-process: each
recipe's flags, read back by pretrain_gpt.py's parser, are its shape and
layout; the demo recipe is make demo's model on two nodes of four. The
sbatch scripts' dry runs, which parse the same flags as the job does, are
in tests/functional_tests/test_slurm_scripts.py."""

import dataclasses

import pytest

from tools.planning import recipes, slurm
from tools.slurm_plan import parse_training


MOCK_DATA = ("--mock-data", "--tokenizer-type", "ByteLevelTokenizer")


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_flags_parse_back_to_the_recipes_shape_and_layout(name):
    r = recipes.RECIPES[name]
    # The demo reads make data's corpus, which a clean clone lacks; the shape
    # and layout do not depend on the data.
    r = dataclasses.replace(r, data=MOCK_DATA) if "--data-path" in r.data else r
    # What common.sh adds: the mapping (make demo too) and, on GPUs with TP > 1,
    # sequence parallelism.
    flags = r.flags() + ["--use-tp-pp-dp-mapping"]
    flags += ["--sequence-parallel"] if r.model is not None and r.layout.tp > 1 else []
    config, _ = parse_training(flags, r.layout.world, r.ranks_per_node, r.model is not None)
    shape = slurm.model_shape(config, r.shape.name)
    assert slurm.comparable(shape) == slurm.comparable(r.shape)
    got, want = slurm.parallel_of(config), r.layout
    layout = (
        "tp",
        "pp",
        "dp",
        "micro_batch",
        "global_batch",
        "sequence_parallel",
        "ep",
        "expert_tp",
    )
    assert [getattr(got, k) for k in layout] == [getattr(want, k) for k in layout]
    assert config.training.train_iters == r.train_iters


def test_the_demo_recipe_is_make_demos_model_on_two_nodes_of_four():
    demo = recipes.RECIPES["demo"]
    assert demo is recipes.DEMO and demo.model is None
    assert (demo.nodes, demo.ranks_per_node, demo.layout.world) == (2, 4, 8)
