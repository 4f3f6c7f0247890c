"""Which nodes a cut of the data network has taken (policy/paths.py and its
trigger): from what the ranks' beats say of the data their connections
left unacknowledged, and of their own addresses."""

from deadpool_ext.policy import triggers as T
from deadpool_ext.policy.paths import cut_off, cut_pairs, partners
from deadpool_ext.policy.view import Progress
from tests.unit_tests.policy.job import JOB, MEMBERS, S, losses, replace

SLOTS = ["0.0", "1.0", "2.0", "3.0"]
HOSTS = {slot: f"10.0.0.{slot[0]}" for slot in SLOTS}


def beats(silent, hosts=HOSTS):
    """slot -> Progress from one beat each: its address and ``silent``'s
    peers (slot -> {peer slot: seconds})."""
    found = {}
    for slot in SLOTS:
        progress = Progress()
        waits = {hosts[peer]: s for peer, s in silent.get(slot, {}).items()}
        progress.observe({"host": hosts[slot], "silent": waits}, 0.0)
        found[slot] = progress
    return found


def pair(a, b):
    return frozenset((a, b))


def test_a_node_cut_off_from_all_its_peers_is_the_one_taken():
    silent = {"2.0": {"0.0": 5, "1.0": 5, "3.0": 5}, "0.0": {"2.0": 5}, "1.0": {"2.0": 4}}
    pairs = cut_pairs(SLOTS, beats(silent), 3.0)
    assert pairs == {pair(2, 0), pair(2, 1), pair(2, 3)}
    assert cut_off(pairs) == [2] and partners(2, pairs) == [0, 1, 3]


def test_waits_shorter_than_the_timeout_and_shared_addresses_name_nobody():
    assert cut_pairs(SLOTS, beats({"1.0": {"2.0": 2.9}}), 3.0) == set()
    assert cut_pairs(SLOTS, beats({"1.0": {"2.0": 9}}), 3.0) == {pair(1, 2)}
    # Nodes 2 and 3 on one host (one address): which one is cut off is unknown.
    shared = dict(HOSTS, **{"3.0": HOSTS["2.0"]})
    assert cut_pairs(SLOTS, beats({"1.0": {"2.0": 9}}, shared), 3.0) == set()
    # A beat of the wrong shape names nobody either.
    odd = beats({})
    odd["1.0"].observe({"host": HOSTS["1.0"], "silent": {HOSTS["2.0"]: "9"}}, 0.0)
    assert cut_pairs(SLOTS, odd, 3.0) == set()


def test_a_cut_between_two_halves_takes_the_half_without_node_0():
    halves = {pair(a, b) for a in (0, 1) for b in (2, 3)}
    assert cut_off(halves) == [2, 3]


def test_a_pair_alone_takes_the_later_node_unless_the_suspected_waits_point_elsewhere():
    assert cut_off({pair(1, 2)}) == [2]
    # Node 1's wait on node 0 is under the timeout yet: node 1 is the one
    # cut off, whose second pair crosses the timeout a beat later.
    assert cut_off({pair(1, 2)}, suspected={pair(1, 2), pair(1, 0)}) == [1]


def test_the_trigger_declares_the_unreachable_node_lost_only_while_training():
    members = {0: "0.0", 1: "0.1", 2: "1.0", 3: "1.1"}
    assert members == MEMBERS
    hosts = {"0.0": "10.0.0.0", "0.1": "10.0.0.0", "1.0": "10.0.0.1", "1.1": "10.0.0.1"}
    threads = {}
    for slot, host in hosts.items():
        progress = Progress()
        silent = {"10.0.0.0": 4.0} if slot.startswith("1.") else {}
        progress.observe({"host": host, "silent": silent}, 0.0)
        threads[slot] = progress
    view = replace(JOB, main_threads=threads)
    (loss,) = losses(T.unreachable_nodes(view))
    assert loss.slots == ("1.0", "1.1") and loss.kill_nodes == (1,)
    assert "unreachable from node(s) 0" in loss.reason
    assert T.unreachable_nodes(replace(view, state=S.RECOVERING)) == ()
    assert T.unreachable_nodes(replace(JOB, main_threads={})) == ()
