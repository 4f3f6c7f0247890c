"""How the flag checks refuse and warn, in the flags' own words.

A refusal is a ConfigError whose message names the flag to change; a
warning is a line on rank 0 (Megatron-LM ignores what it warns about too).
"""

import dataclasses
import os
from typing import List, Tuple


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change. A
    main that catches it ends with ``EXIT_CODE``, argparse's code for bad
    flags, as Megatron-LM's scripts do (deadpool's agents read it as
    ``ExitCode.USAGE``)."""

    EXIT_CODE = 2


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def warn(message: str) -> None:
    say(f"WARNING: {message}")


def say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def ignored_without(anchor: str, present: bool, dependents: List[Tuple[str, bool]]) -> List[str]:
    """Flags that only mean something with ``anchor``, given without it:
    Megatron-LM ignores them, and so does this build, saying so in a
    warning (``dependents``: flag, whether set). Returns those set."""
    given = [flag for flag, is_set in dependents if is_set]
    if given and not present:
        warn(
            f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
            f"{anchor} (Megatron-LM ignores {'it' if len(given) == 1 else 'them'} too)"
        )
    return given


def require_with(anchor: str, present: bool, dependents: List[Tuple[str, bool]]) -> List[str]:
    """Flags that only mean something with ``anchor``: refused when set
    (``dependents``: flag, whether set) and ``anchor`` is not given.
    Returns those set."""
    given = [flag for flag, is_set in dependents if is_set]
    require(present or not given, f"{', '.join(given)} go with {anchor}: give it, or drop them")
    return given
