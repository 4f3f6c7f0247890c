"""Small vocabularies of every tokenizer kind, learned from a JSONL corpus.

Usage (from the repository root; `make data` runs it on the embedded corpus):

    python -m tools.train_tokenizers --input data/corpus.jsonl --output-dir data/tokenizers

Writes, for pretrain_gpt.py's and preprocess_data's tokenizer flags:
    gpt2/vocab.json, gpt2/merges.txt    --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file
    hf/ (tokenizer.json and its config) --tokenizer-type HuggingFaceTokenizer --tokenizer-model
    sentencepiece.model                 --tokenizer-type SentencePieceTokenizer | Llama2Tokenizer
                                        | GPTSentencePieceTokenizer --tokenizer-model
    tiktoken.json                       --tokenizer-type TikTokenizer --tokenizer-model
The libraries learn them (``tokenizers``' byte-level BPE trainer, as GPT-2's
vocabulary was made, and ``sentencepiece``'s); the TikToken vocabulary is the
GPT-2 one in Megatron's TikToken JSON layout. Output is deterministic for a
given corpus.
"""

import argparse
import base64
import json
import os
from typing import Dict, Iterator, List, Optional, Sequence

GPT2_EOD = "<|endoftext|>"  # megatron.training.gpt2_bpe.GPT2_EOD, without importing torch


def read_texts(path: str, key: str = "text") -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)[key]


def train_gpt2_bpe(texts: List[str], directory: str, vocab_size: int):
    """GPT-2's byte-level BPE learned from ``texts``; returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[GPT2_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(directory, exist_ok=True)
    tokenizer.model.save(directory)  # vocab.json and merges.txt, GPT-2's files
    return tokenizer


def write_hf_directory(tokenizer, directory: str) -> None:
    """A directory transformers' AutoTokenizer loads offline."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": GPT2_EOD,
        "bos_token": GPT2_EOD,
        "unk_token": GPT2_EOD,
        "model_max_length": 1 << 30,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def byte_of_character() -> Dict[str, int]:
    """GPT-2's reversible map from vocab.json's characters back to bytes:
    printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    characters = {chr(b): b for b in printable}
    characters.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return characters


def write_tiktoken_vocabulary(gpt2_directory: str, path: str) -> None:
    """The GPT-2 vocabulary in Megatron's TikToken JSON: the 256 bytes in
    byte order, then each merge's token in merge order (its rank)."""
    to_byte = byte_of_character()
    with open(os.path.join(gpt2_directory, "merges.txt"), encoding="utf-8") as f:
        merges = [line.split() for line in f if line.strip() and not line.startswith("#version")]
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes(to_byte[c] for c in left + right) for left, right in merges]
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode("ascii"),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for rank, token in enumerate(tokens)
    ]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)


def train_sentencepiece(texts: List[str], prefix: str, vocab_size: int) -> None:
    """A SentencePiece BPE model (LLaMA's kind: <unk> <s> </s>, byte fallback)."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        max_sentence_length=1 << 16,
        num_threads=1,
        minloglevel=2,
    )


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL corpus.")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--vocab-size", type=int, default=1024, help="Ids of each vocabulary.")
    args = parser.parse_args(argv)
    texts = list(read_texts(args.input, args.json_key))
    out = args.output_dir
    bpe = train_gpt2_bpe(texts, os.path.join(out, "gpt2"), args.vocab_size)
    write_hf_directory(bpe, os.path.join(out, "hf"))
    write_tiktoken_vocabulary(os.path.join(out, "gpt2"), os.path.join(out, "tiktoken.json"))
    train_sentencepiece(texts, os.path.join(out, "sentencepiece"), args.vocab_size)
    print(f"wrote GPT-2 BPE, Hugging Face, SentencePiece and TikToken vocabularies to {out}")
    return out


if __name__ == "__main__":
    main()
