"""The seeds' scaling quick start (docs of meshtrain.scaling) written against
meshtrain: each example runs and prints what the seeds document, on
meshtrain's rules (every device used, (in, out) weights)."""

import numpy as np
import pytest

import meshtrain
from meshtrain.scaling import mesh_utils, sharding
from meshtrain.scaling.sharding import (DataParallelStrategy, FSDPStrategy, ParallelismConfig,
                                        PipelineParallelStrategy, ShardingConfig, TensorParallelStrategy)


def test_basic_data_parallel_quick_start(capsys):
    devices = 8  # the seeds' len(jax.devices()): meshtrain's devices are a launch's ranks
    config = sharding.ShardingConfig.from_device_count(devices)
    parallel_config = sharding.ParallelismConfig.from_sharding_config(config)
    mesh_manager = mesh_utils.DeviceMeshManager(mesh_shape=parallel_config.mesh_shape,
                                                axis_names=parallel_config.mesh_axis_names)
    mesh = mesh_manager.create_mesh_from_config(parallel_config)
    print(f"Mesh shape: {parallel_config.mesh_shape}")
    print(f"Axis names: {parallel_config.mesh_axis_names}")
    assert mesh.size == devices  # every device used
    assert (mesh.shape, mesh.axis_names) == (parallel_config.mesh_shape, parallel_config.mesh_axis_names)
    assert "Mesh shape: [4, 2]" in capsys.readouterr().out


def test_sharding_config_counts_4_x_2_as_8_devices():
    config = ShardingConfig(data_parallel_size=4, tensor_parallel_size=2, pipeline_parallel_size=1,
                            fsdp_enabled=True, fsdp_min_weight_size=1024)
    assert config.get_total_device_count() == 8  # 4 * 2 * 1 = 8
    parallel_config = ParallelismConfig.from_sharding_config(config)
    assert parallel_config.is_valid()
    assert (parallel_config.mesh_shape, parallel_config.mesh_axis_names) == ([4, 2], ["fsdp", "tensor"])
    with pytest.raises(meshtrain.InvalidArgument):
        ShardingConfig(data_parallel_size=0)


def test_device_mesh_management():
    mesh = mesh_utils.create_device_mesh(mesh_shape=(4, 2), axis_names=("data", "model"))
    assert (mesh.shape, mesh.axis_names, mesh.size) == ([4, 2], ["data", "model"], 8)
    manager = mesh_utils.DeviceMeshManager(mesh_shape=(4, 2), axis_names=("data", "model"))
    assert manager.get_optimal_mesh_shape(device_count=8, dimensions=2) == (2, 4)
    assert manager.get_optimal_mesh_shape(device_count=16, dimensions=2) == (4, 4)  # balanced
    seven = manager.optimize_for_transformer(device_count=8, model_size="7B", sequence_length=2048)
    seventy = manager.optimize_for_transformer(device_count=32, model_size="70B", sequence_length=4096)
    assert np.prod(seven) == 8 and np.prod(seventy) == 32  # every device used
    plan = manager.plan_for_transformer(32, "70B", 4096)
    assert plan.reasons and plan.to_spec()
    assert manager.validate_mesh_config(mesh_shape=(4, 2), device_count=8)
    assert not manager.validate_mesh_config(mesh_shape=(2, 2), device_count=5)  # leaves a device idle


