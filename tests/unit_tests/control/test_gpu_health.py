"""GPU health from NVML (deadpool_ext/control/gpu_health.py), against a fake
NVML whose calls answer from a table (tests/common/fake_nvml: NVML's
constants and errors are the real module's): each problem named, what is
no problem, older bindings, and a reading through the wire's form."""

import json

import pytest

from deadpool_ext.control.gpu_health import GpuReading, NvmlReader, NvmlUnavailable


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
