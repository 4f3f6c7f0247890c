"""Shared fixtures: the repository and tests/common on sys.path, a small
real corpus, and quiet, single-threaded worker processes.

Tests are either unit tests (tests/unit_tests: in-process, fast) or
functional tests (tests/functional_tests), marked `integration`, that start
real processes (torchrun, deadpool-launch, subprocess, multiprocessing,
Slurm). So that a process-starting test cannot be left unmarked (or in the
wrong folder) by mistake, every unmarked test's setup and call run with the
ways to start a process replaced by one that fails the test and says to
mark it.
"""

import contextlib
import multiprocessing.process
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
# The repository, and the helpers both kinds of test share (tests/common:
# dist_utils, the fork server, forkrun and the scripts tests run), which
# they import by name, as the scripts they start do.
for path in (REPO, os.path.join(TESTS, "common")):
    if path not in sys.path:
        sys.path.insert(0, path)

import forkserver  # noqa: E402  (after the helpers are on the path)

# Every route to a new process goes through one of these: subprocess (and
# os.popen, asyncio) through Popen._execute_child, multiprocessing through
# Process.start (its fork, spawn and forkserver starts alike), the rest
# through the os calls.
PROCESS_STARTERS = [
    (forkserver, "start"),  # the session's fork server (forkserver.py)
    (subprocess.Popen, "_execute_child"),
    (multiprocessing.process.BaseProcess, "start"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
]


class ProcessInUnitTest(RuntimeError):
    """An unmarked test started a process."""


def refuse_process_start(test_id: str, starter: str):
    def refuse(*args, **kwargs):
        raise ProcessInUnitTest(
            f"{test_id} started a process ({starter}) but is not marked integration: "
            "mark it with @pytest.mark.integration (or the module with "
            "`pytestmark = pytest.mark.integration`), or keep it in-process"
        )

    return refuse


@contextlib.contextmanager
def processes_forbidden_unless_integration(item):
    if item.get_closest_marker("integration"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in PROCESS_STARTERS:
            if hasattr(owner, name):
                patch.setattr(
                    owner, name, refuse_process_start(item.nodeid, f"{owner.__name__}.{name}")
                )
        yield


# Setup and call only: a module or session fixture that an integration test
# built may be torn down in the teardown of whichever test runs last.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with processes_forbidden_unless_integration(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with processes_forbidden_unless_integration(item):
        yield


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """The embedded corpus (stdlib docstrings), capped to stay fast."""
    from tools.prepare_corpus import main as prepare_corpus

    out = tmp_path_factory.mktemp("corpus")
    return prepare_corpus(["--output-dir", str(out), "--max-bytes", "2000000"])
