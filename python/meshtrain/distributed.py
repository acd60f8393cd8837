"""The seeds' distributed-training names on meshtrain: ``DataParallel``, ``DistributedMetrics``, the configs.

meshtrain runs one program per rank (SPMD, like ``torch.distributed``): a
batch is sharded by taking this rank's rows, gradients and metrics are
reduced with the rank's communicator. So where the seeds' functions took a
JAX mesh and a pmap axis name, these take a ``meshtrain.DeviceMesh`` (and an
axis of it) or a ``Communicator``. Trees of arrays are dicts, lists and
tuples of numpy arrays (and Python scalars for metrics); arrays are reduced
in place and sliced as views, never copied.

``DistributedConfig`` is meshtrain's job configuration (C++
``config::DistributedConfig``); ``FSDP2Config``, ``ZeroPlusPlusConfig`` and
``ContextParallelConfig`` are options of ``meshtrain.train``:

    meshtrain.train(model="gpt", mesh="data=2,fsdp=2", fsdp=FSDP2Config(sharding_strategy="full"))
"""

import numbers

import numpy as np

from . import _meshtrain
from ._meshtrain import DistributedConfig
from ._options import ContextParallelConfig, FSDP2Config, ZeroPlusPlusConfig, init_context_parallel_group

__all__ = ["BatchSharding", "ContextParallelConfig", "DataParallel", "DistributedConfig", "DistributedMetrics",
           "FSDP2Config", "ZeroPlusPlusConfig", "init_context_parallel_group"]


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return fn(tree)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _comm(mesh, axis_name, comm, op):
    if comm is not None:
        return comm
    if mesh is None:
        raise _meshtrain.InvalidArgument(
            f"{op}: no communicator (hint: pass mesh=<DeviceMesh> (reduced over mesh.comm(axis_name)) or comm=<a "
            "rank's Communicator>)")
    return mesh.comm(axis_name)


class BatchSharding:
    """How a batch is split: dimension 0 over ``data_axis`` of ``mesh`` (the seeds' NamedSharding)."""

    def __init__(self, mesh, data_axis="data"):
        self.mesh = mesh
        self.data_axis = data_axis
        self.spec = _meshtrain.PartitionSpec(data_axis)

    def local(self, array):
        """This rank's rows of ``array`` (a view): the Layout's block, uneven as torch.chunk splits."""
        array = np.asarray(array)
        if array.ndim == 0:
            return array  # a scalar is replicated
        spec = _meshtrain.PartitionSpec(self.data_axis, *([None] * (array.ndim - 1)))
        layout = _meshtrain.Layout(self.mesh, spec, list(array.shape))
        (start, *_), (rows, *_) = layout.local_box(self.mesh.rank)
        return array[start:start + rows]


class DataParallel:
    """Data-parallel utilities: shard a batch, replicate or shard the model state, reduce gradients.

    Every method has a ``*_static`` twin (the seeds' stateless form).
    """

    def create_data_parallel_sharding(self, mesh, data_axis="data"):
        """A BatchSharding: dimension 0 split over ``data_axis`` of the DeviceMesh."""
        return BatchSharding(mesh, data_axis)

    def shard_batch(self, batch, sharding):
        """This rank's rows of every array of ``batch`` (views, no copy); scalars stay whole."""
        return _map(batch, sharding.local)

    def shard_model_state(self, state, mesh, param_sharding="replicate"):
        """"replicate": every rank keeps its whole state (make it equal first with replicate_params).
        "shard": this rank's block of every array, dimension 0 split over the mesh's first axis (uneven
        blocks as torch.chunk cuts them; the seeds' used the first axis too, unchecked)."""
        if param_sharding == "replicate":
            return state
        if param_sharding != "shard":
            raise _meshtrain.InvalidArgument(
                f"DataParallel.shard_model_state: param_sharding '{param_sharding}' (hint: use replicate or shard)")
        return _map(state, BatchSharding(mesh, mesh.axis_names[0]).local)

    def all_reduce_gradients(self, gradients, reduce_type="mean", axis_name="data", mesh=None, comm=None):
        """Reduces every gradient array in place over ``mesh.comm(axis_name)`` (or ``comm``) and returns the tree.

        reduce_type "mean" (the average over the ranks) or "sum". The axis
        defaults to "data", the mesh's data axis (the seeds' default "batch"
        named no mesh axis).
        """
        if reduce_type not in ("mean", "sum"):
            raise _meshtrain.InvalidArgument(
                f"DataParallel.all_reduce_gradients: reduce_type '{reduce_type}' (hint: use 'mean' or 'sum')")
        c = _comm(mesh, axis_name, comm, "DataParallel.all_reduce_gradients")
        for g in _leaves(gradients):
            c.all_reduce(g, op="avg" if reduce_type == "mean" else "sum")
        return gradients

    def replicate_params(self, params, mesh, axis_name=None):
        """Makes every rank's parameters rank 0's (a broadcast in place over the mesh, or one axis of it)."""
        c = mesh.comm(axis_name) if axis_name else mesh.comm(list(mesh.axis_names))
        for p in _leaves(params):
            c.broadcast(p, root=0)
        return params

    # The seeds' stateless twins.
    @staticmethod
    def create_data_parallel_sharding_static(mesh, data_axis="data"):
        """DataParallel().create_data_parallel_sharding (the seeds' stateless form)."""
        return DataParallel().create_data_parallel_sharding(mesh, data_axis)

    @staticmethod
    def shard_batch_static(batch, sharding):
        """DataParallel().shard_batch (the seeds' stateless form)."""
        return DataParallel().shard_batch(batch, sharding)

    @staticmethod
    def shard_model_state_static(state, mesh, param_sharding="replicate"):
        """DataParallel().shard_model_state (the seeds' stateless form)."""
        return DataParallel().shard_model_state(state, mesh, param_sharding)

    @staticmethod
    def all_reduce_gradients_static(gradients, reduce_type="mean", axis_name="data", mesh=None, comm=None):
        """DataParallel().all_reduce_gradients (the seeds' stateless form)."""
        return DataParallel().all_reduce_gradients(gradients, reduce_type, axis_name, mesh, comm)

    @staticmethod
    def replicate_params_static(params, mesh, axis_name=None):
        """DataParallel().replicate_params (the seeds' stateless form)."""
        return DataParallel().replicate_params(params, mesh, axis_name)


