"""The checks of the data (megatron/training/flags/data.py), parsed
in-process (a ConfigError whose message names the flag to change, or a
warning): the dataset's files and split, the tokenizer's type and files,
the index cache, and --fim-data's flags."""

import os

import pytest

from megatron.training.arguments import ConfigError, parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, _write_dataset, argv
from tests.unit_tests.training.test_fim import flags


def test_tokenizer_defaults_to_gpt2_bpe_as_megatron_lm(tmp_path):
    """Megatron-LM's pretrain_gpt.py default; it reads GPT-2's vocab.json and
    merges.txt, and says so before anything starts when they are not given."""
    _names_all(_config_error(argv(drop=("--tokenizer-type",))), "GPT2BPETokenizer", "--vocab-file")
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("{}")
    files = [
        "--vocab-file",
        str(tmp_path / "vocab.json"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
    ]
    config = parse_args(argv(*files, drop=("--tokenizer-type",)), world_size=1)
    assert config.tokenizer.tokenizer_type == "GPT2BPETokenizer"


def test_the_legacy_tokenizer_is_taken_where_it_gives_the_same_ids(tmp_path, capsys):
    """--legacy-tokenizer (one of Megatron-LM's release configs): with GPT-2
    BPE the ids are the same (measured), so it is taken with a warning;
    with another type it is refused by name."""
    files = [tmp_path / "vocab.json", tmp_path / "merges.txt"]
    for f in files:
        f.write_text("")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(files[0])]
    gpt2 += ["--merge-file", str(files[1]), "--legacy-tokenizer"]
    config = parse_args(argv(*gpt2, drop=("--tokenizer-type",)), world_size=1)
    assert config.tokenizer.legacy_tokenizer
    _names_all(capsys.readouterr().out, "WARNING:", "--legacy-tokenizer has no effect")
    _names_all(_config_error(argv("--legacy-tokenizer")), "--legacy-tokenizer", "ByteLevel")


def test_no_data():
    message = _config_error(argv(drop=("--mock-data",)))
    _names_all(message, "--data-path", "--mock-data")


def test_data_path_without_files(tmp_path):
    prefix = str(tmp_path / "missing_text_document")
    message = _config_error(argv("--data-path", prefix, drop=("--mock-data",)))
    _names_all(message, "--data-path", prefix)


def test_data_path_with_only_bin(tmp_path, tiny_prefix):
    prefix = str(tmp_path / "half")
    with open(tiny_prefix + ".bin", "rb") as src, open(prefix + ".bin", "wb") as dst:
        dst.write(src.read())
    message = _config_error(argv("--data-path", prefix, drop=("--mock-data",)))
    _names_all(message, "--data-path", prefix + ".idx")


def test_blended_data_path_checks_every_prefix(tmp_path, tiny_prefix):
    missing = str(tmp_path / "other")
    message = _config_error(
        argv(
            "--data-path",
            "0.5",
            tiny_prefix,
            "0.5",
            missing,
            "--split",
            "1,1,1",
            drop=("--mock-data",),
        )
    )
    _names_all(message, "--data-path", missing)


def test_a_megatron_lm_tokenizer_type_refused_here_says_why():
    message = _config_error(argv("--tokenizer-type", "BertWordPieceCase"))
    _names_all(message, "--tokenizer-type", "BertWordPieceCase", "pretrain_gpt.py trains GPT")


def test_null_tokenizer_without_vocab_size():
    message = _config_error(argv("--tokenizer-type", "NullTokenizer"))
    _names_all(message, "--vocab-size")


def test_split_leaving_valid_split_without_document(tiny_prefix):
    args = argv("--data-path", tiny_prefix, "--split", "98,1,1", drop=("--mock-data",))
    # 3 documents: the valid share (1%) rounds to no document, and validation runs.
    message = _config_error(args)
    _names_all(message, "--split", "--eval-iters", "valid")
    # Without validation the valid split is never built: the same split is fine.
    config = parse_args(args + ["--eval-iters", "0"], world_size=1)
    assert config.data.data_path == [tiny_prefix]
    # A split that gives every used split a document is fine too.
    parse_args(
        argv("--data-path", tiny_prefix, "--split", "1,1,1", drop=("--mock-data",)), world_size=1
    )


def test_split_leaving_train_split_without_document(tiny_prefix):
    message = _config_error(
        argv("--data-path", tiny_prefix, "--split", "1,98,1", drop=("--mock-data",))
    )
    _names_all(message, "--split", "train")


class _RunsCode:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize("where", ["default", "--data-cache-path"])
def test_a_planted_file_in_the_dataset_index_cache_is_refused_before_loading(where, tmp_path):
    """megatron-core loads its index cache with allow_pickle=True: a pickle
    (or an object array) under an index file's name would run code in every
    rank (../shared/reliability-probes/npy_pickle.py)."""
    import pickle

    import numpy

    prefix = _write_dataset(tmp_path, [f"document {i}" for i in range(30)])
    args = argv("--data-path", prefix, "--split", "1,1,1", drop=("--mock-data",))
    cache = os.path.join(prefix, "cache", "GPTDataset_indices")
    if where != "default":
        cache = str(tmp_path / "cache")
        args += ["--data-cache-path", cache]
    os.makedirs(cache)
    numpy.save(os.path.join(cache, "abc-document_index.npy"), numpy.arange(5))
    parse_args(args, world_size=1)  # a plain array is what megatron-core writes
    planted = os.path.join(cache, "abc-shuffle_index.npy")
    with open(planted, "wb") as f:
        pickle.dump(_RunsCode(), f)
    _names_all(_config_error(args), planted, "not a plain numpy array")
    numpy.save(planted, numpy.array([_RunsCode()], dtype=object), allow_pickle=True)
    _names_all(_config_error(args), planted)


def parse_fim(corpus_prefix, tmp_path, *extra):
    return parse_args(flags(corpus_prefix, tmp_path, *extra), world_size=1)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--fim-data", "--fim-rate", "0"], "--fim-rate 0.0 must be in (0, 1]"),
        (["--fim-data", "--fim-spm-rate", "1.5"], "--fim-spm-rate 1.5 must be in (0, 1]"),
        (["--fim-data", "--fim-split-sample", "x"], "give it"),
        (["--fim-data", "--fim-split-sample", "x", "--fim-fragment-rate", "2"], "in [0, 1]"),
        (["--fim-data", "--tokenizer-type", "ByteLevelTokenizer"], "has none: use one of"),
        (["--fim-data", "--legacy-tokenizer"], "Megatron-LM refuses it with --legacy-tokenizer"),
    ],
)
def test_fim_flags_are_checked_before_anything_starts(corpus_prefix, tmp_path, extra, says):
    with pytest.raises(ConfigError) as error:
        parse_fim(corpus_prefix, tmp_path, *extra)
    assert says in str(error.value)


def test_fim_data_refuses_mock_data(corpus_prefix, tmp_path):
    args = [a for a in flags(corpus_prefix, tmp_path) if "corpus_gpt2" not in a]
    args.remove("--data-path")
    with pytest.raises(ConfigError, match="drop --mock-data"):
        parse_args(args + ["--mock-data", "--fim-data"], world_size=1)


def test_fim_flags_without_fim_data_are_ignored_with_a_warning(corpus_prefix, tmp_path, capsys):
    parse_fim(corpus_prefix, tmp_path, "--fim-rate", "0.3", "--fim-pad-token", "<pad>")
    assert (
        "--fim-rate, --fim-pad-token have no effect without --fim-data" in capsys.readouterr().out
    )
