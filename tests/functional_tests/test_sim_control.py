"""The control-plane simulator (tools/sim_control.py): the real coordinator
and store, driven by simulated ranks and agents, carries a node's loss to a
decision every member of the new generation reads, declares nothing else
lost, and finds a slow node as a straggler. (Its figures at scale are
docs/scale.md's; no time is asserted here.)"""

import json

import pytest

from tools import sim_control

pytestmark = pytest.mark.integration

SMALL = ["--ranks", "48", "--tp", "2", "--pp", "2", "--ranks-per-node", "4"]
QUICK = ["--heartbeat-timeout", "2", "--warmup-s", "3", "--steady-s", "2", "--after-s", "6"]


def run(tmp_path, fault: str) -> dict:
    out = tmp_path / f"{fault}.json"
    assert sim_control.main(SMALL + QUICK + ["--fault", fault, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_lost_node_is_decided_and_read_by_every_member(tmp_path):
    result = run(tmp_path, "node")
    assert result["decision"] == "recover" and result["generations"] == 1
    assert result["failures_declared"] == 1  # nobody else: the others kept beating
    assert result["members_read"] == 48 and result["read_by_all_s"] is not None
    assert result["detected_s"] <= result["decided_s"] <= result["read_by_all_s"]
    for name in ("store_ops_per_s", "offered_ops_per_s", "coordinator_cpu", "store_cpu"):
        assert result[name] > 0


def test_a_slow_node_is_found_and_nothing_is_lost(tmp_path):
    result = run(tmp_path, "straggler")
    assert result["detected_s"] is not None


def test_the_nodes_a_loss_takes_never_mirror_each_other_nor_include_node_0():
    lost = sim_control.lost_nodes("nodes10", nnodes=64, per_replica=8)
    assert len(lost) == 10 and 0 not in lost
    replicas = {n // 8 for n in lost}
    assert not {r + 1 for r in replicas} & replicas  # a replica's buddies are the next one's
    with pytest.raises(SystemExit):
        sim_control.lost_nodes("nodes10", nnodes=8, per_replica=8)  # one replica: no copy
