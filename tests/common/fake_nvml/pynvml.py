"""A stand-in for NVIDIA's ``pynvml`` in tests: put this folder first on
PYTHONPATH and the agents' NVML calls answer from a JSON file, while NVML's
constants and error classes are the real module's. Only the calls are fake.

``FAKE_NVML`` names the file: ``{"nodes": {"2": [GPU, ...]}, "default":
[GPU, ...]}``, the GPUs each emulated node's agent sees (its node from
``DEADPOOL_AGENT``, the agent's settings). A GPU is a dict of the fields
below; ``unsupported`` lists the calls that raise NVMLError_NotSupported
and ``lost`` makes its handle fail as a GPU fallen off the bus.
"""

import importlib.machinery
import importlib.util
import json
import os
import sys
from types import SimpleNamespace

_HERE = os.path.dirname(os.path.abspath(__file__))
_FOUND = importlib.machinery.PathFinder.find_spec(
    "pynvml", [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
)
# Under a name of its own: the real module makes its error classes as
# attributes of sys.modules[__name__].
_SPEC = importlib.util.spec_from_file_location("_real_pynvml", _FOUND.origin)
_REAL = sys.modules["_real_pynvml"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_REAL)
globals().update({k: v for k, v in vars(_REAL).items() if k.startswith(("NVML", "nvmlClocks"))})

HEALTHY = {
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-0",
    "memory_used": 512 << 20,
    "memory_total": 81559 << 20,
    "utilization": 0,
    "temperature": 31,
    "ecc_uncorrected": 0,
    "ecc_corrected": 0,
    "retired": [],
    "retired_pending": 0,
    "remapped_rows": [0, 0, 0, 0],
    "clocks": 0x1,  # idle
    "unsupported": [],
    "lost": False,
}
_initialised = False


def _gpus():
    path = os.environ.get("FAKE_NVML")
    table = json.load(open(path)) if path else {}
    node = str(json.loads(os.environ.get("DEADPOOL_AGENT", "{}")).get("node", ""))
    gpus = table.get("nodes", {}).get(node, table.get("default", [{}]))
    return [dict(HEALTHY, uuid=f"GPU-{i}", **gpu) for i, gpu in enumerate(gpus)]


def _answer(name, handle, value):
    if name in _gpus()[handle]["unsupported"]:
        raise NVMLError_NotSupported()  # noqa: F821 - the real module's, above
    return value


def nvmlInit():
    global _initialised
    if os.environ.get("FAKE_NVML_ABSENT"):
        raise NVMLError_LibraryNotFound()  # noqa: F821
    _initialised = True


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index):
    if _gpus()[index]["lost"]:
        raise NVMLError_GpuIsLost()  # noqa: F821
    return index


def nvmlDeviceGetHandleByUUID(uuid):
    for index, gpu in enumerate(_gpus()):
        if gpu["uuid"] == uuid:
            return nvmlDeviceGetHandleByIndex(index)
    raise NVMLError_NotFound()  # noqa: F821


def nvmlDeviceGetIndex(handle):
    return handle


def nvmlDeviceGetName(handle):
    return _answer("name", handle, _gpus()[handle]["name"])


def nvmlDeviceGetMemoryInfo(handle):
    gpu = _gpus()[handle]
    memory = SimpleNamespace(used=gpu["memory_used"], total=gpu["memory_total"])
    return _answer("memory", handle, memory)


def nvmlDeviceGetUtilizationRates(handle):
    rates = SimpleNamespace(gpu=_gpus()[handle]["utilization"], memory=0)
    return _answer("utilization", handle, rates)


def nvmlDeviceGetTemperature(handle, sensor):
    return _answer("temperature", handle, _gpus()[handle]["temperature"])


def nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type):
    uncorrected = error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED  # noqa: F821
    key = "ecc_uncorrected" if uncorrected else "ecc_corrected"
    return _answer("ecc", handle, _gpus()[handle][key])


def nvmlDeviceGetRetiredPages(handle, cause):
    return _answer("retired", handle, list(_gpus()[handle]["retired"]))


def nvmlDeviceGetRetiredPagesPendingStatus(handle):
    return _answer("retired", handle, _gpus()[handle]["retired_pending"])


def nvmlDeviceGetRemappedRows(handle):
    return _answer("remapped_rows", handle, tuple(_gpus()[handle]["remapped_rows"]))


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return _answer("clocks", handle, _gpus()[handle]["clocks"])
