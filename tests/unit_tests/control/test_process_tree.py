"""How the launcher starts a worker (deadpool_ext/control/process_tree.py):
``-m`` runs a module, as torchrun's."""

import sys

from deadpool_ext.control.process_tree import worker_command
from tests.unit_tests.control.test_command_line import parsed


def test_a_module_runs_as_python_m_runs_it():
    opts = parsed("--standalone", "-m")
    assert worker_command(opts)[:4] == [sys.executable, "-u", "-m", "pretrain_gpt.py"]


def test_agents_are_told_node_1s_standby_store_which_is_appointed_first(monkeypatch):
    from deadpool_ext import protocol as P
    from deadpool_ext.control.command_line import checked_options
    from deadpool_ext.control.process_tree import agent_settings

    monkeypatch.setenv(P.SECRET_ENV, "x")
    flags = ["--nnodes", "2", "--spare-nodes", "1", "--node-rank", "2", "--master-port", "1234"]
    flags += ["--master-addr", "h0"]
    standby = checked_options([*flags, "--standby-addr", "h1", "pretrain_gpt.py"])
    assert agent_settings(standby, 2, "h0:1234")["first_standby"] == "h1:1235"
    alone = checked_options([*flags, "pretrain_gpt.py"])
    assert agent_settings(alone, 2, "h0:1234")["first_standby"] is None
