"""The seeds' configs in meshtrain.distributed: DistributedConfig (the seeds'
fields, defaults and validation, meshtrain's messages), and FSDP2Config,
ZeroPlusPlusConfig and ContextParallelConfig as meshtrain.train options
that train exactly what the keys they stand for train."""

import os
import subprocess
import sys

import numpy as np
import pytest

import meshtrain
from meshtrain.distributed import (
    ContextParallelConfig,
    DistributedConfig,
    FSDP2Config,
    ZeroPlusPlusConfig,
    init_context_parallel_group,
)

# ---- DistributedConfig ----------------------------------------------------------------


def test_the_seeds_validation_example():
    # The seeds' guide: 2 nodes x 4 processes, tensor 2 x pipeline 2 -> 2 data-parallel ranks.
    # (The seeds' default backend is nccl; meshtrain's is threads, which runs on one node.)
    config = DistributedConfig(enabled=True, world_size=8, num_nodes=2, num_processes_per_node=4,
                               tensor_parallel_size=2, pipeline_parallel_size=2, backend="gloo")
    assert config.get_data_parallel_size() == 2
    assert config.is_main_process() and config.is_local_main_process()
    # A pipeline-only or mixed config keeps every axis (the seeds lost pipeline when tp was 1).
    assert config.get_mesh_config() == {"mesh_shape": (2, 2, 2), "axis_names": ("pipeline", "data", "tensor")}
    assert DistributedConfig(world_size=4, pipeline_parallel_size=2).get_mesh_config() == {
        "mesh_shape": (2, 2), "axis_names": ("pipeline", "data")}


def test_the_seeds_data_parallel_script_config():
    config = DistributedConfig(enabled=True, world_size=8, num_nodes=2, num_processes_per_node=4, backend="gloo",
                               master_addr="localhost", master_port=29500, rank=5, local_rank=1,
                               mesh_shape=(8,), mesh_axis_names=("data",))
    assert (config.mesh_shape, config.mesh_axis_names) == ((8,), ("data",))
    assert config.mesh.to_spec() == "data=8"
    assert not config.is_main_process() and not config.is_local_main_process()


def test_defaults_are_the_seeds_but_the_engine():
    c = DistributedConfig()
    assert (c.enabled, c.world_size, c.rank, c.local_rank, c.num_nodes, c.num_processes_per_node) == (
        False, 1, 0, 0, 1, 1)
    assert (c.master_addr, c.master_port, c.tensor_parallel_size, c.pipeline_parallel_size) == (
        "localhost", 29500, 1, 1)
    assert (c.mesh_shape, c.mesh_axis_names, c.mixed_precision, c.backend) == (None, None, "no", "threads")


@pytest.mark.parametrize("keys, message", [
    (dict(world_size=0), "world_size: 0 is outside [1, 2147483647]"),
    (dict(rank=-1), "rank: -1 is outside [0, 2147483647]"),
    (dict(master_port=80), "master_port: 80 is outside [1024, 65535]"),
    (dict(world_size=4, rank=4), "rank 4 is not below world_size 4"),
    (dict(world_size=8, num_nodes=2, num_processes_per_node=3, backend="gloo"),
     "world_size 8 != num_nodes 2 x num_processes_per_node 3 = 6"),
    (dict(world_size=8, num_nodes=2), "backend threads runs every rank in one process, but num_nodes is 2"),
    (dict(world_size=8, tensor_parallel_size=3), "does not divide world_size 8"),
    (dict(world_size=4, mesh_shape=(2, 2)), "the mesh has 2 sizes (2, 2) but 0 axis names"),
    (dict(mesh_axis_names=("data",)), "mesh_axis_names (data) given without mesh_shape"),
    (dict(world_size=8, mesh_shape=(2, 2), mesh_axis_names=("data", "tensor"), tensor_parallel_size=2),
     "uses 4 of 8 devices, leaving 4 idle"),
    # The seeds' guide names the tensor axis "model"; meshtrain's is "tensor".
    (dict(world_size=4, mesh_shape=(2, 2), mesh_axis_names=("data", "model"), tensor_parallel_size=2),
     "mesh axis 'model' is not one of pipeline, data, node, fsdp, expert, context, tensor"),
    (dict(wrold_size=4), "unknown key 'wrold_size' (hint: did you mean 'world_size'?"),
    (dict(world_size="4"), "world_size must be an int, got str '4'"),
    (dict(enabled=1), "enabled must be a bool, got int 1"),
    (dict(backend="nvlink"), "backend"),
    (dict(mixed_precision="fp8"), "precision 'fp8'"),
])
def test_validation_names_the_broken_rule(keys, message):
    with pytest.raises(meshtrain.InvalidArgument) as e:
        DistributedConfig(**keys)
    assert message in str(e.value)
    assert str(e.value).startswith("DistributedConfig: ")