def test_a_mesh_from_a_config_on_eight_ranks():
    parallel_config = ParallelismConfig.from_sharding_config(ShardingConfig(data_parallel_size=4,
                                                                            tensor_parallel_size=2))

    def fn(w):
        mesh = mesh_utils.DeviceMeshManager().create_mesh_from_config(parallel_config, world=w)
        x = np.ones(1, dtype=np.float32)
        mesh.comm("tensor").all_reduce(x)
        return mesh.coords, float(x[0])

    assert meshtrain.launch(fn, ranks=8, timeout=30) == [([r // 2, r % 2], 2.0) for r in range(8)]


def test_the_strategies():
    data = DataParallelStrategy(axis_name="data", mesh_axis=0)
    spec = data.get_partition_spec(("batch", "sequence", "hidden"))
    assert repr(spec) == "PartitionSpec('data', None, None)"

    fsdp = FSDPStrategy(axis_name="fsdp", mesh_axis=0, min_weight_size=1024)
    assert fsdp.should_shard_weight(np.zeros((64, 64)))  # 4096 elements
    assert not fsdp.should_shard_weight(np.zeros((4096,))[:1000])

    tensor = TensorParallelStrategy(axis_name="model", mesh_axis=1, shard_dimension="out_features")
    assert repr(tensor.get_attention_qkv_spec()) == "PartitionSpec(None, 'model')"  # output features
    assert repr(tensor.get_attention_output_spec()) == "PartitionSpec('model', None)"  # input features
    assert repr(tensor.get_linear_weight_spec()) == "PartitionSpec(None, 'model')"

    pipeline = PipelineParallelStrategy(axis_name="pipeline", mesh_axis=2, num_stages=4)
    assert pipeline.assign_layers_to_stages(num_layers=24) == [6, 6, 6, 6]
    assert pipeline.assign_layers_to_stages(num_layers=10) == [3, 3, 2, 2]
    assert pipeline.get_forward_communication_pattern() == [(0, 1), (1, 2), (2, 3)]
    assert pipeline.get_backward_communication_pattern() == [(1, 0), (2, 1), (3, 2)]
    with pytest.raises(meshtrain.InvalidArgument):
        pipeline.assign_layers_to_stages(num_layers=3)  # a stage would be empty


def test_multi_dimensional_parallelism():
    from meshtrain.scaling.sharding import MultiDimensionalStrategy

    # The seeds' example, with FSDP on an axis of its own (HSDP: data x fsdp).
    data_strategy = DataParallelStrategy(axis_name="data", mesh_axis=0)
    tensor_strategy = TensorParallelStrategy(axis_name="tensor", mesh_axis=1, shard_dimension="out_features")
    fsdp_strategy = FSDPStrategy(axis_name="fsdp", mesh_axis=0)
    config = ShardingConfig(data_parallel_size=2, tensor_parallel_size=2, fsdp_enabled=True)
    parallel_config = ParallelismConfig(mesh_shape=[2, 2, 2], mesh_axis_names=["data", "fsdp", "tensor"],
                                        sharding_config=config)
    multi = MultiDimensionalStrategy(strategies={"data": data_strategy, "tensor": tensor_strategy,
                                                 "fsdp": fsdp_strategy}, config=parallel_config)
    batch = multi.get_combined_partition_spec(tensor_name="batch", tensor_shape=("batch", "sequence", "hidden"))
    assert repr(batch) == "PartitionSpec(('data', 'fsdp'), None, None)"  # the batch over data x fsdp
    weight = multi.get_combined_partition_spec("mlp.fc1", ("in_features", "out_features"))
    assert repr(weight) == "PartitionSpec('fsdp', 'tensor')"  # column-parallel, ZeRO-3 over fsdp
    # The seeds' own example puts FSDP and DataParallel on one axis: refused, naming both.
    with pytest.raises(meshtrain.InvalidArgument, match="mesh axis 'data' is claimed by both"):
        MultiDimensionalStrategy(strategies={"data": data_strategy,
                                             "fsdp": FSDPStrategy(axis_name="data", mesh_axis=0)})
    # An axis on two dimensions is refused (the seeds' could return P(model, model)).
    with pytest.raises(meshtrain.InvalidArgument, match="may split only one dimension"):
        multi.resolve_sharding_conflicts("x", {tensor_strategy: meshtrain.PartitionSpec("tensor", None),
                                               fsdp_strategy: meshtrain.PartitionSpec(None, "tensor")})


def test_apply_sharding_gives_each_rank_its_block():
    weight = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)

    def fn(w):
        mesh = meshtrain.DeviceMesh(w, [2, 2], ["data", "tensor"])
        column = TensorParallelStrategy(axis_name="tensor", shard_dimension="out_features").apply_sharding(weight, mesh)
        rows = DataParallelStrategy(axis_name="data").apply_sharding(weight, mesh)
        small = FSDPStrategy(axis_name="data", min_weight_size=1024).apply_sharding(weight, mesh)  # 24 < 1024
        return column.local.tolist(), rows.local.tolist(), small.local.shape

    for r, (column, rows, small) in enumerate(meshtrain.launch(fn, ranks=4, timeout=30)):
        assert column == weight[:, 3 * (r % 2):3 * (r % 2) + 3].tolist()  # out_features over tensor
        assert rows == weight[2 * (r // 2):2 * (r // 2) + 2].tolist()  # the batch dimension over data
        assert small == (4, 6)  # replicated
