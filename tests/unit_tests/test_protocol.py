"""What processes tell each other (deadpool_ext/protocol.py), in-process: a
group's key, a corruption's check and suspects, and a decision's spares'
GPUs, each through the wire's form and back."""

import json

from deadpool_ext import protocol as P
from deadpool_ext.protocol import Decision, group_key, group_members
from tests.unit_tests.policy.test_faults import fault


def test_a_group_key_names_its_members_and_its_place_among_their_groups():
    assert group_key((0, 2), 1) == "0,2#1"
    assert group_members(group_key((0, 2, 3), 0)) == [0, 2, 3]


def test_a_corruption_travels_with_its_check_and_suspects():
    message = fault(4, [2], check="mirror-replay")
    parsed = P.parse_message(message.body())
    assert (parsed.check, parsed.suspects, parsed.on_sdc) == ("mirror-replay", [2], "rollback")
    nan = P.parse_message(
        {k: v for k, v in message.body().items() if k not in ("check", "suspects")}
    )
    assert nan.check == "nan" and nan.suspects == []


def test_the_decision_carries_the_spares_gpus_over_the_wire():
    decision = Decision(
        gen=1, action="recover", gpus={"2.0": "GPU 0 (x): healthy"}, withheld=["3.1"]
    )
    back = Decision.from_message(json.loads(json.dumps(decision.to_message())))
    assert back.gpus == decision.gpus and back.withheld == ["3.1"]


def test_a_decision_has_a_place_for_its_members_and_released_slots_only():
    """A node cut off, declared lost and swapped, then healed: its slots
    are neither members nor released in the decision it then reads, and
    its workers leave on that (rank/recovery.py), acting on nothing."""
    swapped = Decision(gen=1, action="recover", members={0: "0.0", 1: "2.0"}, replaced={1: "2.0"})
    assert swapped.has_place_for("0.0") and swapped.has_place_for("2.0")
    assert not swapped.has_place_for("1.0")
    shrunk = Decision(gen=2, action="shrink", members={0: "0.0"}, released=["2.0"])
    assert shrunk.has_place_for("2.0") and not shrunk.has_place_for("1.0")
