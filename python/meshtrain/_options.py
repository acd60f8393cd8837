"""The seeds' training options (FSDP2Config, ZeroPlusPlusConfig, the context-parallel group) as meshtrain.train options.

Each is a frozen dataclass with the seeds' fields and defaults; its
``train_options()`` gives the ``meshtrain.train`` keys (those of
``meshtrain train``'s ``[train]`` and ``[distributed]`` sections) it stands
for, so ``meshtrain.train(fsdp=FSDP2Config(...))`` trains what
``meshtrain train --fsdp full --mixed-precision bf16 ...`` trains. The values
are checked on construction by meshtrain's own parsers (the C++ messages);
what meshtrain cannot do is refused there, naming the field.
"""

import dataclasses
from typing import Optional

from . import _meshtrain

# Foreign spellings of the training precisions (numpy's, torch's) onto
# meshtrain's names; meshtrain's parser checks the result.
_PRECISION_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def _precision(value):
    if isinstance(value, str):
        name = value
    elif hasattr(value, "name"):  # a numpy dtype
        name = value.name
    elif isinstance(value, type):  # a numpy scalar type (np.float16)
        name = value.__name__
    else:  # torch.bfloat16 prints as that
        name = str(value)
    name = name.removeprefix("torch.")
    return _PRECISION_ALIASES.get(name, name)


def _refuse(cls, field, value, hint):
    raise _meshtrain.InvalidArgument(f"{cls}: {field}={value!r} (hint: {hint})")


@dataclasses.dataclass(frozen=True)
class FSDP2Config:
    """Fully sharded data parallelism (the seeds' FSDP2Config) as meshtrain.train options.

    ``sharding_strategy`` is meshtrain's ``fsdp`` key: full (ZeRO-3),
    shard_grad_op (ZeRO-2), no_shard, hybrid_full, hybrid_shard_grad_op
    (HSDP over a mesh with data and fsdp axes), or zero1/zero2/zero3.
    ``mixed_precision`` with ``compute_dtype`` (bf16, fp16, fp32; numpy's and
    torch's names too) is the dtype parameters are gathered and computed in;
    ``reduce_dtype`` the dtype gradients are reduced in (``reduce_precision``).
    ``param_dtype`` is the optimizer's master copy, which meshtrain keeps in
    fp32 (the seeds ignored the field). ``backward_prefetch`` backward_pre,
    backward_post or None; ``forward_prefetch``;
    ``activation_checkpointing`` recomputes each GPT block in backward
    (``recompute``).

    What meshtrain always does, whatever the field says: at most one unit
    gathered ahead (``limit_all_gathers``), parameters addressed by their
    own names in checkpoints and exports (``use_orig_params``), identical
    initialization on every rank without a broadcast
    (``sync_module_states``). Refused with the reason: CPU offload (the CPU
    engines keep everything in host memory already), an auto-wrap policy
    other than "transformer" (meshtrain's recipes make each block, and the
    embeddings, one unit).
    """

    sharding_strategy: str = "full"
    mixed_precision: bool = True
    compute_dtype: object = "bf16"
    param_dtype: object = "fp32"
    reduce_dtype: object = "fp32"
    cpu_offload: bool = False
    cpu_offload_params: bool = False
    cpu_offload_grads: bool = False
    backward_prefetch: Optional[str] = "backward_pre"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    sync_module_states: bool = True
    auto_wrap_policy: Optional[str] = "transformer"
    auto_wrap_min_params: int = 1_000_000
    activation_checkpointing: bool = False

    def __post_init__(self):
        for field in ("cpu_offload", "cpu_offload_params", "cpu_offload_grads"):
            if getattr(self, field):
                _refuse("FSDP2Config", field, True,
                        "meshtrain's CPU engines keep parameters, gradients and optimizer state in host memory "
                        "already, so there is nothing to offload; leave it False")
        if _precision(self.param_dtype) != "fp32":
            _refuse("FSDP2Config", "param_dtype", self.param_dtype,
                    "meshtrain's optimizer keeps fp32 master parameters; set compute_dtype for the dtype "
                    "parameters are gathered and computed in")
        if self.auto_wrap_policy != "transformer":
            _refuse("FSDP2Config", "auto_wrap_policy", self.auto_wrap_policy,
                    "meshtrain's recipes shard each transformer block (and the embeddings) as one unit; use "
                    "\"transformer\"")
        _meshtrain._check_train_options(self.train_options(), "FSDP2Config")

    def train_options(self):
        """The meshtrain.train keys this config stands for."""
        prefetch = {"backward_pre": "pre", "backward_post": "post", None: "none"}
        return {
            "fsdp": self.sharding_strategy,
            "mixed_precision": _precision(self.compute_dtype) if self.mixed_precision else "no",
            "reduce_precision": _precision(self.reduce_dtype) if self.mixed_precision else "",
            "forward_prefetch": bool(self.forward_prefetch),
            "backward_prefetch": prefetch.get(self.backward_prefetch, str(self.backward_prefetch)),
            "recompute": bool(self.activation_checkpointing),
        }


