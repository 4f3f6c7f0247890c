"""Checks of the data: the dataset's files and split, the tokenizer,
fill-in-the-middle, and the splits and index caches megatron-core's
datasets would build."""

import dataclasses
import os
from typing import List

from megatron.training.config import Config, DataConfig, split_numbers
from megatron.training.flags import host
from megatron.training.flags.refusal import ConfigError, flag_name, ignored_without, require, warn


def check(config: Config) -> None:
    from megatron.training.tokenizer import check_tokenizer, unused_tokenizer_flags

    d = config.data
    require(
        d.mock_data or d.data_path,
        "no training data: give --data-path PREFIX (made by tools/preprocess_data.py; "
        "`make data` prepares the embedded corpus) or --mock-data",
    )
    require(not (d.mock_data and d.data_path), "give only one of --data-path and --mock-data")
    parts = split_numbers(d.split)
    require(
        all(p.replace(".", "", 1).isdigit() for p in parts)
        and 0 < len(parts) <= 3
        and sum(float(p) for p in parts) > 0,
        f"--split {d.split!r} must be up to three non-negative numbers like 969,30,1",
    )
    for prefix in _data_prefixes(d.data_path or []):
        for suffix in (".bin", ".idx"):
            require(
                os.path.exists(prefix + suffix),
                f"--data-path {prefix}: {prefix + suffix} does not exist; run "
                f"tools/preprocess_data.py (or `make data` for the embedded corpus)",
            )
    try:
        check_tokenizer(config.tokenizer)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.tokenizer.legacy_tokenizer:
        warn(
            "--legacy-tokenizer has no effect here: megatron-core's "
            f"{config.tokenizer.tokenizer_type} gives the ids Megatron-LM's legacy class gives"
        )
    for flag, kinds in unused_tokenizer_flags(config.tokenizer):
        warn(
            f"{flag} has no effect: --tokenizer-type {config.tokenizer.tokenizer_type} does "
            f"not read it, only {', '.join(kinds)} (Megatron-LM ignores it too)"
        )
    require(d.num_workers >= 0, "--num-workers must be >= 0")
    _check_fim(config)


def _check_fim(config: Config) -> None:
    """--fim-data as Megatron-LM checks it, and what its dataset would only
    meet later (a rate out of range, fragments without their rate)."""
    from megatron.training.tokenizer import FIM_TOKENIZER_TYPES

    d, kind = config.data, config.tokenizer.tokenizer_type
    defaults = DataConfig()
    ignored_without(
        "--fim-data",
        d.fim_data,
        [
            (flag_name(f), getattr(d, f.name) != getattr(defaults, f.name))
            for f in dataclasses.fields(DataConfig)
            if f.name.startswith("fim_") and f.name != "fim_data"
        ],
    )
    if not d.fim_data:
        return
    require(not d.mock_data, "--fim-data reorders the text of --data-path: drop --mock-data")
    require(
        not config.tokenizer.legacy_tokenizer,
        "--fim-data: Megatron-LM refuses it with --legacy-tokenizer: drop one",
    )
    require(
        kind in FIM_TOKENIZER_TYPES,
        f"--fim-data looks its tokens up in the vocabulary, and --tokenizer-type {kind} has "
        f"none: use one of {', '.join(FIM_TOKENIZER_TYPES)}",
    )
    for flag, rate in (("--fim-rate", d.fim_rate), ("--fim-spm-rate", d.fim_spm_rate)):
        # Megatron-LM asserts the rate is given: 0 is refused there as well.
        require(0 < rate <= 1, f"{flag} {rate} must be in (0, 1]")
    require(
        d.fim_split_sample is None or d.fim_fragment_rate is not None,
        "--fim-split-sample reorders fragments with --fim-fragment-rate: give it",
    )
    ignored_without(
        "--fim-split-sample",
        d.fim_split_sample is not None,
        [("--fim-fragment-rate", d.fim_fragment_rate is not None)],
    )
    require(
        d.fim_split_sample is None or 0 <= d.fim_fragment_rate <= 1,
        f"--fim-fragment-rate {d.fim_fragment_rate} must be in [0, 1]",
    )


def check_index(config: Config) -> None:
    """The splits and index caches megatron-core's datasets would build."""
    data = host.import_with_megatron_core("megatron.training.data")
    try:
        if config.data.data_path:
            data.check_splits(config)
        for directory in data.index_cache_dirs(config):
            data.check_index_cache(directory)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _data_prefixes(data_path: List[str]) -> List[str]:
    """Prefixes of '--data-path P' or '--data-path W1 P1 W2 P2'."""
    if len(data_path) <= 1:
        return list(data_path)
    if len(data_path) % 2 == 0 and all(_is_number(w) for w in data_path[0::2]):
        return list(data_path[1::2])
    return list(data_path)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
