"""Build the project's default corpus from the Python standard library's docstrings.

Every machine with CPython already has this real English text, so tests and
small training runs need no download. One JSON document per stdlib module holds
its module, class and function docstrings in source order. Small vocabularies
of every tokenizer kind are learned from them ({output_dir}/tokenizers, see
tools/train_tokenizers.py), and the documents are tokenized (with eod)
byte-level into {output_dir}/corpus_text_document.bin/.idx and with the GPT-2
BPE vocabulary into {output_dir}/corpus_gpt2_text_document.bin/.idx.

Usage (from the repository root):

    python -m tools.prepare_corpus [--output-dir data] [--max-bytes N] [--force]

Same Python version and arguments -> byte-identical files. A corpus_meta.json
beside the outputs lets later runs skip the work when nothing changed.
"""

import argparse
import ast
import hashlib
import json
import os
import platform
import sysconfig
import time
import warnings
from typing import Dict, Iterator, List, Optional, Sequence

# Bump when the document format changes, so old outputs count as stale.
CORPUS_FORMAT_VERSION = 2
# Modules with fewer docstring characters are mostly boilerplate.
MIN_DOC_CHARS = 200
# Directory names never walked: third-party code and test suites.
SKIP_DIRS = {"site-packages", "dist-packages", "idle_test", "__pycache__"}

DOCSTRING_NODES = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="data", help="Where the corpus files go.")
    parser.add_argument(
        "--max-bytes", type=int, default=None, help="Cap on total UTF-8 text bytes (default: none)."
    )
    parser.add_argument("--force", action="store_true", help="Rebuild even if up to date.")
    args = parser.parse_args(argv)
    if args.max_bytes is not None and args.max_bytes <= 0:
        parser.error("--max-bytes must be positive")
    return args


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("test")


def stdlib_sources(stdlib: str) -> List[str]:
    """Relative paths of the stdlib's .py files, tests excluded, in sorted order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # Prune in place so os.walk never descends into skipped trees.
        dirnames[:] = [d for d in dirnames if not _skip_dir(d)]
        rel_dir = os.path.relpath(dirpath, stdlib)
        found += [
            os.path.normpath(os.path.join(rel_dir, f)) for f in filenames if f.endswith(".py")
        ]
    # Sorting the full posix path, not walk order, makes the order filesystem-independent.
    return sorted(found, key=lambda p: p.replace(os.sep, "/"))


def parse_module(path: str) -> Optional[ast.Module]:
    """Parse a source file; None when it is not valid Python for this interpreter."""
    with open(path, "rb") as f:
        source = f.read()  # bytes, so ast honours the file's coding cookie
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. invalid escape sequences in old modules
        try:
            return ast.parse(source, filename=path)
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
            return None


def _definitions(node: ast.AST) -> Iterator[ast.AST]:
    """Every class/function below node, depth-first, i.e. in source order."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, DOCSTRING_NODES):
            yield child
        # Recurse into everything: defs also sit inside if/try/with blocks and classes.
        yield from _definitions(child)


def module_docstrings(tree: ast.Module) -> List[str]:
    """Module, class and function docstrings of a parsed module, in source order."""
    docs = (ast.get_docstring(n, clean=True) for n in (tree, *_definitions(tree)))
    return [d for d in docs if d]


def build_documents(stdlib: str, max_bytes: Optional[int] = None) -> List[Dict[str, str]]:
    """One {"text", "source"} document per documented stdlib module, capped at max_bytes."""
    documents, remaining = [], max_bytes
    for rel_path in stdlib_sources(stdlib):
        tree = parse_module(os.path.join(stdlib, rel_path))
        text = "\n\n".join(module_docstrings(tree)) if tree else ""
        if remaining is not None:
            text = _truncate_utf8(text, remaining)
        if len(text) < MIN_DOC_CHARS:
            continue
        documents.append({"text": text, "source": rel_path.replace(os.sep, "/")})
        if remaining is not None:
            remaining -= len(text.encode("utf-8"))
            if remaining < MIN_DOC_CHARS:
                break  # nothing later could fit a full-sized document
    return documents


def _truncate_utf8(text: str, max_bytes: int) -> str:
    """Longest prefix of text whose UTF-8 encoding fits in max_bytes."""
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    # errors="ignore" drops a multi-byte character cut in half at the end.
    return encoded[:max_bytes].decode("utf-8", errors="ignore")


