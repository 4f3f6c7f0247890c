"""The scale planner (tools/planning/scale.py) against megatron-core:
snapshot sizes equal the layouts megatron-core builds for real models
(tools/layout_probe.py, one subprocess with a fake world), on every rank."""

import json
import sys

import pytest

from dist_utils import captured
from tools.planning import scale as ps
from tests.unit_tests.tools.planning.test_scale import CASES

pytestmark = pytest.mark.integration

PROBE = (
    "import json, sys\n"
    "from tools.layout_probe import probe\n"
    "cases = json.loads(sys.argv[1])\n"
    "print(json.dumps({k: probe(a, w, list(range(w)), v) for k, (a, w, v) in cases.items()}))"
)


@pytest.fixture(scope="module")
def real_layouts():
    """Every rank's layout as megatron-core and deadpool_ext build it."""
    cases = {name: (flags, world, vocab) for name, (flags, world, vocab, *_) in CASES.items()}
    proc = captured([sys.executable, "-c", PROBE, json.dumps(cases)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plain(name: str) -> str:
    while name.startswith("module."):  # DDP, and Float16Module in bf16
        name = name[len("module.") :]
    return name


@pytest.mark.parametrize("case", sorted(CASES))
def test_planner_layout_equals_megatron_cores_on_every_rank(case, real_layouts):
    _, world, _, shape, par, stage_of = CASES[case]
    assert len(real_layouts[case]) == world
    for real in real_layouts[case]:
        stage = stage_of(real["rank"])
        assert real["pp_rank"] == stage
        tensors = ps.stage_parameters(shape, par.tp, par.pp, stage, par.etp, par.ep)
        assert [(plain(n), k) for n, k in real["params"]] == [(t.name, t.numel) for t in tensors]
        layout = ps.rank_layout(shape, par, stage)
        assert (layout.shard_numel, layout.snapshot_bytes) == (real["numel"], real["nbytes"]), (
            f"rank {real['rank']}"
        )
        assert real["padded_vocab_size"] == ps.padded_vocab(shape, par.tp)
