"""Megatron-LM's --tokenizer-type names, built offline from local files.

Each type is the tokenizer Megatron-LM builds for that name, with the same
token ids, vocabulary size and end-of-document id:
- HuggingFaceTokenizer, the SentencePiece types, TikTokenizer and
  NullTokenizer are megatron-core's own classes (Megatron-LM's default path);
- GPT2BPETokenizer is GPT-2's byte-level BPE of the ``tokenizers`` package
  (the Rust implementation behind Hugging Face's GPT2TokenizerFast).
  megatron-core's class for it asks the Hugging Face hub for "gpt2", and
  Megatron-LM's legacy one is a hand-written BPE; both read the same
  vocab.json and merges.txt and give the same ids;
- ByteLevelTokenizer is ours (no files: 256 bytes, ids up to 512).

``check_tokenizer`` is cheap (no tokenizer library is imported) so it runs
while parsing arguments, before any process group exists.
"""

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import sys
from typing import List, Sequence, Tuple

from megatron.training.config import TokenizerConfig

# Megatron-LM's default in its pretrain_gpt.py.
DEFAULT_TOKENIZER_TYPE = "GPT2BPETokenizer"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# megatron-core's TikTokenTokenizer default for --vocab-size.
TIKTOKEN_DEFAULT_VOCAB = 2**17

