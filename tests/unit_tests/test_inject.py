"""Fault specs (deadpool_ext/inject.py), parsed in-process: each kind's
fields, the bad ones refused with what to write, when a fault is due and
when it fires, the slow and slow-warm faults, and the full disk."""

import pytest

from deadpool_ext.inject import InjectError, Injector, parse_fault, spares_ready_at


@pytest.mark.parametrize(
    "spec,where",
    [
        ("flip:rank=2:iter=5:target=param:bit=30", ("after-step", 30)),
        ("flip:rank=0:iter=1:target=grad", ("grad-reduce", None)),
        ("flip:rank=0:iter=3:target=optimizer:seed=9", ("optimizer", None)),
        ("flip:rank=1:iter=3:target=mirror", ("forward", None)),
    ],
)
def test_flip_specs(spec, where):
    parsed = parse_fault(spec)
    assert (parsed.point, parsed.bit) == where and parsed.action == "flip"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("flip:rank=2:iter=5", "flip takes rank=N, iter=N and target=NAME"),
        ("flip:rank=2:iter=5:target=activation", "target must be one of param, grad"),
        ("flip:node=1:iter=5:target=param", "'node=1' is not rank=N"),
        ("flip:rank=2:iter=0:target=param", "iter=0 never comes"),
        ("flip:rank=2:iter=5:target=param:bit=x", "integers >= 0"),
    ],
)
def test_bad_flip_specs_say_what_to_write(spec, message):
    with pytest.raises(InjectError, match=message):
        parse_fault(spec)


def test_slow_and_drain_specs():
    slow = parse_fault("slow:node=1:iter=10:factor=2.5")
    assert (slow.node, slow.iteration, slow.factor) == (1, 10, 2.5)
    injector = Injector([slow], rank=2, node=1, original=True)
    assert [injector.slowdown(i) for i in (9, 10, 30)] == [1.0, 2.5, 2.5]
    assert Injector([slow], rank=2, node=1, original=False).slowdown(30) == 1.0  # a spare
    assert parse_fault("drain:node=1:iter=4").point == "start"
    for spec in (
        "slow:node=1:iter=3:factor=1",
        "slow:node=1:iter=3",
        "slow:node=1:rank=2:iter=3:factor=2",
        "slow:node=1:iter=3:factor=x",
        "drain:rank=1:iter=4",
    ):
        with pytest.raises(InjectError):
            parse_fault(spec)


def test_pause_launcher_specs_say_how_long():
    pause = parse_fault("pause-launcher:rank=0:iter=4:seconds=12.5")
    assert (pause.rank, pause.iteration, pause.seconds, pause.point) == (0, 4, 12.5, "forward")
    for spec in (
        "pause-launcher:rank=0:iter=4",
        "pause-launcher:node=0:iter=4:seconds=5",
        "pause-launcher:rank=0:iter=4:seconds=0",
        "pause-launcher:rank=0:iter=0:seconds=5",
        "pause-launcher:rank=0:iter=4:seconds=soon",
    ):
        with pytest.raises(InjectError):
            parse_fault(spec)


def test_slow_warm_holds_a_spare_nodes_spares_until_a_generation_trains():
    held = parse_fault("slow-warm:node=2:gen=1")
    assert spares_ready_at([held], node=2) == 1 and spares_ready_at([held], node=1) is None
    assert spares_ready_at([], node=2) is None
    # Not a fault of any phase: a rank of that node never fires it.
    injector = Injector([held], rank=4, node=2, original=True)
    assert not any(injector.due(phase, 1) for phase in ("start", "forward", "recovery"))
    for spec in ("slow-warm:node=2", "slow-warm:node=2:gen=0", "slow-warm:rank=2:gen=1"):
        with pytest.raises(InjectError):
            parse_fault(spec)


def test_fault_specs_parse_and_bad_ones_say_what_to_change():
    f = parse_fault("kill:rank=5:iter=7:phase=backward")
    assert (f.action, f.rank, f.node, f.iteration, f.phase) == ("kill", 5, None, 7, "backward")
    assert parse_fault("kill:node=1:iter=4").node == 1
    assert parse_fault("kill:rank=0:phase=recovery").iteration is None
    assert parse_fault("disk-full:rank=2:iter=4").phase == "save"
    for bad, words in [
        ("disk-full:node=1:iter=4", "disk-full takes rank=N and iter=N only"),
        ("disk-full:rank=1:iter=4:phase=forward", "disk-full takes rank=N"),
        ("kill:rank=1", "iter=N"),
        ("explode:rank=1:iter=2", "action"),
        ("kill:rank=1:node=0:iter=2", "exactly one"),
        ("kill:rank=1:iter=2:phase=lunch", "phase"),
        ("hang:node=1:iter=2", "hang takes rank"),
        ("kill:rank=x:iter=2", "integers"),
    ]:
        with pytest.raises(InjectError, match=words):
            parse_fault(bad)


def test_a_full_disk_fails_writes_until_it_is_freed(tmp_path):
    from deadpool_ext.inject import fill_disk, free_disk

    fill_disk()
    try:
        with pytest.raises(OSError, match="File too large"):
            (tmp_path / "f").write_bytes(b"x")
    finally:
        free_disk()
    (tmp_path / "f").write_bytes(b"x")


def test_a_fault_not_reached_is_due_again_when_the_iteration_is_redone():
    """A rank that fails on a peer's death while it waits to reach its
    fault's point (its snapshot exchange) meets the fault in the redone
    iteration: only firing consumes it (CI once lost a stall this way)."""
    from deadpool_ext.inject import Injector, parse_fault

    stall = parse_fault("stall:rank=1:iter=4:phase=forward")
    injector = Injector([stall], rank=1, node=0, original=True)
    assert injector.due("forward", 4) == [stall]
    assert injector.due("forward", 4) == [stall]  # not reached: still due
    injector.fired.add(stall)  # what the fault hook does as it fires it
    assert injector.due("forward", 4) == []
    assert Injector([stall], rank=1, node=0, original=False).due("forward", 4) == []  # a spare
