"""A fake world of four ranks in this process (torch's fake process group),
for the regroup and generation tests."""

import pytest
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg as fake_pg


@pytest.fixture()
def fake_world():
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=4)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