# type -> (python module, pip package) the type needs.
_MODULE = {
    "GPT2BPETokenizer": ("tokenizers", "tokenizers"),
    "HuggingFaceTokenizer": ("transformers", "transformers"),
    "TikTokenizer": ("tiktoken", "tiktoken"),
    **{name: ("sentencepiece", "sentencepiece") for name in SENTENCEPIECE_TYPES},
}
# Megatron-LM's names that this build refuses, and why.
REFUSED = {
    "BertWordPieceLowerCase": "BERT's WordPiece vocabularies go with BERT models, and "
    "pretrain_gpt.py trains GPT",
    "BertWordPieceCase": "BERT's WordPiece vocabularies go with BERT models, and "
    "pretrain_gpt.py trains GPT",
    "MultimodalTokenizer": "it belongs to Megatron-LM's vision-language training, which "
    "pretrain_gpt.py does not run",
    "NullMultimodalTokenizer": "it belongs to Megatron-LM's vision-language training, which "
    "pretrain_gpt.py does not run",
    "SFTTokenizer": "it belongs to Megatron-LM's supervised fine-tuning with chat prompts, "
    "which pretrain_gpt.py does not run",
}
TOKENIZER_TYPES = (DEFAULT_TOKENIZER_TYPE, "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES)
TOKENIZER_TYPES += ("TikTokenizer", "NullTokenizer", "ByteLevelTokenizer")
# The kinds whose vocabulary holds token strings, in which --fim-data looks
# its sentinel tokens up (megatron/training/fim.py).
FIM_TOKENIZER_TYPES = (DEFAULT_TOKENIZER_TYPE, "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES)

_HF = ("HuggingFaceTokenizer",)
# The flags each type reads (as Megatron-LM's build); any other one given is refused.
USED_BY = {
    "vocab_file": (DEFAULT_TOKENIZER_TYPE, *_HF),
    "merge_file": (DEFAULT_TOKENIZER_TYPE, *_HF),
    "tokenizer_model": (*_HF, *SENTENCEPIECE_TYPES, "TikTokenizer"),
    "vocab_size": ("NullTokenizer", "TikTokenizer", "ByteLevelTokenizer", *_HF),
    "tokenizer_special_tokens": (*_HF, *SENTENCEPIECE_TYPES, "TikTokenizer"),
    "tiktoken_pattern": ("TikTokenizer",),
    "tiktoken_num_special_tokens": ("TikTokenizer",),
    "tokenizer_sentencepiece_legacy": SENTENCEPIECE_TYPES,
    "tokenizer_hf_use_fast": _HF,
    "tokenizer_hf_include_special_tokens": _HF,
    "trust_remote_code": _HF,
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TokenizerConfig)}

# Byte-level ids must cover every byte value 0..255.
_MIN_BYTE_LEVEL_VOCAB = 256


def check_tokenizer(t) -> None:
    """Whether ``t`` (a TokenizerConfig, or any object with its fields) can
    build a tokenizer; a ValueError says what to change."""
    kind = t.tokenizer_type
    if t.legacy_tokenizer and kind not in LEGACY_SAME_IDS:
        raise ValueError(
            f"--legacy-tokenizer with --tokenizer-type {kind} is not available here: "
            "Megatron-LM's legacy tokenizer classes are Megatron-LM's own. Drop it "
            "(megatron-core's tokenizers, Megatron-LM's default, are used); with "
            f"{', '.join(LEGACY_SAME_IDS)} it is accepted, as the ids are the same"
        )
    if kind in REFUSED:
        raise ValueError(
            f"--tokenizer-type {kind} is not available here: {REFUSED[kind]}. "
            f"Supported: {', '.join(TOKENIZER_TYPES)}"
        )
    if kind not in TOKENIZER_TYPES:
        raise ValueError(
            f"unknown --tokenizer-type {kind!r}; supported: {', '.join(TOKENIZER_TYPES)}"
        )
    if kind == DEFAULT_TOKENIZER_TYPE:
        _need_file(kind, "--vocab-file", t.vocab_file, "GPT-2 vocab.json")
        _need_file(kind, "--merge-file", t.merge_file, "GPT-2 merges.txt")
    elif kind == "HuggingFaceTokenizer":
        _need_directory(kind, t.tokenizer_model)
    elif kind in SENTENCEPIECE_TYPES:
        _need_file(kind, "--tokenizer-model", t.tokenizer_model, "SentencePiece .model file")
    elif kind == "TikTokenizer":
        _check_tiktoken(t)
    elif kind == "NullTokenizer":
        _check_null_vocab(t.vocab_size)
    elif t.vocab_size is not None and t.vocab_size < _MIN_BYTE_LEVEL_VOCAB:
        raise ValueError(
            f"--vocab-size {t.vocab_size} is too small for ByteLevelTokenizer; "
            f"use at least {_MIN_BYTE_LEVEL_VOCAB} or omit it (default 512)"
        )
    _need_module(kind)
    if kind == "HuggingFaceTokenizer" and t.vocab_size is not None:
        _check_vocab_matches(t)


def _check_vocab_matches(t) -> None:
    """Megatron-LM's Llama-3 script gives --vocab-size with
    HuggingFaceTokenizer, whose vocabulary is its own: the two must agree."""
    own = copy.copy(t)
    own.vocab_size = None
    size = build_tokenizer(own).vocab_size
    if size != t.vocab_size:
        raise ValueError(
            f"--vocab-size {t.vocab_size}, but the tokenizer in {t.tokenizer_model} has "
            f"{size} ids: give --vocab-size {size} or drop it"
        )


# The types whose legacy class (Megatron-LM's --legacy-tokenizer) gives the
# ids ours gives. Measured for GPT-2 BPE: Megatron-LM's gpt2_tokenization.py
# at core_v0.16.1 against ours on `make data`'s corpus and a line of special
# cases, 703,152 tokens, none different (docs/megatron-lm-flags.md).
LEGACY_SAME_IDS = ("GPT2BPETokenizer",)


def unused_tokenizer_flags(t) -> List[Tuple[str, Sequence[str]]]:
    """The tokenizer flags given that the chosen type does not read, each
    with the types that do (Megatron-LM ignores them; parsing warns)."""
    return [
        ("--" + name.replace("_", "-"), kinds)
        for name, kinds in USED_BY.items()
        if getattr(t, name) != _DEFAULTS[name] and t.tokenizer_type not in kinds
    ]


def _need_file(kind: str, flag: str, path, what: str) -> None:
    if not path:
        raise ValueError(
            f"--tokenizer-type {kind} needs {flag} (a local {what}; nothing is downloaded)"
        )
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is no file: {kind} reads a local {what}")


def _need_directory(kind: str, path) -> None:
    if not path:
        raise ValueError(
            f"--tokenizer-type {kind} needs --tokenizer-model, a local directory saved by "
            "the tokenizer's save_pretrained (nothing is downloaded)"
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"--tokenizer-model {path!r} is no directory: {kind} loads offline only, from "
            "a directory already on disk"
        )


def _need_module(kind: str) -> None:
    if kind not in _MODULE:
        return
    module, package = _MODULE[kind]
    # find_spec only locates the package; importing transformers takes seconds.
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"--tokenizer-type {kind} needs the python package '{module}': "
            f"`pip install {package}`, or choose another --tokenizer-type"
        )


def _check_null_vocab(vocab_size) -> None:
    """NullTokenizer has no model file, so its size must come from --vocab-size."""
    if vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N")
    if vocab_size <= 0:
        raise ValueError(f"--vocab-size must be positive, got {vocab_size}")


def _check_tiktoken(t) -> None:
    _need_file("TikTokenizer", "--tokenizer-model", t.tokenizer_model, "TikToken .json vocabulary")
    if t.tiktoken_pattern not in (None, "v1", "v2"):
        raise ValueError(f"--tiktoken-pattern {t.tiktoken_pattern!r}: use v1 or v2")
    special = t.tiktoken_num_special_tokens
    with open(t.tokenizer_model, encoding="utf-8") as f:
        entries = len(json.load(f))
    wanted = t.vocab_size or TIKTOKEN_DEFAULT_VOCAB
    # megatron-core's class asserts that every id below the size exists.
    if wanted > entries + special:
        raise ValueError(
            f"--vocab-size {wanted}{'' if t.vocab_size else ' (the default)'} is more "
            f"than {t.tokenizer_model}'s {entries} entries plus "
            f"--tiktoken-num-special-tokens {special}: give --vocab-size {entries + special} "
            "or less"
        )
    if special <= 7 or special >= wanted:
        raise ValueError(
            f"--tiktoken-num-special-tokens {special} must be above 7 (TikTokenizer's own "
            f"special tokens) and below the vocabulary size {wanted}"
        )


