"""The seeds' DataParallel and DistributedMetrics (meshtrain.distributed) on 4
threads-engine ranks of a data=4 mesh: this rank's rows of a batch,
gradients and metrics reduced to their closed forms, parameters replicated."""

import numpy as np
import pytest

import meshtrain
from meshtrain.distributed import DataParallel, DistributedMetrics

RANKS = 4


def run(fn):
    return meshtrain.launch(fn, ranks=RANKS, timeout=30)


def test_data_parallel_shards_the_batch_and_aggregates_gradients():
    batch = {"x": np.arange(8 * 3, dtype=np.float32).reshape(8, 3), "y": np.arange(8), "lr": 0.1}

    def fn(w):
        mesh = meshtrain.DeviceMesh(w, [RANKS], ["data"])
        dp = DataParallel()
        sharding = dp.create_data_parallel_sharding(mesh, data_axis="data")
        mine = dp.shard_batch(batch, sharding)
        assert np.shares_memory(mine["x"], batch["x"])  # a view: no copy
        grads = {"w": np.full((2, 2), float(w.rank)), "b": [np.array([w.rank], dtype=np.float32)]}
        dp.all_reduce_gradients(grads, reduce_type="mean", axis_name="data", mesh=mesh)
        total = DataParallel.all_reduce_gradients_static({"g": np.array([1.0])}, "sum", mesh=mesh)
        params = {"w": np.full(3, float(w.rank))}
        dp.replicate_params(params, mesh)
        shards = dp.shard_model_state({"e": np.arange(10.0)}, mesh, param_sharding="shard")
        with pytest.raises(meshtrain.InvalidArgument, match="reduce_type 'max'"):
            dp.all_reduce_gradients(grads, reduce_type="max", mesh=mesh)
        return (mine["x"][:, 0].tolist(), mine["y"].tolist(), mine["lr"], grads["w"][0, 0], float(grads["b"][0][0]),
                float(total["g"][0]), params["w"].tolist(), shards["e"].tolist())

    for r, got in enumerate(run(fn)):
        x, y, lr, w_mean, b_mean, total, replicated, shard = got
        assert x == [6.0 * r, 6.0 * r + 3] and y == [2 * r, 2 * r + 1] and lr == 0.1
        assert w_mean == b_mean == 1.5 and total == 4.0
        assert replicated == [0.0, 0.0, 0.0]
        assert shard == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]][r]  # torch.chunk: 3, 3, 3, 1


def test_distributed_metrics_reduce_every_value():
    def fn(w):
        mesh = meshtrain.DeviceMesh(w, [RANKS], ["data"])
        m = DistributedMetrics(mesh)
        metrics = {"loss": float(w.rank), "acc": np.array([w.rank, 10.0 * w.rank])}
        out = {
            "mean": m.reduce_mean(metrics),
            "sum": m.reduce_sum(metrics)["loss"],
            "max": m.reduce_max(metrics)["loss"],
            "min": m.reduce_min(metrics)["loss"],
            "custom": m.reduce_custom(metrics, {"loss": "max"}),
            "gathered": m.all_gather({"loss": float(w.rank)})["loss"].tolist(),
        }
        with pytest.raises(meshtrain.InvalidArgument, match="reduction 'median'"):
            m.reduce_custom(metrics, {"loss": "median"})
        return out

    for out in run(fn):
        assert out["mean"]["loss"] == 1.5 and out["mean"]["acc"].tolist() == [1.5, 15.0]
        assert (out["sum"], out["max"], out["min"]) == (6.0, 3.0, 0.0)
        assert out["custom"]["loss"] == 3.0 and out["custom"]["acc"].tolist() == [1.5, 15.0]
        assert out["gathered"] == [0.0, 1.0, 2.0, 3.0]
    assert DistributedMetrics.collect_from_devices({"a": np.arange(3), "n": 2}) == {"a": [0, 1, 2], "n": 2}
