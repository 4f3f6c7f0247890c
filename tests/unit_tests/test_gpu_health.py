"""GPU health from NVML (deadpool_ext/control/gpu_health.py), against a fake
NVML whose calls answer from a table (tests/common/fake_nvml: NVML's
constants and errors are the real module's); the agent's checks, and the
coordinator keeping a spare with a failing GPU out of its decisions."""

import importlib.util
import json
import os
import types

import pytest

from dist_utils import COMMON
from deadpool_ext.control.agent import Agent
from deadpool_ext.control.gpu_health import GpuReading, NvmlReader, NvmlUnavailable
from deadpool_ext.protocol import Decision, GpuHealth

FAKE = os.path.join(COMMON, "fake_nvml", "pynvml.py")


@pytest.fixture
def nvml(tmp_path, monkeypatch):
    """The fake NVML; ``nvml.gpus(node_or_default, [GPU, ...])`` sets what it answers."""
    table = {"nodes": {}, "default": [{}]}
    path = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML", str(path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("DEADPOOL_SHARE_GPU", raising=False)
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def gpus(gpu_list, node=None):
        if node is None:
            table["default"] = gpu_list
        else:
            table["nodes"][str(node)] = gpu_list
        path.write_text(json.dumps(table))

    module.gpus = gpus
    gpus([{}])
    return module


def test_a_healthy_gpu_is_read_and_has_no_problem(nvml):
    nvml.gpus([{}, {}])
    reading = NvmlReader(nvml).read("1")
    assert reading.index == 1 and reading.name == "NVIDIA H100 80GB HBM3"
    assert (reading.memory_used_mib, reading.memory_total_mib) == (512, 81559)
    assert reading.ecc_uncorrected == 0 and reading.retired_pages == 0
    assert reading.problems() == []
    assert reading.summary() == "GPU 1 (NVIDIA H100 80GB HBM3, 512/81559 MiB, 0 ECC): healthy"


@pytest.mark.parametrize(
    "fault, words",
    [
        ({"ecc_uncorrected": 3}, "3 uncorrectable ECC errors"),
        ({"retired_pending": 1}, "pages waiting to be retired"),
        ({"remapped_rows": [0, 1, 1, 0]}, "rows waiting to be remapped"),
        ({"remapped_rows": [0, 1, 0, 1]}, "remap failed"),
        ({"lost": True}, "NVML cannot reach it"),
    ],
)
def test_each_problem_is_named(nvml, fault, words):
    nvml.gpus([fault])
    problems = NvmlReader(nvml).read("0").problems()
    assert len(problems) == 1 and words in problems[0], problems


def test_what_is_normal_passing_or_unknown_is_no_problem(nvml):
    """Corrected ECC errors, clocks held down (they come and go with the
    load: a straggler, not a broken GPU), high use and readings the part
    does not support (MIG, virtual GPUs) are recorded, never judged."""
    nvml.gpus(
        [
            {
                "ecc_corrected": 40,
                "clocks": 0x8 | 0x40 | 0x4,
                "utilization": 100,
                "unsupported": ["ecc", "retired", "remapped_rows"],
            }
        ]
    )
    reading = NvmlReader(nvml).read("0")
    assert reading.ecc_uncorrected is None and reading.retired_pages is None
    assert reading.remap_failed is None and reading.problems() == []
    assert reading.clock_reasons == ("hardware slowdown", "hardware thermal slowdown")
    assert "ECC unknown, clocks held down: hardware slowdown" in reading.summary()


def test_an_older_binding_is_read_with_what_it_has(nvml):
    """pynvml before the clock-event names: throttle reasons instead; a call
    it lacks altogether is unknown."""
    nvml.gpus([{"clocks": 0x8}])
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = nvml.nvmlDeviceGetCurrentClocksEventReasons
    del nvml.nvmlDeviceGetCurrentClocksEventReasons
    del nvml.nvmlDeviceGetRemappedRows
    reading = NvmlReader(nvml).read("0")
    assert reading.clock_reasons == ("hardware slowdown",) and reading.remap_failed is None


def test_no_visible_gpu_gives_no_reading(nvml):
    nvml.gpus([{}, {}])
    for hidden in ("-1", "", "NoDevFiles"):
        assert NvmlReader(nvml, {"CUDA_VISIBLE_DEVICES": hidden}).read_workers([0, 1]) == {}
    shared = {"CUDA_VISIBLE_DEVICES": "", "DEADPOOL_SHARE_GPU": "hostid"}
    assert NvmlReader(nvml, shared).read_workers([0]) == {}
    assert list(NvmlReader(nvml, {"CUDA_VISIBLE_DEVICES": "1,-1,0"}).read_workers([0, 1])) == [0]


