"""PartitionSpec, Layout, ShardedTensor (distribute, gather, redistribute) and
visualize_sharding from Python, on a (data=2, tensor=2) mesh of 4
threads-engine ranks: every rank's block is the global array's slice the
layout names, and gathering any layout gives the global array back."""

import numpy as np
import pytest

import meshtrain
from meshtrain import PartitionSpec as P


def test_partition_specs_print_as_jax_does():
    assert repr(P("data", None, None)) == "PartitionSpec('data', None, None)"
    assert repr(P(("fsdp", "tensor"), None)) == "PartitionSpec(('fsdp', 'tensor'), None)"
    assert P.parse("(fsdp,tensor),None") == P(("fsdp", "tensor"), None)
    assert str(P("data", None)) == "P(data, None)"
    assert len(P("data", None, None)) == 3
    with pytest.raises(meshtrain.InvalidArgument):
        P("data", "data")  # an axis used twice


def test_a_pure_layout_answers_every_query():
    rows = meshtrain.Layout.pure([2, 2], ["data", "tensor"], P("data", "tensor"), [5, 6])
    assert rows.local_shape(0) == [3, 3] and rows.local_shape(3) == [2, 3]  # 5 rows: 3 + 2
    assert rows.local_box(3) == ([3, 3], [2, 3])
    assert not rows.is_even()
    text = meshtrain.visualize_sharding(rows, width=24, height=4)
    assert "data" in text and "tensor" in text
    assert meshtrain.visualize_sharding(rows, svg=True).startswith("<svg")
    with pytest.raises(meshtrain.InvalidArgument, match="expert"):
        meshtrain.Layout.pure([2], ["data"], P("expert"), [4])


def test_distribute_gather_redistribute_on_four_ranks():
    global_array = np.arange(5 * 6, dtype=np.float32).reshape(5, 6)

    def fn(w):
        mesh = meshtrain.DeviceMesh(w, [2, 2], ["data", "tensor"])
        layout = meshtrain.Layout(mesh, P("data", "tensor"), [5, 6])
        t = meshtrain.distribute(global_array if w.rank == 0 else None, layout, src_rank=0)
        (r0, c0), (rows, cols) = layout.local_box(w.rank)
        mine = np.array_equal(t.local, global_array[r0:r0 + rows, c0:c0 + cols])
        back = meshtrain.gather(t)
        moved = meshtrain.redistribute(t, P(None, ("data", "tensor")))
        (r1, c1), (rows1, cols1) = moved.layout.local_box(w.rank)
        moved_ok = np.array_equal(moved.local, global_array[r1:r1 + rows1, c1:c1 + cols1])
        only_root = meshtrain.gather(moved, dst_rank=2)
        local = meshtrain.distribute_replicated(global_array, layout).local
        return (mine, np.array_equal(back, global_array), moved_ok, only_root is None if w.rank != 2 else
                np.array_equal(only_root, global_array), np.array_equal(local, t.local))

    for r, got in enumerate(meshtrain.launch(fn, ranks=4, timeout=30)):
        assert got == (True, True, True, True, True), (r, got)


def test_int_and_float64_move_exactly():
    def fn(w):
        mesh = meshtrain.DeviceMesh(w, [2], ["data"])
        for dtype in (np.int64, np.float64, np.uint8):
            g = (np.arange(7) * 3).astype(dtype)
            t = meshtrain.distribute(g, meshtrain.Layout(mesh, P("data"), [7]), src_rank=1)
            assert meshtrain.gather(t).dtype == dtype and np.array_equal(meshtrain.gather(t), g)
        return True

    assert meshtrain.launch(fn, ranks=2, timeout=30) == [True, True]
