"""Build megatron-core tokenizers from Megatron-style command-line names.

Everything here is offline: tokenizer files must already be on local disk.
`check_tokenizer_args` is deliberately cheap (no tokenizer library is imported)
so it can run while parsing arguments, before any process group exists.
"""

import importlib.util
import os
from typing import Optional

# Megatron's --tokenizer-type names that this project supports.
TOKENIZER_TYPES = (
    "ByteLevelTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
)

# megatron-core's name for the library behind each tokenizer type.
_LIBRARY = {
    "ByteLevelTokenizer": "byte-level",
    "NullTokenizer": "null",
    "HuggingFaceTokenizer": "huggingface",
    "SentencePieceTokenizer": "sentencepiece",
}

# Types that read a local model: (python module, pip package, what the path must be).
_FILE_BACKED = {
    "HuggingFaceTokenizer": ("transformers", "transformers", "directory"),
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece", "file"),
}

# Byte-level ids must cover every byte value 0..255.
_MIN_BYTE_LEVEL_VOCAB = 256


def check_tokenizer_args(
    tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None
) -> None:
    """Validate tokenizer arguments; raise ValueError saying what to change.

    Returns None when the arguments can build a tokenizer.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"Unknown --tokenizer-type {tokenizer_type!r}; "
            f"supported types are: {', '.join(TOKENIZER_TYPES)}."
        )
    if tokenizer_type in _FILE_BACKED:
        _check_file_backed(tokenizer_type, tokenizer_model)
    elif tokenizer_type == "NullTokenizer":
        _check_null_vocab(vocab_size)
    elif vocab_size is not None and vocab_size < _MIN_BYTE_LEVEL_VOCAB:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for ByteLevelTokenizer; "
            f"use at least {_MIN_BYTE_LEVEL_VOCAB} or omit it (default 512)."
        )


def _check_null_vocab(vocab_size: Optional[int]) -> None:
    """NullTokenizer has no model file, so its size must come from --vocab-size."""
    if vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer requires --vocab-size N.")
    if vocab_size <= 0:
        raise ValueError(f"--vocab-size must be a positive integer, got {vocab_size}.")


def _check_file_backed(tokenizer_type: str, tokenizer_model: Optional[str]) -> None:
    """Check the local model path and that the backing python package is installed."""
    module, pip_name, kind = _FILE_BACKED[tokenizer_type]
    if not tokenizer_model:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} requires --tokenizer-model "
            f"pointing to a local tokenizer {kind}."
        )
    exists = os.path.isdir if kind == "directory" else os.path.isfile
    if not exists(tokenizer_model):
        raise ValueError(
            f"--tokenizer-model {tokenizer_model!r} is not an existing local {kind}; "
            f"{tokenizer_type} loads offline only, so pass a {kind} already on disk."
        )
    # find_spec only locates the package; importing transformers would take seconds.
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} needs the python package '{module}'; "
            f"install it with `pip install {pip_name}` or choose another --tokenizer-type."
        )


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None
):
    """Return a megatron-core tokenizer (has .vocab_size, .eod, .tokenize, .detokenize)."""
    check_tokenizer_args(tokenizer_type, tokenizer_model, vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        _force_hf_offline()
    # Imported late: megatron-core imports transformers/sentencepiece when present,
    # and the offline switches above must be set before that happens.
    from megatron.core.tokenizers import MegatronTokenizer

    metadata = {"library": _LIBRARY[tokenizer_type]}
    kwargs = _library_kwargs(tokenizer_type, vocab_size)
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=tokenizer_model, metadata_path=metadata, **kwargs
    )
    if tokenizer_type == "HuggingFaceTokenizer":
        _fill_hf_eod(tokenizer)
    return tokenizer


def _library_kwargs(tokenizer_type: str, vocab_size: Optional[int]) -> dict:
    """Constructor keyword arguments for the megatron-core library class."""
    if tokenizer_type == "NullTokenizer":
        # Megatron convention: --vocab-size excludes eod, which gets id vocab_size.
        return {"vocab_size": vocab_size}
    if tokenizer_type == "ByteLevelTokenizer" and vocab_size is not None:
        return {"vocab_size": vocab_size}
    if tokenizer_type == "HuggingFaceTokenizer":
        # megatron-core defaults to the slow tokenizer; many local dirs only ship
        # tokenizer.json, which needs the fast one (also what Megatron-LM used).
        return {"use_fast": True}
    return {}


def _force_hf_offline() -> None:
    """Make huggingface_hub/transformers refuse network access."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _fill_hf_eod(tokenizer) -> None:
    """Use the model's own EOS as eod.

    megatron-core's HF wrapper only reports eod when an eos_token was passed in
    explicitly; without this, `.eod` would be None and --append-eod would break.
    """
    library = tokenizer._tokenizer
    if library.eod is None and library.tokenizer.eos_token is not None:
        library.eos_token = library.tokenizer.eos_token