def test_each_worker_is_read_on_the_gpu_it_uses(nvml, monkeypatch):
    nvml.gpus([{}, {"ecc_uncorrected": 1}, {}, {}])
    reader = NvmlReader(nvml)
    assert [r.index for r in reader.read_workers([0, 1]).values()] == [0, 1]
    # CUDA_VISIBLE_DEVICES renumbers: the workers' GPU 0 is NVML's 2.
    reader = NvmlReader(nvml, {"CUDA_VISIBLE_DEVICES": "2,1"})
    readings = reader.read_workers([0, 1])
    assert [r.index for r in readings.values()] == [2, 1] and readings[1].problems()
    by_uuid = NvmlReader(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-3"}).read_workers([0])
    assert by_uuid[0].index == 3
    # Ranks sharing one GPU (test jobs) share its reading.
    shared = NvmlReader(nvml, {"CUDA_VISIBLE_DEVICES": "1", "DEADPOOL_SHARE_GPU": "hostid"})
    assert [r.index for r in shared.read_workers([0, 1, 2]).values()] == [1, 1, 1]


def test_no_nvml_or_no_gpu_means_no_check(nvml, monkeypatch):
    nvml.gpus([])
    with pytest.raises(NvmlUnavailable, match="sees no GPU"):
        NvmlReader(nvml)
    monkeypatch.setenv("FAKE_NVML_ABSENT", "1")
    with pytest.raises(NvmlUnavailable, match="NVML"):
        NvmlReader(nvml)


def test_a_reading_survives_the_wire():
    reading = GpuReading(index=0, name="x", ecc_uncorrected=2, clock_reasons=("power",))
    assert GpuReading.from_dict(json.loads(json.dumps(reading.to_dict()))) == reading


def agent_on(nvml, node=2, nproc=2):
    posted = []
    agent = Agent.__new__(Agent)
    agent.node, agent.nproc = node, nproc
    agent.gpus, agent.gpu_verdicts, agent.next_gpu_check = NvmlReader(nvml), None, 0.0
    agent.channel = types.SimpleNamespace(post=lambda topic, message: posted.append(message))
    return agent, posted


def test_the_agent_tells_the_coordinator_when_a_verdict_changes(nvml):
    nvml.gpus([{}, {}])
    agent, posted = agent_on(nvml)
    agent.check_gpus(now=True)
    assert len(posted) == 1 and isinstance(posted[0], GpuHealth)
    assert sorted(posted[0].readings) == ["2.0", "2.1"]
    agent.check_gpus(now=True)  # nothing changed: nothing sent
    agent.check_gpus()  # not due yet
    assert len(posted) == 1
    nvml.gpus([{}, {"ecc_uncorrected": 5}])
    agent.check_gpus(now=True)
    assert len(posted) == 2
    assert GpuReading.from_dict(posted[1].readings["2.1"]).problems()


def test_a_check_that_breaks_stops_the_checks_not_the_agent(nvml, capsys):
    nvml.gpus([{}, {}])
    agent, posted = agent_on(nvml)

    def broken(handle):
        raise RuntimeError("the binding broke")

    nvml.nvmlDeviceGetHandleByIndex = broken
    agent.check_gpus(now=True)
    assert posted == [] and agent.gpus is None
    assert "GPU health checks stop: RuntimeError: the binding broke" in capsys.readouterr().err
    agent.check_gpus(now=True)  # and nothing more is read


def test_the_agent_reads_its_gpus_again_when_a_failure_is_announced(nvml):
    agent, posted = agent_on(nvml)
    agent.checked_failure_gen = None
    generations = iter([{"gen": 0, "state": "training"}, {"gen": 1, "state": "recovering"}])
    agent.channel.put = lambda *args, **kwargs: None
    agent.channel.get = lambda key: next(generations)
    agent.beat()
    assert posted == []
    agent.next_gpu_check = float("inf")  # not due: only the announcement reads
    agent.beat()
    assert len(posted) == 1


def test_the_decision_carries_the_spares_gpus_over_the_wire():
    decision = Decision(
        gen=1, action="recover", gpus={"2.0": "GPU 0 (x): healthy"}, withheld=["3.1"]
    )
    back = Decision.from_message(json.loads(json.dumps(decision.to_message())))
    assert back.gpus == decision.gpus and back.withheld == ["3.1"]