def test_dict_toml_and_replace_round_trip():
    c = DistributedConfig(enabled=True, world_size=4, backend="gloo", mesh_shape=(2, 2),
                          mesh_axis_names=("data", "tensor"), tensor_parallel_size=2, mixed_precision="bf16")
    assert DistributedConfig.from_dict(c.to_dict()) == c
    assert DistributedConfig.from_toml(c.to_toml()) == c
    d = c.replace(mesh_shape=None, mesh_axis_names=None, tensor_parallel_size=1)
    assert d.mesh.to_spec() == "data=4" and c.mesh.to_spec() == "data=2,tensor=2"
    with pytest.raises(meshtrain.InvalidArgument, match="unknown key 'name'"):
        DistributedConfig.from_dict({"name": "run", "world_size": 2})  # strict, as the seeds' from_dict
    with pytest.raises(AttributeError):
        c.world_size = 8  # frozen, as the seeds' dataclass


def test_from_environment_reads_the_launchers_variables():
    code = ("from meshtrain.distributed import DistributedConfig; c = DistributedConfig.from_environment(); "
            "print(c.enabled, c.rank, c.world_size, c.local_rank, c.num_nodes, c.launcher, c.backend)")
    env = dict(os.environ, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1",
               MASTER_PORT="29400")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "3", "4", "1", "2", "torchrun", "gloo"]


# ---- the training options --------------------------------------------------------------


def test_the_options_map_onto_meshtrain_train_keys():
    assert FSDP2Config().train_options() == {
        "fsdp": "full", "mixed_precision": "bf16", "reduce_precision": "fp32", "forward_prefetch": False,
        "backward_prefetch": "pre", "recompute": False}
    assert FSDP2Config(mixed_precision=False, backward_prefetch=None).train_options()["mixed_precision"] == "no"
    assert FSDP2Config(backward_prefetch=None).train_options()["backward_prefetch"] == "none"
    assert FSDP2Config(compute_dtype=np.float16).train_options()["mixed_precision"] == "fp16"
    assert FSDP2Config(compute_dtype="bfloat16").train_options()["mixed_precision"] == "bf16"
    assert ZeroPlusPlusConfig().train_options() == {
        "zeropp": "qwz,qgz,hpz", "zeropp_bits": 8, "zeropp_grad_bits": 8, "zeropp_block": 64}
    assert ZeroPlusPlusConfig(quantize_weights=False, gradient_quantization_bits=4,
                              secondary_group_size=2).train_options() == {
        "zeropp": "qgz,hpz", "zeropp_bits": 8, "zeropp_grad_bits": 4, "zeropp_block": 64,
        "zeropp_secondary_group_size": 2}
    assert ContextParallelConfig(cp_size=4).train_options() == {
        "context_parallel_size": 4, "cp_comm": "ring", "cp_load_balance": True}


@pytest.mark.parametrize("make, message", [
    (lambda: FSDP2Config(sharding_strategy="zero4"), "FSDP2Config: TrainConfig: fsdp: fsdp 'zero4'"),
    (lambda: FSDP2Config(cpu_offload=True), "FSDP2Config: cpu_offload=True (hint: meshtrain's CPU engines"),
    (lambda: FSDP2Config(param_dtype="bf16"), "keeps fp32 master parameters"),
    (lambda: FSDP2Config(compute_dtype="fp8"), "precision 'fp8'"),
    (lambda: FSDP2Config(backward_prefetch="later"), "backward_prefetch 'later'"),
    (lambda: FSDP2Config(auto_wrap_policy="size_based"), "auto_wrap_policy='size_based'"),
    (lambda: ZeroPlusPlusConfig(weight_quantization_bits=6), "ZeroPlusPlusConfig: TrainConfig::validate: "
                                                             "zeropp_bits 6 (hint: use 8 or 4)"),
    (lambda: ZeroPlusPlusConfig(use_error_feedback=True), "keeps no residual"),
    (lambda: ZeroPlusPlusConfig(block_size=1), "zeropp_block"),
    (lambda: ContextParallelConfig(cp_size=0), "context_parallel_size"),
    (lambda: ContextParallelConfig(comm="tree"), "use ring or all_to_all"),
])
def test_options_refuse_what_meshtrain_cannot_do(make, message):
    with pytest.raises(meshtrain.InvalidArgument) as e:
        make()
    assert message in str(e.value)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """A tiny GPT's meshtrain.train keys (2 blocks of width 32 on one fortunes file: about a second a run)."""
    root = tmp_path_factory.mktemp("gpt")
    runs = iter(range(1000))

    def keys(**more):
        return dict(model="gpt", corpus="/usr/share/games/fortunes/computers", text_cache=str(root / "text"),
                    vocab=512, context=16, layers=2, heads=4, width=32, batch_size=8, max_steps=4,
                    threads_per_rank=1, log_every=1, lr=0.01, fsdp_min_weight_size=64,
                    run_dir=str(root / f"run{next(runs)}"), **more)

    return keys


