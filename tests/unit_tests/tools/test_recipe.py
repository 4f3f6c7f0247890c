"""tools/recipe.py, in-process: it prints a recipe's settings one a line by
the names examples/slurm/common.sh reads, and its flags on one line."""

from tools import recipe as recipe_cli
from tools.planning import recipes


def test_settings_are_printed_one_a_line_by_common_sh_names(capsys):
    assert recipe_cli.main(["llama-65b"]) == 0
    lines = dict(line.split(" ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["MODEL"] == "llama-65b"
    assert (lines["NODES"], lines["RANKS_PER_NODE"], lines["TP"], lines["PP"]) == (
        "128",
        "4",
        "4",
        "8",
    )
    assert lines["DATA_ARGS"] == "--mock-data --tokenizer-type NullTokenizer --vocab-size 31999"


def test_flags_are_printed_on_one_line(capsys):
    assert recipe_cli.main(["demo", "--flags"]) == 0
    assert capsys.readouterr().out.split() == recipes.DEMO.flags()