def write_jsonl(documents: List[Dict[str, str]], path: str) -> str:
    """Write documents one per line; returns the file's sha256."""
    payload = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents)
    data = payload.encode("utf-8")
    with open(path, "wb") as f:  # binary: no platform newline translation
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class CorpusPaths:
    """Every file prepare_corpus reads or writes inside the output directory."""

    def __init__(self, output_dir: str) -> None:
        self.jsonl = os.path.join(output_dir, "corpus.jsonl")
        self.meta = os.path.join(output_dir, "corpus_meta.json")
        self.tokenize_prefix = os.path.join(output_dir, "corpus")
        self.data_prefix = os.path.join(output_dir, "corpus_text_document")
        self.gpt2_tokenize_prefix = os.path.join(output_dir, "corpus_gpt2")
        self.gpt2_data_prefix = os.path.join(output_dir, "corpus_gpt2_text_document")
        self.tokenizers = os.path.join(output_dir, "tokenizers")
        self.vocab_file = os.path.join(self.tokenizers, "gpt2", "vocab.json")
        self.merge_file = os.path.join(self.tokenizers, "gpt2", "merges.txt")


def _wanted_meta(args: argparse.Namespace) -> dict:
    """The meta fields that must match for existing outputs to be reused."""
    return {
        "format_version": CORPUS_FORMAT_VERSION,
        "python_version": platform.python_version(),
        "max_bytes": args.max_bytes,
    }


def is_up_to_date(paths: CorpusPaths, args: argparse.Namespace) -> Optional[dict]:
    """The stored meta if every output exists and matches this run, else None."""
    needed = [paths.meta, paths.jsonl, paths.vocab_file, paths.merge_file]
    needed += [
        prefix + ext
        for prefix in (paths.data_prefix, paths.gpt2_data_prefix)
        for ext in (".bin", ".idx")
    ]
    if not all(os.path.isfile(p) for p in needed):
        return None
    with open(paths.meta, "r", encoding="utf-8") as f:
        meta = json.load(f)
    if any(meta.get(k) != v for k, v in _wanted_meta(args).items()):
        return None
    # The jsonl hash catches edits; hashing a few MB costs milliseconds.
    if meta.get("jsonl_sha256") != _sha256_file(paths.jsonl):
        return None
    return meta


def count_tokens(data_prefix: str) -> int:
    """Total tokens in an indexed dataset (reads only the index)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(data_prefix)
    # Keep `dataset` alive while summing: its __del__ unmaps the index that
    # sequence_lengths points into (summing after that segfaults).
    total = int(dataset.sequence_lengths.sum())
    del dataset
    return total


def build_corpus(paths: CorpusPaths, args: argparse.Namespace) -> dict:
    """Extract, write and tokenize the corpus; returns the meta it recorded."""
    os.makedirs(os.path.dirname(paths.meta) or ".", exist_ok=True)
    if os.path.exists(paths.meta):
        os.remove(paths.meta)  # a crash mid-build must not leave "up to date" behind
    documents = build_documents(sysconfig.get_paths()["stdlib"], args.max_bytes)
    if not documents:
        raise RuntimeError("no stdlib docstrings found; is the standard library installed?")
    jsonl_sha = write_jsonl(documents, paths.jsonl)
    # Imported here: torch + megatron-core take seconds, and the up-to-date path needs neither.
    from tools import preprocess_data, train_tokenizers

    train_tokenizers.main(["--input", paths.jsonl, "--output-dir", paths.tokenizers])
    common = ["--input", paths.jsonl, "--json-keys", "text", "--append-eod"]
    preprocess_data.main(
        common
        + ["--output-prefix", paths.tokenize_prefix, "--tokenizer-type", "ByteLevelTokenizer"]
    )
    preprocess_data.main(
        common
        + ["--output-prefix", paths.gpt2_tokenize_prefix, "--tokenizer-type", "GPT2BPETokenizer"]
        + ["--vocab-file", paths.vocab_file, "--merge-file", paths.merge_file]
    )
    meta = dict(_wanted_meta(args))
    meta.update(
        documents=len(documents),
        characters=sum(len(d["text"]) for d in documents),
        tokens=count_tokens(paths.data_prefix),
        jsonl_sha256=jsonl_sha,
    )
    # Written last: its presence means every other output is complete.
    with open(paths.meta, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    return meta


def main(argv: Optional[Sequence[str]] = None) -> str:
    """Prepare the corpus if needed; returns the prefix {output_dir}/corpus_text_document."""
    args = get_args(argv)
    paths = CorpusPaths(args.output_dir)
    start = time.monotonic()
    meta = None if args.force else is_up_to_date(paths, args)
    status = "up to date, reused" if meta else "built"
    if meta is None:
        meta = build_corpus(paths, args)
    print(
        f"corpus {status} in {time.monotonic() - start:.1f}s: {meta['documents']} documents, "
        f"{meta['characters']} characters, {meta['tokens']} tokens "
        f"(Python {meta['python_version']} stdlib docstrings) -> {paths.data_prefix}"
    )
    return paths.data_prefix


if __name__ == "__main__":
    main()