def test_fsdp2config_trains_what_its_keys_train(gpt):
    options = FSDP2Config(sharding_strategy="full", compute_dtype="bf16", reduce_dtype="fp32",
                          forward_prefetch=True, backward_prefetch="backward_post", activation_checkpointing=True)
    a = meshtrain.train(**gpt(mesh="fsdp=2", fsdp=options))
    b = meshtrain.train(**gpt(mesh="fsdp=2", fsdp="full", mixed_precision="bf16", reduce_precision="fp32",
                              forward_prefetch=True, backward_prefetch="post", recompute=True))
    assert a.step_losses == b.step_losses and len(a.step_losses) == 4
    f32 = meshtrain.train(**gpt(mesh="fsdp=2", fsdp=FSDP2Config(mixed_precision=False)))
    assert f32.step_losses != a.step_losses  # bf16 really ran
    np.testing.assert_allclose(f32.step_losses, meshtrain.train(**gpt()).step_losses, rtol=1e-5)


def test_zeroplusplusconfig_trains_what_its_keys_train(gpt):
    mesh = "node=2,fsdp=2"
    a = meshtrain.train(**gpt(mesh=mesh, fsdp=FSDP2Config(mixed_precision=False),
                              zeropp=ZeroPlusPlusConfig(block_size=32, secondary_group_size=2)))
    b = meshtrain.train(**gpt(mesh=mesh, fsdp="full", zeropp="qwz,qgz,hpz", zeropp_block=32))
    assert a.step_losses == b.step_losses
    with pytest.raises(meshtrain.InvalidArgument, match="secondary_group_size 4 is not the mesh node=2,fsdp=2's "
                                                        "ranks per node"):
        meshtrain.train(**gpt(mesh=mesh, fsdp="full", zeropp=ZeroPlusPlusConfig(secondary_group_size=4)))


def test_contextparallelconfig_trains_what_a_context_axis_trains(gpt):
    a = meshtrain.train(**gpt(distributed=DistributedConfig(world_size=4),
                              context_parallel=ContextParallelConfig(cp_size=2, comm="all_to_all")))
    b = meshtrain.train(**gpt(mesh="data=2,context=2", cp_comm="all_to_all"))
    assert a.step_losses == b.step_losses
    np.testing.assert_allclose(a.step_losses, meshtrain.train(**gpt()).step_losses, rtol=1e-5)
    with pytest.raises(meshtrain.InvalidArgument,
                       match=r"context_parallel_size=2 but the job's mesh data=2 makes it 1"):
        meshtrain.train(**gpt(mesh="data=2", context_parallel=ContextParallelConfig(cp_size=2)))


def test_a_key_given_twice_differently_is_an_error(gpt):
    with pytest.raises(meshtrain.InvalidArgument,
                       match="mixed_precision is bf16 by fsdp=FSDP2Config but fp16 by mixed_precision"):
        meshtrain.train(**gpt(fsdp=FSDP2Config(), mixed_precision="fp16"))
    with pytest.raises(meshtrain.InvalidArgument, match="distributed= takes a meshtrain.distributed"):
        meshtrain.train(**gpt(distributed={"world_size": 2}))


def test_init_context_parallel_group_groups_contiguous_ranks():
    def rank(world):
        cp = init_context_parallel_group(2, world)
        x = np.array([world.rank], dtype=np.float32)
        cp.all_reduce(x)
        return cp.size, cp.rank, float(x[0])

    assert meshtrain.launch(rank, engine="threads", ranks=4) == [(2, 0, 1.0), (2, 1, 1.0), (2, 0, 5.0), (2, 1, 5.0)]
    with pytest.raises(meshtrain.RankError, match="cp_size 3 does not divide the world's 4 ranks"):
        meshtrain.launch(lambda w: init_context_parallel_group(3, w), engine="threads", ranks=4)
