"""meshtrain from Python: distributed training on a device mesh.

The C++ library's engines, communicators and layouts, driven from Python
(docs/python.md). Arrays cross as numpy arrays without copies; errors are
the C++ ones under the same names and messages, each also a subclass of the
builtin a Python caller expects (``InvalidArgument`` is a ``ValueError``,
``TimeoutError`` a builtin ``TimeoutError``).

    import numpy as np
    import meshtrain

    def step(world):
        x = np.full(4, world.rank + 1.0, dtype=np.float32)
        world.all_reduce(x)          # in place: 1 + 2 + 3 + 4 = 10 everywhere
        return float(x[0])

    meshtrain.launch(step, engine="threads", ranks=4)  # [10.0, 10.0, 10.0, 10.0]
"""

import atexit as _atexit
import os as _os
import sys as _sys

# Idle GEMM threads sleep rather than spin (docs/core.md, "Idle GEMM threads sleep"): libgomp
# and OpenBLAS read these while they load, with the module, so they are set
# first, as the meshtrain command's prepare_libraries sets them (a test keeps
# this table equal to its kIdleWaits). Your own settings win; a process that
# loaded OpenBLAS or libgomp before (numpy's OpenBLAS may be the same
# library) keeps what they read then.
_IDLE_WAITS = (("OMP_WAIT_POLICY", "passive", "GOMP_SPINCOUNT"), ("OPENBLAS_THREAD_TIMEOUT", "10", ""))
for _name, _value, _unless in _IDLE_WAITS:
    if _name not in _os.environ and not (_unless and _unless in _os.environ):
        _os.environ[_name] = _value

# OpenMPI opens its components as plugins that look for libmpi's symbols
# globally: load the module (and the libmpi it links) with RTLD_GLOBAL, as
# mpi4py does, so the mpi engine works under mpirun.
_flags = _sys.getdlopenflags()
_sys.setdlopenflags(_flags | _os.RTLD_GLOBAL)
try:
    from . import _meshtrain  # noqa: F401
finally:
    _sys.setdlopenflags(_flags)

from ._meshtrain import (
    AbortedError,
    CommError,
    Communicator,
    DeviceMesh,
    EngineError,
    Error,
    InvalidArgument,
    Layout,
    IoError,
    MismatchError,
    NamedShape,
    OutOfMemory,
    PartitionSpec,
    RankError,
    ShardedTensor,
    TimeoutError,
    TrainResult,
    Unsupported,
    Work,
    __version__,
    distribute,
    distribute_replicated,
    engine_from_environment,
    gather,
    init,
    is_initialized,
    launch,
    load,
    plan,
    redistribute,
    render_mesh,
    shutdown,
    train,
    visualize_sharding,
)

__all__ = [
    "AbortedError",
    "CommError",
    "Communicator",
    "DeviceMesh",
    "EngineError",
    "Error",
    "InvalidArgument",
    "Layout",
    "IoError",
    "MismatchError",
    "NamedShape",
    "OutOfMemory",
    "PartitionSpec",
    "RankError",
    "ShardedTensor",
    "TimeoutError",
    "TrainResult",
    "Unsupported",
    "Work",
    "__version__",
    "distribute",
    "distribute_replicated",
    "engine_from_environment",
    "gather",
    "init",
    "is_initialized",
    "launch",
    "load",
    "plan",
    "redistribute",
    "render_mesh",
    "shutdown",
    "train",
    "visualize_sharding",
]

# Leave a job joined by init() before the interpreter (and MPI) goes away.
_atexit.register(shutdown)

from . import distributed, scaling  # noqa: E402  (the seeds' names: meshtrain.scaling, meshtrain.distributed)
