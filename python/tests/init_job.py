"""A script that joins its job with meshtrain.init() (test_init.py runs it
under mpirun and `meshtrain launch`): an all_reduce on the world, a mesh and
its axis communicators, then shutdown() (or, with a second argument
"atexit", leaves that to the interpreter's exit); prints one line per rank."""

import sys

import numpy as np

import meshtrain

world = meshtrain.init(timeout=60)
assert meshtrain.init() is not None and meshtrain.is_initialized()
x = np.full(3, world.rank + 1.0, dtype=np.float32)
world.all_reduce(x)
mesh = meshtrain.DeviceMesh(world, [world.size], ["data"])
y = np.array([world.rank], dtype=np.float64)
mesh.comm("data").all_reduce(y, op="max")
print(f"rank {world.rank} of {world.size} engine {sys.argv[1]}: sum {x[0]:g} max {y[0]:g}", flush=True)
if sys.argv[2:] == ["atexit"]:
    sys.exit(0)
meshtrain.shutdown()
assert not meshtrain.is_initialized()
try:
    world.barrier()
except meshtrain.InvalidArgument as e:
    assert "after its job ended" in str(e)
else:
    raise AssertionError("the world worked after shutdown()")
