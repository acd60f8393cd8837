"""Sharding configs and strategies by the seeds' names.

``ShardingConfig`` and ``ParallelismConfig`` are meshtrain's
(config/sharding_config.h). The strategies take the seeds' constructor
arguments (``axis_name``, ``mesh_axis``, ...) and answer with meshtrain's
rules (sharding/strategy.h, docs/strategies.md): linear weights are
(in_features, out_features), sizes are element counts, a mesh axis splits at
most one dimension. ``mesh_axis`` is kept for the seeds' signature; as in
the seeds, nothing reads it.
"""

import numpy as np

from .. import _meshtrain

PartitionSpec = _meshtrain.PartitionSpec
ShardingConfig = _meshtrain.ShardingConfig
ParallelismConfig = _meshtrain.ParallelismConfig

__all__ = [
    "DataParallelStrategy",
    "FSDPStrategy",
    "MultiDimensionalStrategy",
    "ParallelismConfig",
    "PartitionSpec",
    "PipelineParallelStrategy",
    "ShardingConfig",
    "ShardingStrategy",
    "TensorParallelStrategy",
]


class ShardingStrategy:
    """A rule from tensors to PartitionSpecs over one mesh axis."""

    def __init__(self, axis_name, mesh_axis=0):
        self.axis_name = axis_name
        self.mesh_axis = mesh_axis

    def get_partition_spec(self, dim_names):
        """The spec of a tensor whose dimensions are named ``dim_names``."""
        raise NotImplementedError

    def get_sharding_constraints(self):
        """{"axis_name": ..., "mesh_axis": ...}: the strategy's axis (mesh_axis is kept, unread, as in the seeds)."""
        return {"axis_name": self.axis_name, "mesh_axis": self.mesh_axis}

    _kind = "other"  # the merge order of MultiDimensionalStrategy

    def _array_spec(self, array):
        """The spec apply_sharding gives an array by its shape (replicated by default)."""
        return PartitionSpec(*[None] * np.ndim(array))

    def apply_sharding(self, array, mesh):
        """This rank's block of ``array`` (held whole by every rank) as a meshtrain.ShardedTensor on the
        DeviceMesh, split by the strategy's rule for an array of that shape (no communication)."""
        array = np.ascontiguousarray(array)
        layout = _meshtrain.Layout(mesh, self._array_spec(array), list(array.shape))
        return _meshtrain.distribute_replicated(array, layout)

    def _describe(self):
        return f"{type(self).__name__}({self.axis_name})"


class DataParallelStrategy(ShardingStrategy):
    """The batch split over ``axis_name``; parameters replicated."""

    _kind = "data"

    def __init__(self, axis_name="data", mesh_axis=0):
        super().__init__(axis_name, mesh_axis)

    def get_partition_spec(self, dim_names):
        """The axis on the dimension named "batch" (the first one); replicated without one (a weight).

        ``("batch", "sequence", "hidden")`` -> ``PartitionSpec('data', None, None)``.
        One dimension only: the seeds' put the axis on every dimension named
        "batch", which no mesh can lay out.
        """
        names = list(dim_names)
        if "batch" not in names:
            return PartitionSpec(*[None for _ in names])
        return _meshtrain._batch_spec(self.axis_name, len(names), names.index("batch"))

    def _array_spec(self, array):  # apply_sharding: a batch's dimension 0
        return _meshtrain._batch_spec(self.axis_name, np.ndim(array), 0) if np.ndim(array) else PartitionSpec()