def import_for_rank(t) -> None:
    """Import megatron-core's tokenizers in a rank, which builds ``t`` alone.
    Their text package imports every tokenizer library it finds, and
    transformers alone is about 2 s of a rank's start on 2 cores: a rank
    whose tokenizer is not Hugging Face's imports the package without it
    (megatron-core's Hugging Face wrapper is then unavailable in that
    process, which never builds one); one whose tokenizer is imports it
    whole, offline first, as ``build_tokenizer`` would. Nothing once the
    package is imported, or transformers is."""
    if {"megatron.core.tokenizers.text", "transformers"} & set(sys.modules):
        return
    if t.tokenizer_type == "HuggingFaceTokenizer":
        _force_hf_offline()
        import megatron.core.tokenizers.text  # noqa: F401

        return
    sys.modules["transformers"] = None  # `import transformers` raises ModuleNotFoundError
    try:
        import megatron.core.tokenizers.text  # noqa: F401
    finally:
        del sys.modules["transformers"]


def import_for_script_args(args: List[str]) -> None:
    """``import_for_rank`` for the ranks of ``args`` (the script's flags),
    read before any config is built: a node's zygote imports for all its
    ranks (deadpool_ext/control/zygote.py). With --use-checkpoint-args the
    checkpoint may name Hugging Face's: imported as for it."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE)
    parser.add_argument("--use-checkpoint-args", action="store_true")
    known = parser.parse_known_args(args)[0]
    if known.use_checkpoint_args:
        known.tokenizer_type = "HuggingFaceTokenizer"
    import_for_rank(known)


def build_tokenizer(t):
    """The megatron-core tokenizer of ``t`` (a TokenizerConfig): has
    .vocab_size, .eod, .tokenize and .detokenize."""
    check_tokenizer(t)
    kind = t.tokenizer_type
    if kind == DEFAULT_TOKENIZER_TYPE:
        from megatron.training.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(t.vocab_file, t.merge_file)
    if kind == "HuggingFaceTokenizer":
        _force_hf_offline()
    # Imported late: megatron-core imports transformers/sentencepiece when present,
    # and the offline switches above must be set before that happens.
    from megatron.core.tokenizers import MegatronTokenizer

    library, path, kwargs = _library_arguments(t)
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path={"library": library}, **kwargs
    )
    if kind == "HuggingFaceTokenizer":
        _fill_hf_eod(tokenizer)
    return tokenizer


def _library_arguments(t):
    """(megatron-core library, model path, keyword arguments), as Megatron-LM
    builds them for ``t.tokenizer_type``."""
    kind, special = t.tokenizer_type, t.tokenizer_special_tokens
    if kind == "NullTokenizer":
        # Megatron convention: --vocab-size excludes eod, which gets id vocab_size.
        return "null", None, {"vocab_size": t.vocab_size}
    if kind == "ByteLevelTokenizer":
        return "byte-level", None, ({"vocab_size": t.vocab_size} if t.vocab_size else {})
    if kind in SENTENCEPIECE_TYPES:
        kwargs = {"legacy": t.tokenizer_sentencepiece_legacy, "special_tokens": special}
        return "sentencepiece", t.tokenizer_model, kwargs
    if kind == "TikTokenizer":
        kwargs = {"num_special_tokens": t.tiktoken_num_special_tokens, "special_tokens": special}
        kwargs["vocab_size"] = t.vocab_size or TIKTOKEN_DEFAULT_VOCAB
        if t.tiktoken_pattern:
            kwargs["pattern"] = t.tiktoken_pattern
        return "tiktoken", t.tokenizer_model, kwargs
    kwargs = {
        "vocab_file": t.vocab_file,
        "merges_file": t.merge_file,
        "additional_special_tokens": special or [],
        "use_fast": t.tokenizer_hf_use_fast,
        "trust_remote_code": t.trust_remote_code,
        "include_special_tokens": t.tokenizer_hf_include_special_tokens,
    }
    return "huggingface", t.tokenizer_model, kwargs


def _force_hf_offline() -> None:
    """Make huggingface_hub/transformers refuse network access."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _fill_hf_eod(tokenizer) -> None:
    """Use the model's own EOS as eod (Megatron-LM's legacy class does).

    megatron-core's HF wrapper only reports eod when an eos_token was passed in
    explicitly; without this, `.eod` would be None and --append-eod would break.
    """
    library = tokenizer._tokenizer
    if library.eod is None and library.tokenizer.eos_token is not None:
        library.eos_token = library.tokenizer.eos_token
