"""A worker's entry (deadpool_ext/rank/main.py), in-process: a spare finds
the decision that named it after newer generations began."""

from deadpool_ext.protocol import Decision


def test_a_spare_finds_its_assignment_after_a_new_generation_began():
    """Generation 1 named spare 2.0; generation 2 began before the spare
    looked (it was building its model), and generation 3 has no decision yet."""
    from deadpool_ext.rank.main import newest_assignment

    class Ctx:
        slot = "2.0"
        decisions = {1: Decision(gen=1, action="recover", replaced={3: "2.0"})}

        def decision(self, gen):
            return self.decisions.get(gen)

    ctx = Ctx()
    decision, checked = newest_assignment(ctx, 0, 3)
    assert decision.gen == 1 and checked == 1
    ctx.slot = "2.1"  # not named: generation 2 was overtaken, 3 is pending
    assert newest_assignment(ctx, 0, 3) == (None, 2)
    assert newest_assignment(ctx, 2, 2) == (None, 2)
