"""docs/architecture.md's list of files, rendered from the modules' own docstrings.

Every module of deadpool_ext/ and megatron/training/ (their sub-packages
included) and the top-level scripts gets one line: the first sentence of its
module docstring, under a heading for its folder. The list lies between two
marker comments in docs/architecture.md; a test holds it to what this renders,
so a module added, moved or described anew shows in review.

Usage (from the repository root):

    python -m tools.architecture_files            # rewrite the list
    python -m tools.architecture_files --check    # exit 1, naming what differs
"""

import argparse
import ast
import difflib
import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join("docs", "architecture.md")
# The packages listed, each with its sub-packages, and the scripts at the top.
PACKAGES = ("megatron/training", "deadpool_ext")
SCRIPTS = ("pretrain_gpt.py",)
BEGIN = "<!-- files: rendered by python -m tools.architecture_files from the docstrings -->"
END = "<!-- end of the rendered files -->"
# A sentence ends at one of these followed by a space or the paragraph's end
# (a dotted name such as megatron.core has no space after its dot).
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


class DocstringMissing(ValueError):
    """A listed module has no module docstring to take its line from."""


class MarkersMissing(ValueError):
    """The document lacks the marker comments around the rendered list."""


@dataclass(frozen=True)
class Folder:
    """One heading of the list: a folder (or the top level) and its modules."""

    heading: str
    summary: Optional[str]  # its package's first sentence; None at the top level
    modules: List[str]  # one line each: "`name.py`: first sentence"


def first_sentence(path: str) -> str:
    """The first sentence of the module docstring, on one line."""
    with open(path) as f:
        docstring = ast.get_docstring(ast.parse(f.read(), path))
    if not docstring:
        raise DocstringMissing(f"{path} has no module docstring: write one, a summary first")
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    end = SENTENCE_END.search(paragraph)
    return paragraph[: end.end()] if end else paragraph


def folders(root: str) -> List[Folder]:
    """The top-level scripts, then every package folder, sorted within each package."""
    scripts = [f"`{name}`: {first_sentence(os.path.join(root, name))}" for name in SCRIPTS]
    found = [Folder("The repository's top level", None, scripts)]
    for package in PACKAGES:
        for folder, subfolders, files in sorted(os.walk(os.path.join(root, package))):
            subfolders[:] = [s for s in subfolders if s != "__pycache__"]
            if "__init__.py" in files:
                found.append(package_folder(root, folder, files))
    return found


def package_folder(root: str, folder: str, files: List[str]) -> Folder:
    names = sorted(name for name in files if name.endswith(".py") and name != "__init__.py")
    return Folder(
        heading=f"`{os.path.relpath(folder, root)}/`",
        summary=first_sentence(os.path.join(folder, "__init__.py")),
        modules=[f"`{name}`: {first_sentence(os.path.join(folder, name))}" for name in names],
    )


def render(root: str) -> List[str]:
    """The lines between the markers."""
    lines = []
    for folder in folders(root):
        lines += ["", f"### {folder.heading}", ""]
        lines += [folder.summary, ""] if folder.summary else []
        lines += [f"- {module}" for module in folder.modules]
    return lines + [""]


def split(text: str) -> tuple:
    """The document as (before the list, the list's lines, after it); the
    markers stay with the parts around the list."""
    lines = text.split("\n")
    if BEGIN not in lines or END not in lines:
        raise MarkersMissing(f"{DOC} lacks the lines {BEGIN!r} and {END!r}")
    begin, end = lines.index(BEGIN), lines.index(END)
    return lines[: begin + 1], lines[begin + 1 : end], lines[end:]


def differences(root: str) -> List[str]:
    """The rendered list against the document's, as a diff; empty when equal."""
    with open(os.path.join(root, DOC)) as f:
        _, written, _ = split(f.read())
    diff = difflib.unified_diff(written, render(root), DOC, "rendered", lineterm="", n=0)
    return list(diff)


def rewrite(root: str) -> None:
    path = os.path.join(root, DOC)
    with open(path) as f:
        before, _, after = split(f.read())
    with open(path, "w") as f:
        f.write("\n".join(before + render(root) + after))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if the list is stale.")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            rewrite(REPO)
            print(f"wrote the files of {DOC}")
            return 0
        diff = differences(REPO)
    except (DocstringMissing, MarkersMissing) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not diff:
        print(f"{DOC}'s files are up to date")
        return 0
    print(f"{DOC}'s files are out of date (- written, + rendered):")
    print("\n".join(diff[2:]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
