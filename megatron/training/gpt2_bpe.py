"""GPT2BPETokenizer: GPT-2's byte-level BPE from a local vocab.json and merges.txt.

It runs on the ``tokenizers`` package, in megatron-core's tokenizer
interface (what GPTDataset and preprocess_data read).

vocab_size is the vocabulary's length and eod the id of <|endoftext|>, as
Megatron-LM's GPT2BPETokenizer; there is no pad id (the dataset uses its own).
"""

from typing import List

from megatron.core.tokenizers.text.libraries.abstract_tokenizer import (
    MegatronTokenizerTextAbstract,
)
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

# GPT-2's end-of-document token, Megatron-LM's eod for GPT2BPETokenizer.
GPT2_EOD = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizerText):
    def __init__(self, vocab_file: str, merge_file: str) -> None:
        # The merges file is part of the identity datasets cache their indices under.
        super().__init__(vocab_file, {"library": "gpt2-bpe"}, merges_file=merge_file)

    def _restore_model(self, merges_file: str) -> MegatronTokenizerTextAbstract:
        return GPT2BytePairs(self.path, merges_file)


class GPT2BytePairs(MegatronTokenizerTextAbstract):
    """The library object: the ``tokenizers`` BPE with GPT-2's byte-level
    split (its regular expression) and decoder."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.bpe = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self.bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.bpe.decoder = decoders.ByteLevel()
        self.vocab = self.bpe.get_vocab()
        if GPT2_EOD not in self.vocab:
            raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token (GPT-2's eod)")
        self.vocab_size = len(self.vocab)
        self.eod_id = self.vocab[GPT2_EOD]

    @property
    def bos_id(self) -> int:
        return self.eod_id  # <|endoftext|> is GPT-2's bos and eos too

    eos_id = bos_id

    def _none(self) -> int:
        # An AttributeError is how megatron-core learns a token does not exist
        # (the abstract class's properties would recurse).
        raise AttributeError("GPT-2's vocabulary has no such token")

    pad_id = cls_id = sep_id = mask_id = property(_none)

    def text_to_ids(self, text: str) -> List[int]:
        return self.bpe.encode(text, add_special_tokens=False).ids

    def ids_to_text(self, ids: List[int]) -> str:
        return self.bpe.decode(list(ids), skip_special_tokens=False)

    def text_to_tokens(self, text: str) -> List[str]:
        return self.bpe.encode(text, add_special_tokens=False).tokens

    def tokens_to_text(self, tokens: List[str]) -> str:
        return self.ids_to_text(self.tokens_to_ids(tokens))

    def tokens_to_ids(self, tokens: List[str]) -> List[int]:
        return [self.vocab[token] for token in tokens]

    def ids_to_tokens(self, ids: List[int]) -> List[str]:
        return [self.bpe.id_to_token(i) for i in ids]

    def add_special_tokens(self, special_tokens) -> None:
        raise NotImplementedError("GPT2BPETokenizer's vocabulary is vocab.json as it is")
