"""meshtrain.init() joins the job this process belongs to and keeps its world
until shutdown() (or exit): in this process (a world of one rank), inside
launch() (the rank's world), under mpirun and under `meshtrain launch`."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import meshtrain

SCRIPT = os.path.join(os.path.dirname(__file__), "init_job.py")
BUILD = os.environ.get("MESHTRAIN_BUILD_DIR", "")
MESHTRAIN = os.path.join(BUILD, "cli", "meshtrain")


def test_a_process_without_a_launcher_is_a_world_of_one():
    world = meshtrain.init()
    try:
        assert (world.rank, world.size) == (0, 1) and meshtrain.is_initialized()
        x = np.arange(4, dtype=np.float32)
        world.all_reduce(x)
        assert x.tolist() == [0, 1, 2, 3]
        assert meshtrain.init().size == 1  # the same job again
        with pytest.raises(meshtrain.InvalidArgument, match="already joined a threads job"):
            meshtrain.init(engine="mpi")
    finally:
        meshtrain.shutdown()
    assert not meshtrain.is_initialized()
    with pytest.raises(meshtrain.InvalidArgument, match="after its job ended"):
        world.barrier()
    meshtrain.shutdown()  # twice: nothing to do


def test_inside_launch_init_is_the_ranks_world():
    def rank(world):
        w = meshtrain.init()
        x = np.array([1.0], dtype=np.float32)
        w.all_reduce(x)
        return w.rank == world.rank, w.size, float(x[0]), meshtrain.is_initialized()

    assert meshtrain.launch(rank, engine="threads", ranks=3) == [(True, 3, 3.0, True)] * 3
    assert not meshtrain.is_initialized()


def test_an_engine_that_cannot_start_raises_and_leaves_nothing_joined():
    with pytest.raises(meshtrain.InvalidArgument, match="RANK is not set"):
        meshtrain.init(engine="gloo", timeout=5)
    assert not meshtrain.is_initialized()


def run(command, engine, *extra):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    done = subprocess.run(command + [sys.executable, SCRIPT, engine, *extra], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}{done.stderr}"
    # (mpirun forwards each process's output as it comes; a line's newline may arrive after the other's line)
    lines = sorted(re.findall(rf"rank \d of \d engine {engine}: sum \d+ max \d+", done.stdout))
    assert lines == [f"rank {r} of 2 engine {engine}: sum 3 max 1" for r in range(2)], done.stdout


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun")
@pytest.mark.parametrize("extra", [(), ("atexit",)])
def test_two_processes_under_mpirun(extra):
    run(["mpirun", "-np", "2"], "mpi", *extra)


@pytest.mark.skipif(not os.path.exists(MESHTRAIN), reason="no meshtrain command")
@pytest.mark.parametrize("extra", [(), ("atexit",)])
def test_two_processes_under_meshtrain_launch(extra):
    run([MESHTRAIN, "launch", "--nproc-per-node", "2", "--master-port", "0", "--"], "gloo", *extra)


def test_the_package_sets_the_idle_waits_the_command_sets():
    # libgomp and OpenBLAS read them while they load, so __init__ sets them
    # before the module loads; prepare_libraries (C++) sets the same for the command.
    from meshtrain import _IDLE_WAITS, _meshtrain
    assert _IDLE_WAITS == _meshtrain._idle_waits
    code = "import os, meshtrain; print(os.environ['OMP_WAIT_POLICY'], os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60).stdout.split() == ["passive", "10"]
    env["GOMP_SPINCOUNT"] = "1000"  # the user's own setting wins
    code = "import os, meshtrain; print('OMP_WAIT_POLICY' in os.environ)"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60).stdout.split() == ["False"]
