"""A 4 KiB all_reduce from Python on the mpi engine (one process per rank, no
shared GIL); compare with `mpirun -np 2 meshtrain bench collectives --engine
mpi --ops all_reduce --min 4K --max 4K` (docs/benchmarks.md).

    mpirun -np 2 python3 bench/python_overhead_mpi.py
"""
import time, numpy as np, meshtrain
def fn(w):
    x = np.ones(1024, dtype=np.float32)
    for _ in range(2000): w.all_reduce(x)
    best = 1e9
    for _ in range(5):
        w.barrier(); t = time.perf_counter()
        for _ in range(20000): w.all_reduce(x)
        best = min(best, (time.perf_counter() - t) / 20000 * 1e6)
    return best
r = meshtrain.launch(fn)
print("python mpi 4K all_reduce us:", [x for x in r if x is not None])