class FSDPStrategy(ShardingStrategy):
    """ZeRO-3 over ``axis_name``: weights with at least ``min_weight_size`` elements are sharded."""

    _kind = "fsdp"

    def __init__(self, axis_name="fsdp", mesh_axis=0, min_weight_size=1024):
        super().__init__(axis_name, mesh_axis)
        self.min_weight_size = min_weight_size

    def _describe(self):
        return f"FSDPStrategy({self.axis_name}, min_weight_size={self.min_weight_size})"

    def get_partition_spec(self, dim_names):
        """The batch dimension of a batch (named "batch"), else dimension 0 of a weight (ZeRO-3: every
        rank holds a slice of dimension 0, as meshtrain's FSDP shards; the seeds' required it to be named
        out_features, features or hidden)."""
        names = list(dim_names)
        at = names.index("batch") if "batch" in names else 0
        return PartitionSpec(*[self.axis_name if i == at else None for i in range(len(names))])

    def _array_spec(self, array):  # apply_sharding: dimension 0 when large enough, else replicated
        if np.ndim(array) == 0 or not self.should_shard_weight(array):
            return PartitionSpec(*[None] * np.ndim(array))
        return PartitionSpec(self.axis_name, *[None] * (np.ndim(array) - 1))

    def should_shard_weight(self, weight):
        """True when ``weight`` (an array or a shape) has at least min_weight_size elements.

        meshtrain counts elements (the seeds' compared the first dimension).
        """
        shape = getattr(weight, "shape", weight)
        numel = 1
        for n in shape:
            numel *= int(n)
        return _meshtrain._fsdp_large_enough(numel, self.min_weight_size)


class TensorParallelStrategy(ShardingStrategy):
    """Layers split over ``axis_name`` (Megatron's column and row splits).

    Weights are (in_features, out_features). ``shard_dimension`` picks the
    linear weights' split: "out_features" (column-parallel, the default) or
    "in_features" (row-parallel).
    """

    _kind = "tensor"

    def __init__(self, axis_name="tensor", mesh_axis=1, shard_dimension=None):
        super().__init__(axis_name, mesh_axis)
        if shard_dimension not in (None, "out_features", "in_features"):
            raise _meshtrain.InvalidArgument(
                f"TensorParallelStrategy: shard_dimension '{shard_dimension}' (hint: use out_features, "
                "in_features or None)")
        self.shard_dimension = shard_dimension
        self._specs = _meshtrain._tensor_specs(axis_name)

    def get_attention_qkv_spec(self):
        """Column-parallel: the output features split, ``PartitionSpec(None, axis)``."""
        return self._specs["attention_qkv"]

    def get_attention_output_spec(self):
        """Row-parallel: the input features split, ``PartitionSpec(axis, None)``."""
        return self._specs["attention_output"]

    def get_linear_weight_spec(self):
        """The linear weight's spec for ``shard_dimension`` (out_features: column, in_features: row).

        The seeds' assumed (out, in) weights here and (in, out) for attention;
        meshtrain's are (in, out) everywhere.
        """
        return self._specs["row_weight" if self.shard_dimension == "in_features" else "column_weight"]

    def _array_spec(self, array):  # apply_sharding: a 2-D weight by the linear rule, else the last dimension
        if np.ndim(array) == 2:
            return self.get_linear_weight_spec()
        if np.ndim(array) == 0:
            return PartitionSpec()
        return PartitionSpec(*[None] * (np.ndim(array) - 1), self.axis_name)

    def get_partition_spec(self, dim_names):
        """The axis on the dimension named ``shard_dimension`` (else "hidden"): the first one only."""
        names = list(dim_names)
        target = self.shard_dimension or "hidden"
        return PartitionSpec(*[self.axis_name if n == target and names.index(n) == i else None
                               for i, n in enumerate(names)])


class PipelineParallelStrategy(ShardingStrategy):
    """Layers cut into ``num_stages`` consecutive stages over ``axis_name``."""

    _kind = "pipeline"

    def __init__(self, axis_name="pipeline", mesh_axis=0, num_stages=1):
        super().__init__(axis_name, mesh_axis)
        self.num_stages = num_stages

    def assign_layers_to_stages(self, num_layers):
        """Layers per stage, balanced by count: 24 layers on 4 stages -> [6, 6, 6, 6].

        A stage is never empty: fewer layers than stages raise InvalidArgument
        (the seeds' returned [1, 1, 1, 0]).
        """
        return _meshtrain._assign_layers_to_stages(self.axis_name, self.num_stages, num_layers)

    def get_forward_communication_pattern(self):
        """(sender, receiver) stage pairs of the activations: stage i to i + 1."""
        return [(i, i + 1) for i in range(self.num_stages - 1)]

    def get_backward_communication_pattern(self):
        """(sender, receiver) stage pairs of the gradients: stage i + 1 to i."""
        return [(i + 1, i) for i in range(self.num_stages - 1)]

    def get_partition_spec(self, dim_names):
        """Replicated within a stage: ``PartitionSpec(None, ...)``."""
        return PartitionSpec(*[None for _ in dim_names])


