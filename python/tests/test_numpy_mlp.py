"""A user's numpy MLP (numpy_mlp.py) trained data-parallel equals the 1-rank
run within 1e-6 after 20 steps: on 4 threads-engine ranks, on 2 mpi ranks
under mpirun and on 2 gloo ranks under `meshtrain launch` (each a separate
Python process importing meshtrain)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import meshtrain

sys.path.insert(0, os.path.dirname(__file__))
import numpy_mlp  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "numpy_mlp.py")
BUILD = os.environ.get("MESHTRAIN_BUILD_DIR", "")


@pytest.fixture(scope="module")
def one_rank():
    (params, losses), = meshtrain.launch(numpy_mlp.train, engine="threads", ranks=1)
    assert losses[-1] < losses[0] - 0.1  # it learns
    return params, losses


def expect_same(params, losses, one_rank):
    want_params, want_losses = one_rank
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    for k in want_params:
        np.testing.assert_allclose(params[k], want_params[k], rtol=1e-6, atol=1e-12)


def test_four_threads_ranks_equal_one(one_rank):
    results = meshtrain.launch(numpy_mlp.train, engine="threads", ranks=4)
    for params, losses in results:
        expect_same(params, losses, one_rank)


def run_job(command, tmp_path):
    out = tmp_path / "out.npz"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    done = subprocess.run(command + [sys.executable, SCRIPT, str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = np.load(out)
    return {k: saved[k] for k in saved.files if k != "losses"}, saved["losses"].tolist()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun")
def test_two_mpi_ranks_under_mpirun_equal_one(one_rank, tmp_path):
    expect_same(*run_job(["mpirun", "-np", "2"], tmp_path), one_rank)


@pytest.mark.skipif(not os.path.exists(os.path.join(BUILD, "cli", "meshtrain")), reason="no meshtrain command")
def test_two_gloo_ranks_under_meshtrain_launch_equal_one(one_rank, tmp_path):
    launcher = [os.path.join(BUILD, "cli", "meshtrain"), "launch", "--nproc-per-node", "2", "--master-port", "0",
                "--"]
    expect_same(*run_job(launcher, tmp_path), one_rank)


def test_the_engine_comes_from_the_environment():
    assert meshtrain.engine_from_environment() == "threads"  # pytest is not started by a launcher
