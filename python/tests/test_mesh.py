"""meshtrain.DeviceMesh on 8 threads-engine ranks: coordinates, the
communicators along each axis (closed-form sums), several axes at once,
the text picture, and errors."""

import numpy as np
import pytest

import meshtrain


def test_a_4x2_mesh():
    def fn(w):
        mesh = meshtrain.DeviceMesh(w, [4, 2], ["data", "tensor"])
        tp, dp = mesh.comm("tensor"), mesh.comm("data")
        x = np.array([w.rank], dtype=np.int64)
        tp.all_reduce(x)  # the row's two ranks: 2 r + (2 r + 1)
        y = np.array([w.rank], dtype=np.int64)
        dp.all_reduce(y)  # the column's four ranks
        both = mesh.comm(["data", "tensor"])
        return (mesh.coords, mesh.axis_rank("tensor"), tp.rank, tp.size, dp.size, int(x[0]), int(y[0]),
                both.size, mesh.group_ranks(["data"]), mesh.rank_of(mesh.coords) == w.rank)

    for r, got in enumerate(meshtrain.launch(fn, ranks=8, timeout=30)):
        coords, t_rank, tp_rank, tp_size, dp_size, row_sum, column_sum, both, group, back = got
        assert coords == [r // 2, r % 2] and t_rank == r % 2 == tp_rank
        assert (tp_size, dp_size, both) == (2, 4, 8)
        assert row_sum == 4 * (r // 2) + 1
        assert column_sum == sum(range(r % 2, 8, 2))
        assert group == list(range(r % 2, 8, 2)) and back


def test_the_picture():
    text = meshtrain.render_mesh([4, 2], ["data", "tensor"])
    assert "mesh (data=4, tensor=2): 8 ranks" in text
    assert "data groups (vary data, fixed tensor): [0 2 4 6] [1 3 5 7]" in text
    (same,) = meshtrain.launch(lambda w: str(meshtrain.DeviceMesh(w, [1], ["data"])) == meshtrain.render_mesh(
        [1], ["data"]))
    assert same


def test_a_shape_that_does_not_match_the_world_is_refused_on_every_rank():
    def fn(w):
        with pytest.raises(meshtrain.InvalidArgument, match="has 3 ranks but the world has 2"):
            meshtrain.DeviceMesh(w, [3], ["data"])
        with pytest.raises(meshtrain.InvalidArgument, match="expert"):
            meshtrain.DeviceMesh(w, [2], ["data"]).comm("expert")
        return True

    assert meshtrain.launch(fn, ranks=2, timeout=30) == [True, True]
