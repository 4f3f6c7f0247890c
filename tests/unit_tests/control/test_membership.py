"""Who is who in a job (deadpool_ext/control/membership.py), without a store
or a process: the launched members, a loss, a node admitted only where one
is free, and the membership's round trip through the job's record."""

import dataclasses

from deadpool_ext.control.membership import Membership
from deadpool_ext.control.record import JobRecord, Round, Watch, view_of
from deadpool_ext.policy.admission import why_not_join
from deadpool_ext.policy.view import Sighting
from deadpool_ext.protocol import CoordinatorSettings
from tests.unit_tests.policy.job import MEMBERS


def test_membership_round_trips_and_admits_a_node_only_where_one_is_free():
    view = Membership.launched(nnodes=2, spare_nodes=1, nproc=2)
    assert view.members == MEMBERS and view.planned_size == 4 and view.nodes() == [0, 1, 2]
    assert view.lose(["1.1", "2.0"]) == {3} and view.alive_nodes() == {0, 1, 2}
    record = dataclasses.replace(
        JobRecord.launched(CoordinatorSettings(), 2, 1, 2), membership=view
    )
    assert JobRecord.from_json(record.to_json()).membership == view
    seen = view_of(record, Round(), Watch(), (None, Sighting(), {}, {}), (), 0.0)
    assert why_not_join(seen, 1, 2) == "node 1 is still part of the job"
    assert why_not_join(seen, 3, 4) == "it runs 4 ranks per node, the job 2"
    assert why_not_join(seen, 3, 2) is None and view.admit(3) == ["3.0", "3.1"]
    assert view.nodes() == [0, 1, 2, 3]
    view.released.add("0.1")
    assert view.note_exit("0.1") and "0.1" not in view.released  # a shrink's: no loss
    assert not view.note_exit("1.0")
