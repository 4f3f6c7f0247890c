"""The network campaign's draws and checks (tools/chaos_network.py), in-process:
the same seed draws the same faults, each fault says whether the design
declares a loss, and the checks find a false loss, a missed one, two
coordinators in one generation and a live node's launcher that failed."""

from tools import chaos
from tools.chaos_network import KINDS, NetworkFault, draw_fault, network_problem


def test_a_seed_draws_the_same_faults_and_every_kind_over_a_campaign():
    first = [draw_fault(1, i, 3, 12, 5.0) for i in range(40)]
    assert first == [draw_fault(1, i, 3, 12, 5.0) for i in range(40)]
    assert {f.kind for f in first} == set(KINDS) and {f.host for f in first} == {0, 1, 2}
    assert all(2 <= f.iteration < 8 for f in first)


def test_which_faults_declare_a_loss():
    def fault(kind, host=1, amount=0.0):
        return NetworkFault(kind, host, 3, 5.0, amount)

    assert fault("isolate").declares_a_loss and fault("isolate-loud", host=0).declares_a_loss
    assert fault("flap-long", amount=10).declares_a_loss
    # Node 0's too: the other hosts' lines to it are cut off after the timeout.
    assert fault("flap-long", host=0, amount=10).declares_a_loss
    assert not fault("flap-long", host=0, amount=4).declares_a_loss
    assert not any(fault(k, amount=2).declares_a_loss for k in ("flap-short", "lose", "slow"))


def events(*said):
    return [dict(rank=-1, gen=gen, term=term, event=event, reason="r") for event, gen, term in said]


def test_the_checks_find_what_the_design_forbids():
    lose = NetworkFault("lose", 1, 3, 5.0, 2)
    isolate = NetworkFault("isolate", 1, 3, 5.0)
    assert network_problem(lose, events(), [0, 0, 0]) is None
    assert "false loss" in network_problem(lose, events(("failure_detected", 1, 0)), [0, 0, 0])
    assert "never declared" in network_problem(isolate, events(), [0, 10, 0])
    two = events(("failure_detected", 1, 0), ("decision", 1, 1))
    assert "two coordinators" in network_problem(isolate, two, [0, 10, 0])
    assert "exited" in network_problem(isolate, events(("failure_detected", 1, 0)), [1, 10, 0])
    # The cut-off node's own launcher may end as it learns: fenced, or its coordinator lost.
    assert network_problem(isolate, events(("failure_detected", 1, 0)), [0, 9, 0]) is None


def test_a_network_trial_is_the_draw_with_a_spare_node_and_nothing_injected():
    trial = chaos.aimed_at_network(chaos.draw(1, 0))
    assert trial.spares == 1 and trial.target == "network" and chaos.faults(trial) == []
    assert trial.expected in ("swap", "nothing")
