"""The rebuild cost's inputs (tools/scale_rebuild.py), in-process: a replica
is the ranks of one data-parallel index, as deadpool_ext/topology counts them."""

from deadpool_ext.topology import Grid, dp_rings
from tools import scale_rebuild


def test_a_replica_is_the_ranks_of_one_data_parallel_index():
    for grid in (Grid(2, 2, 3), Grid(2, 2, 3, tp_pp_dp=True), Grid(4, 8, 4)):
        rings = dp_rings(grid.world_size, grid.tp, grid.pp, grid.tp_pp_dp)
        for dp in range(grid.dp):
            assert sorted(scale_rebuild.replica_ranks(grid, dp)) == sorted(r[dp] for r in rings)
