"""The fake NVML (tests/common/fake_nvml) as a fixture, for the GPU health
and the agent's tests."""

import importlib.util
import json
import os

import pytest

from dist_utils import COMMON

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