_OPS = {"mean": "avg", "sum": "sum", "max": "max", "min": "min"}


class DistributedMetrics:
    """Metrics reduced over the ranks: every value (array or Python number) reduced, none passed through.

    The seeds' left Python scalars unreduced and passed unknown reductions
    through silently; here every number is reduced and an unknown
    reduction raises InvalidArgument.
    """

    def __init__(self, mesh=None, comm=None):
        self.mesh = mesh
        self.comm = comm

    def _reduce(self, metrics, op, axis_name, mesh, comm):
        c = _comm(mesh or self.mesh, axis_name, comm or self.comm, "DistributedMetrics")

        def one(value):
            if isinstance(value, np.ndarray):
                out = np.ascontiguousarray(value, dtype=np.float64 if value.dtype.kind == "f" else value.dtype)
                out = out.copy() if out is value else out
                c.all_reduce(out, op=op)
                return out.astype(value.dtype, copy=False)
            if isinstance(value, numbers.Number):
                x = np.array([value], dtype=np.float64)
                c.all_reduce(x, op=op)
                return float(x[0])
            raise _meshtrain.InvalidArgument(
                f"DistributedMetrics: a metric of type {type(value).__name__} (hint: pass numbers or numpy arrays)")

        return _map(metrics, one)

    def reduce_mean(self, metrics, axis_name="data", mesh=None, comm=None):
        """Each metric averaged over the ranks (in float64)."""
        return self._reduce(metrics, "avg", axis_name, mesh, comm)

    def reduce_sum(self, metrics, axis_name="data", mesh=None, comm=None):
        """Each metric summed over the ranks."""
        return self._reduce(metrics, "sum", axis_name, mesh, comm)

    def reduce_max(self, metrics, axis_name="data", mesh=None, comm=None):
        """Each metric's largest value over the ranks."""
        return self._reduce(metrics, "max", axis_name, mesh, comm)

    def reduce_min(self, metrics, axis_name="data", mesh=None, comm=None):
        """Each metric's smallest value over the ranks."""
        return self._reduce(metrics, "min", axis_name, mesh, comm)

    def reduce_custom(self, metrics, reduce_fn=None, axis_name="data", mesh=None, comm=None):
        """Each top-level metric by its reduction in ``reduce_fn`` ({key: "mean" | "sum" | "max" | "min"};
        "mean" when absent or reduce_fn is None)."""
        reduce_fn = reduce_fn or {}
        out = {}
        for key, value in metrics.items():
            how = reduce_fn.get(key, "mean")
            if how not in _OPS:
                raise _meshtrain.InvalidArgument(
                    f"DistributedMetrics.reduce_custom: reduction '{how}' for '{key}' (hint: use mean, sum, max "
                    "or min)")
            out[key] = self._reduce(value, _OPS[how], axis_name, mesh, comm)
        return out

    def all_gather(self, metrics, axis_name="data", mesh=None, comm=None):
        """Each metric from every rank, stacked: a (ranks, ...) array (numbers: a (ranks,) array)."""
        c = _comm(mesh or self.mesh, axis_name, comm or self.comm, "DistributedMetrics.all_gather")

        def one(value):
            x = np.array(float(value)) if isinstance(value, numbers.Number) else np.ascontiguousarray(value)
            return c.all_gather(x)

        return _map(metrics, one)

    @staticmethod
    def collect_from_devices(metrics):
        """Splits each array's dimension 0 into a per-rank list (what all_gather stacked); numbers stay."""
        return _map(metrics, lambda v: list(v) if isinstance(v, np.ndarray) and v.ndim > 0 else v)
