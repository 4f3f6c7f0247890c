"""How the launcher starts a worker (deadpool_ext/control/process_tree.py):
``-m`` runs a module, as torchrun's."""

import sys

from deadpool_ext.control.process_tree import worker_command
from tests.unit_tests.control.test_command_line import parsed


def test_a_module_runs_as_python_m_runs_it():
    opts = parsed("--standalone", "-m")
    assert worker_command(opts)[:4] == [sys.executable, "-u", "-m", "pretrain_gpt.py"]