# The order strategies are applied in (docs/strategies.md): for a weight
# pipeline, tensor, other, FSDP, data (FSDP shards what a tensor rank holds);
# for a batch (a dimension named "batch") data, FSDP, then the rest.
_WEIGHT_ORDER = ["pipeline", "tensor", "other", "fsdp", "data"]
_BATCH_ORDER = ["data", "fsdp", "pipeline", "tensor", "other"]


class MultiDimensionalStrategy:
    """Several strategies, each on its own mesh axis, combined into one spec per tensor.

    meshtrain's rules (sharding/multi_dimensional.h, docs/strategies.md):
    one strategy per mesh axis (the seeds' allowed DataParallel and FSDP to
    share one; here that is refused, naming both: HSDP is DataParallel("data")
    + FSDP("fsdp")); two strategies on one dimension give a multi-axis entry,
    outer first; a mesh axis on two dimensions is an error (the seeds' could
    return P(model, model)). ``config`` is kept for the seeds' signature: its
    mesh axes, when given, must include every strategy's axis.
    """

    def __init__(self, strategies, config=None):
        self.strategies = dict(strategies)
        self.config = config
        owners = {}
        for s in self.strategies.values():
            if s.axis_name in owners:
                raise _meshtrain.InvalidArgument(
                    f"MultiDimensionalStrategy: mesh axis '{s.axis_name}' is claimed by both "
                    f"{owners[s.axis_name]._describe()} and {s._describe()} (hint: one strategy per mesh axis; "
                    "HSDP is DataParallelStrategy('data') with FSDPStrategy('fsdp'))")
            owners[s.axis_name] = s
        if config is not None:
            missing = [a for a in owners if a not in list(config.mesh_axis_names)]
            if missing:
                raise _meshtrain.InvalidArgument(
                    f"MultiDimensionalStrategy: strategies on {missing} but the mesh has "
                    f"{list(config.mesh_axis_names)} (hint: name the strategies' axes after the mesh's)")

    def _merge(self, tensor_name, specs, ndim):
        dims = [[] for _ in range(ndim)]
        where = {}  # axis -> (dimension, strategy)
        for strategy, spec in specs:
            for d, axes in enumerate(spec.dims):
                for axis in axes:
                    if axis in where and where[axis][0] != d:
                        raise _meshtrain.InvalidArgument(
                            f"MultiDimensionalStrategy.get_combined_partition_spec: tensor '{tensor_name}': mesh "
                            f"axis '{axis}' is put on dimension {where[axis][0]} by {where[axis][1]} and on "
                            f"dimension {d} by {strategy._describe()} (hint: a mesh axis may split only one "
                            "dimension)")
                    if axis not in dims[d]:
                        dims[d].append(axis)
                        where[axis] = (d, strategy._describe())
        return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims])

    def get_combined_partition_spec(self, tensor_name, tensor_shape):
        """The spec of tensor ``tensor_name`` whose dimensions are named ``tensor_shape`` (the seeds'
        name for the dimension names), every strategy's axes merged by the rules above."""
        names = list(tensor_shape)
        order = _BATCH_ORDER if "batch" in names else _WEIGHT_ORDER
        ranked = sorted(self.strategies.values(), key=lambda s: order.index(s._kind))
        return self._merge(tensor_name, [(s, s.get_partition_spec(names)) for s in ranked], len(names))

    def resolve_sharding_conflicts(self, tensor_name, strategy_specs):
        """Merges {strategy: spec} in the given order by the same rules (an empty dict: PartitionSpec())."""
        if not strategy_specs:
            return PartitionSpec()
        ndim = max(len(spec) for spec in strategy_specs.values())
        return self._merge(tensor_name, list(strategy_specs.items()), ndim)

