import pytest

from mpddp import rank_math

# (nnodes, nprocs_per_node, node_rank, local_rank, expected global rank)
TABLE = [
    (1, 1, 0, 0, 0),
    (1, 4, 0, 3, 3),
    (2, 4, 0, 2, 2),
    (2, 4, 1, 0, 4),
    (2, 4, 1, 2, 6),
    (3, 2, 2, 1, 5),
    (3, 2, 1, 0, 2),
    (4, 8, 3, 7, 31),
]


@pytest.mark.parametrize("nnodes,nprocs,node,local,expected", TABLE)
def test_rank_table(nnodes, nprocs, node, local, expected):
    assert rank_math.global_rank(node, local, nprocs) == expected
    assert rank_math.split_rank(expected, nprocs) == (node, local)
    assert 0 <= expected < rank_math.world_size(nnodes, nprocs)


@pytest.mark.parametrize("nnodes,nprocs", [(1, 1), (1, 4), (2, 4), (3, 2)])
def test_layout_covers_every_rank_once(nnodes, nprocs):
    slots = rank_math.layout(nnodes, nprocs)
    assert [s.rank for s in slots] == list(range(nnodes * nprocs))
    assert {(s.node_rank, s.local_rank) for s in slots} == {(n, lr) for n in range(nnodes) for lr in range(nprocs)}
    assert all(s.device == "cpu" and s.gpu is None for s in slots)


def test_layout_gpus_map_local_rank_to_physical_id():
    slots = rank_math.layout(2, 4, gpus=(0, 1, 2, 5))
    six = slots[6]
    assert (six.node_rank, six.local_rank, six.gpu, six.device) == (1, 2, 2, "cuda:2")
    assert slots[7].gpu == 5 and slots[7].device == "cuda:3"
    assert six.formula == "1×4+2 = 6"


def test_layout_shares_gpus_round_robin_when_more_ranks_than_gpus():
    slots = rank_math.layout(1, 3, gpus=(4,))
    assert [(s.gpu, s.device) for s in slots] == [(4, "cuda:0")] * 3
