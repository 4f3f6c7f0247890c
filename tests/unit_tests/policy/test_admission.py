"""Which node's launcher is the standby coordinator (policy/admission.py's
``standby``), judged on views built by hand: node 1 first; once its node is
lost, drained or coordinates, the lowest live node other than the
coordinator's that serves a store and is not being drained; none once no
node is left, and no rule at all without a standby."""

from dataclasses import replace

import pytest

from deadpool_ext.policy.admission import standby
from deadpool_ext.policy.effects import Appoint, StandbyStore
from deadpool_ext.policy.triggers import launchers
from deadpool_ext.policy.view import JobView
from deadpool_ext.protocol import JobState, NodeUp


def view(standby_node=None, alive=(0, 1, 2, 3), stores=(1, 2, 3), coordinator=0, **more):
    return JobView(
        gen=1,
        nodes=(0, 1, 2, 3),
        members={0: "0.0", 1: "1.0"},
        guards_quorum=True,
        alive_nodes=frozenset(alive),
        standby_stores=frozenset(stores),
        standby_node=standby_node,
        coordinator_node=coordinator,
        **more,
    )


@pytest.mark.parametrize(
    "case,expected",
    [
        (dict(), Appoint(1)),  # the first appointment: node 1
        (dict(standby_node=1), None),  # it holds the copy: nothing moves
        (dict(standby_node=2), None),  # it can serve: no move
        (dict(stores=(2, 3), state=JobState.STARTING), None),  # node 1 comes first
        (dict(stores=(2, 3)), Appoint(2)),  # past the start, whoever can
        (dict(standby_node=1, alive=(0, 2, 3)), Appoint(2)),  # its node was lost
        (dict(standby_node=1, drains={1: "asked"}), Appoint(2)),  # its node drains
        (dict(standby_node=1, leaving=(1,)), Appoint(2)),
        (dict(standby_node=None, coordinator=1, alive=(1, 2, 3)), Appoint(2)),  # took over
        (dict(standby_node=1, stores=(1,), alive=(0, 2, 3)), Appoint(None)),  # none left
        (dict(standby_node=None, stores=()), None),  # nobody serves one
    ],
)
def test_the_standby_is_the_lowest_able_node(case, expected):
    assert standby(view(**case)) == (() if expected is None else (expected,))


def test_without_a_standby_no_node_is_appointed():
    """The control: the same view in a job without --standby-addr."""
    assert standby(view()) == (Appoint(1),)
    assert standby(replace(view(), guards_quorum=False)) == ()


def test_a_store_is_taken_from_a_launcher_and_from_an_admitted_join_only():
    up = NodeUp(node=2, active=True, nproc=1, world_size=2, standby_store="h2:29501")
    base = JobView(gen=0, nproc=1, planned_size=2, nodes=(0, 1, 2), members={0: "0.0", 1: "1.0"})
    assert launchers(replace(base, news=(up,))) == (StandbyStore(2, "h2:29501"),)
    # Node 1 is still part of the job: its index is refused, and its store with it.
    impostor = NodeUp(node=1, active=False, nproc=1, join=True, nonce="n", standby_store="h9:1")
    effects = launchers(replace(base, news=(impostor,)))
    assert not [e for e in effects if isinstance(e, StandbyStore)], effects
