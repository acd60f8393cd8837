"""What a collective costs from Python beside the same call from C++, in one run.

    PYTHONPATH=build/release/python python3 bench/python_overhead.py [--meshtrain build/release/cli/meshtrain]

For each size, the time per blocking all_reduce on 2 threads-engine ranks
(best of 5 runs of a loop) from Python (meshtrain.launch, numpy arrays),
then from C++ (`meshtrain bench collectives --engine threads --ranks 2`,
run as a subprocess right after), and the difference; then the peak
resident memory an all_reduce of a 256 MiB array adds (no copy: the
engines read and write the array itself). docs/benchmarks.md records the
results with the CPU model.
"""

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time

import numpy as np

import meshtrain


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def python_us(nbytes, iterations):
    def fn(w):
        x = np.ones(nbytes // 4, dtype=np.float32)
        for _ in range(iterations // 10):
            w.all_reduce(x)
        best = float("inf")
        for _ in range(5):
            w.barrier()
            start = time.perf_counter()
            for _ in range(iterations):
                w.all_reduce(x)
            best = min(best, (time.perf_counter() - start) / iterations * 1e6)
        return best

    return max(meshtrain.launch(fn, engine="threads", ranks=2, bind_to_cores=True))


def cpp_us(meshtrain_bin, nbytes):
    with tempfile.TemporaryDirectory() as tmp:
        rows = os.path.join(tmp, "rows.jsonl")
        subprocess.run([meshtrain_bin, "bench", "collectives", "--engine", "threads", "--ranks", "2", "--ops",
                        "all_reduce", "--min", str(nbytes), "--max", str(nbytes), "--json", rows],
                       check=True, capture_output=True)
        with open(rows) as f:
            return json.loads(f.readline())["time_us"]


def peak_rss_added_by_all_reduce(mib):
    def fn(w):
        x = np.ones(mib << 18, dtype=np.float32)  # mib MiB, touched
        w.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        w.barrier()
        w.all_reduce(x)
        w.barrier()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert x[0] == w.size
        return (after - before) / 1024  # KiB -> MiB

    return max(meshtrain.launch(fn, engine="threads", ranks=2))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_bin = os.path.join(here, "..", "build", "release", "cli", "meshtrain")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--meshtrain", default=default_bin, help="the meshtrain command (for the C++ rows)")
    args = parser.parse_args()
    print(f"meshtrain {meshtrain.__version__}, {cpu_model()}, {os.cpu_count()} cores; threads engine, 2 ranks")
    print(f"{'all_reduce':>10} {'python (us)':>12} {'c++ (us)':>9} {'difference':>11}")
    for nbytes in [4096, 65536, 1 << 20]:
        py = python_us(nbytes, 20000 if nbytes <= 65536 else 2000)
        cpp = cpp_us(args.meshtrain, nbytes)
        print(f"{nbytes // 1024:>8} K {py:>12.2f} {cpp:>9.2f} {py - cpp:>+10.2f}")
    print(f"peak resident memory added by an all_reduce of a 256 MiB array (2 ranks, 512 MiB held): "
          f"{peak_rss_added_by_all_reduce(256):.1f} MiB")


if __name__ == "__main__":
    main()
