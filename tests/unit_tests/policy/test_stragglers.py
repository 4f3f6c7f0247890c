"""Which node is slow (policy/stragglers.py): each node's compute time is
its live ranks' median over a full window, judged against the other
nodes' median; the straggler trigger says a straggler once while it lasts."""

from deadpool_ext.policy.effects import Note
from deadpool_ext.policy.stragglers import judge, node_times
from deadpool_ext.policy.triggers import stragglers
from deadpool_ext.policy.view import JobView, Sighting
from deadpool_ext.protocol import CoordinatorSettings, JobState
from tests.unit_tests.policy.job import replace


def compute(seconds, count=3, iteration=7):
    return {"seconds": seconds, "count": count, "iteration": iteration}


def test_the_straggler_watch_compares_each_node_with_the_others():
    times = {"0.0": compute(1.0), "1.0": compute(1.2), "2.0": compute(1.4)}
    assert judge(node_times(times, list(times), 3), 1.5) == {}  # 1.4 is not 1.5 x 1.1
    times["2.0"] = compute(3.0, iteration=8)
    found = judge(node_times(times, list(times), 3), 1.5)
    assert [(s.node, s.others_s, s.iteration) for s in found.values()] == [(2, 1.1, 8)]
    # Said once while it lasts.
    settings = CoordinatorSettings(straggler_factor=1.5, straggler_window=3)
    view = JobView(gen=0, state=JobState.TRAINING, settings=settings, sighting=Sighting())
    view = replace(view, node_times=node_times(times, list(times), 3))
    said = [e for e in stragglers(view) if isinstance(e, Note) and e.event == "straggler"]
    assert len(said) == 1 and said[0].fields["node"] == 2
    again = replace(view, stragglers=found)
    assert not [e for e in stragglers(again) if isinstance(e, Note) and e.event == "straggler"]
    times["1.1"] = compute(9.0, count=2, iteration=8)  # its window is not full
    assert node_times(times, list(times), 3)[1][0] == 1.2
    # A node's time is its ranks' median: one noisy rank does not make it slow.
    times["0.1"], times["0.2"] = compute(5.0, iteration=8), compute(1.1, iteration=8)
    assert node_times(times, list(times), 3)[0][0] == 1.1
    assert 0 not in judge(node_times(times, list(times), 3), 1.5)
    kept = node_times(times, ["0.0", "1.0"], 3)  # only the live members count
    assert 2 not in kept and judge(kept, 1.5) == {}
    assert judge(node_times(times, list(times), 3), 0) == {}
