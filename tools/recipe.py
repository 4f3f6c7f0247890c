"""Print a training recipe of tools/planning/recipes.py.

    python -m tools.recipe llama-65b          # examples/slurm/common.sh's settings
    python -m tools.recipe demo --flags       # the recipe as pretrain_gpt.py flags (make demo)

The settings are one line each, a name of examples/slurm/common.sh and its
value; the settings named *_ARGS are flag arrays, their words separated by
spaces. Needs no torch: the Makefile runs it with any python3.
"""

import argparse
import sys
from typing import List, Tuple

from tools.planning.recipes import RECIPES, Recipe


def settings(recipe: Recipe) -> List[Tuple[str, List[str]]]:
    """The recipe by examples/slurm/common.sh's names, in its words."""
    lay = recipe.layout
    model = [("MODEL", [recipe.model])] if recipe.model else []
    return model + [
        ("NODES", [str(recipe.nodes)]),
        ("RANKS_PER_NODE", [str(recipe.ranks_per_node)]),
        ("TP", [str(lay.tp)]),
        ("PP", [str(lay.pp)]),
        ("MICRO_BATCH", [str(lay.micro_batch)]),
        ("GLOBAL_BATCH", [str(lay.global_batch)]),
        ("TRAIN_ITERS", [str(recipe.train_iters)]),
        ("MODEL_ARGS", recipe.model_args()),
        ("TRAIN_ARGS", [*recipe.schedule, *recipe.logging]),
        ("DATA_ARGS", list(recipe.data)),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--flags", action="store_true", help="The recipe as one line of flags.")
    opts = parser.parse_args(argv)
    recipe = RECIPES[opts.recipe]
    if opts.flags:
        print(" ".join(recipe.flags()))
    else:
        print("\n".join(" ".join([name, *words]) for name, words in settings(recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