@dataclasses.dataclass(frozen=True)
class ZeroPlusPlusConfig:
    """ZeRO++ (the seeds' ZeroPlusPlusConfig) as meshtrain.train options (docs/zeropp.md).

    ``quantize_weights`` (qwZ), ``quantize_gradients`` (qgZ) and
    ``hierarchical_partition`` (hpZ) make the ``zeropp`` key; the bits (8 or
    4) and ``block_size`` (values per f32 scale) its code width and block.
    It runs under ``fsdp="full"`` (zero3; qgZ alone also under zero2) over a
    mesh ``node=K,fsdp=L``: ``secondary_group_size``, when given, must be L
    (the ranks per node; None takes the mesh's).

    Where meshtrain differs (docs/python.md): qgZ sums dequantized values in
    fp32 (DeepSpeed's two-step all-to-all), never int8 codes, and keeps no
    error-feedback residual, so ``use_error_feedback`` defaults to False and
    True is refused; 6-bit codes are refused (8 or 4, int4 packed two per
    byte). ZeRO++ composes with a pipeline axis whenever the mesh has one,
    so ``use_pipeline_parallelism`` (unused by the seeds too) changes
    nothing.
    """

    quantize_weights: bool = True
    quantize_gradients: bool = True
    hierarchical_partition: bool = True
    weight_quantization_bits: int = 8
    gradient_quantization_bits: int = 8
    block_size: int = 64
    use_error_feedback: bool = False
    secondary_group_size: Optional[int] = None
    use_pipeline_parallelism: bool = False

    def __post_init__(self):
        if self.use_error_feedback:
            _refuse("ZeroPlusPlusConfig", "use_error_feedback", True,
                    "meshtrain's qgZ reduces dequantized fp32 values (DeepSpeed's design) and keeps no residual; "
                    "leave it False")
        _meshtrain._check_train_options(self.train_options(), "ZeroPlusPlusConfig")

    def train_options(self):
        """The meshtrain.train keys this config stands for."""
        parts = [name for name, on in (("qwz", self.quantize_weights), ("qgz", self.quantize_gradients),
                                       ("hpz", self.hierarchical_partition)) if on]
        options = {
            "zeropp": ",".join(parts),
            "zeropp_bits": int(self.weight_quantization_bits),
            "zeropp_grad_bits": int(self.gradient_quantization_bits),
            "zeropp_block": int(self.block_size),
        }
        if self.secondary_group_size is not None:
            options["zeropp_secondary_group_size"] = int(self.secondary_group_size)
        return options


@dataclasses.dataclass(frozen=True)
class ContextParallelConfig:
    """Context parallelism (the seeds' context-parallel group) as meshtrain.train options (docs/training.md).

    ``cp_size`` ranks split each sequence (the ``context_parallel_size``,
    a ``context`` mesh axis); ``comm`` is "ring" (K/V blocks passed around
    the ring, as the seeds' ring attention) or "all_to_all" (DeepSpeed
    Ulysses: heads scattered, the sequence gathered); ``load_balance``
    gives each rank sequence chunks i and 2n-1-i, evening out causal
    attention. The recipe checks at start-up that the sequence splits
    into the chunks.
    """

    cp_size: int = 1
    comm: str = "ring"
    load_balance: bool = True

    def __post_init__(self):
        _meshtrain._check_train_options(self.train_options(), "ContextParallelConfig")

    def train_options(self):
        """The meshtrain.train keys this config stands for."""
        return {"context_parallel_size": int(self.cp_size), "cp_comm": self.comm,
                "cp_load_balance": bool(self.load_balance)}


def init_context_parallel_group(cp_size, world):
    """The seeds' init_context_parallel_group: ``world``'s ranks in contiguous groups of ``cp_size``.

    Returns this rank's group (a Communicator, rank = world.rank % cp_size),
    split collectively from ``world`` (every rank calls it). cp_size must
    divide the world's size (InvalidArgument otherwise). For training,
    give the trainer a ``context`` mesh axis instead (ContextParallelConfig).
    """
    if not isinstance(cp_size, int) or cp_size < 1 or world.size % cp_size:
        raise _meshtrain.InvalidArgument(
            f"init_context_parallel_group: cp_size {cp_size!r} does not divide the world's {world.size} ranks "
            f"(hint: use a divisor of {world.size})")
    return world.split(world.rank // cp_size, world.rank % cp_size)
