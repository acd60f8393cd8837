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

from ._meshtrain import (
    AbortedError,
    CommError,
    Communicator,
    EngineError,
    Error,
    InvalidArgument,
    IoError,
    MismatchError,
    OutOfMemory,
    RankError,
    TimeoutError,
    Unsupported,
    Work,
    __version__,
    launch,
)

__all__ = [
    "AbortedError",
    "CommError",
    "Communicator",
    "EngineError",
    "Error",
    "InvalidArgument",
    "IoError",
    "MismatchError",
    "OutOfMemory",
    "RankError",
    "TimeoutError",
    "Unsupported",
    "Work",
    "__version__",
    "launch",
]
