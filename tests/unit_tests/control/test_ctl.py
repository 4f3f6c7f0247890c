"""deadpool-ctl (deadpool_ext/control/ctl.py), in-process: finding the
standalone job of this host, printing its status for a person, an address
without a port refused, and turning to the standby when node 0 does not
answer."""

import json
import os
import stat

import pytest

from deadpool_ext.control import ctl, jobs
from tests.unit_tests.control.test_operations import make_job


def test_deadpool_ctl_finds_the_standalone_job_of_this_host(tmp_path):
    env = {"DEADPOOL_RUN_DIR": str(tmp_path / "run")}
    opts = ctl.build_parser().parse_args(["--master-port", "0", "status"])
    with pytest.raises(ctl.UsageError, match="no deadpool-launch --standalone job"):
        ctl.find_job(opts, env)
    path = jobs.write_job("127.0.0.1", 1234, "s3cret", os.getpid(), env)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    assert ctl.find_job(opts, env) == ("127.0.0.1", 1234, b"s3cret")
    jobs.write_job("127.0.0.1", 99, "x", 2**22 + 7, env)  # a launcher that is gone
    assert ctl.find_job(opts, env) == ("127.0.0.1", 1234, b"s3cret")
    assert len(os.listdir(tmp_path / "run")) == 1  # its file was removed
    given = ctl.build_parser().parse_args(["--master-port", "29500", "drain", "1"])
    with pytest.raises(ctl.UsageError, match="DEADPOOL_SECRET"):
        ctl.find_job(given, env)
    assert ctl.find_job(given, {"DEADPOOL_SECRET": "k"}) == ("127.0.0.1", 29500, b"k")


def test_deadpool_ctl_prints_the_status_for_a_person():
    coordinator, worker, _ = make_job()
    text = ctl.describe(json.loads(json.dumps(coordinator.status())))
    assert text.splitlines()[:4] == [
        "job: training, generation 0, iteration -, 4 of 4 ranks",
        "  node 0: active, ranks 0-1",
        "  node 1: active, ranks 2-3",
        "  node 2: spare",
    ]
    assert "spares: 2 ready ['2.0', '2.1']" in text and "requests refused: 0" in text
    assert text.endswith("coordinator: node 0 (term 0), standby: none")


def test_deadpool_ctl_refuses_an_address_without_a_port():
    opts = ctl.build_parser().parse_args(["--master-addr", "10.0.0.1", "status"])
    opts.master_port = None  # whatever MASTER_PORT the environment holds
    with pytest.raises(ctl.UsageError, match="--master-port"):
        ctl.find_job(opts, {})


def test_deadpool_ctl_turns_to_the_standby_when_node_0_does_not_answer(monkeypatch):
    asked = []

    def ask(host, port, secret, request, timeout_s):
        asked.append((host, port))
        if len(asked) == 1:
            raise ConnectionError("no job answers")
        return {"ok": True, "status": {}}

    monkeypatch.setattr(ctl, "ask", ask)
    opts = ctl.build_parser().parse_args(["--standby-addr", "node1", "status"])
    assert ctl.ask_where_it_runs(opts, "node0", 29500, b"k") == {"ok": True, "status": {}}
    assert asked == [("node0", 29500), ("node1", 29501)]
    opts = ctl.build_parser().parse_args(["status"])
    asked.clear()
    with pytest.raises(ConnectionError):
        ctl.ask_where_it_runs(opts, "node0", 29500, b"k")
