"""meshtrain.load: a run's model as numpy arrays, from its newest checkpoint or
else its model.safetensors (the same numbers), with errors naming the path."""

import os
import shutil
import subprocess

import numpy as np
import pytest

import meshtrain

BUILD = os.environ.get("MESHTRAIN_BUILD_DIR", "")
MESHTRAIN = os.path.join(BUILD, "cli", "meshtrain")


@pytest.mark.skipif(not os.path.exists(MESHTRAIN), reason="no meshtrain command")
def test_a_runs_model_from_its_checkpoint_and_from_its_model_file(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([MESHTRAIN, "train", "--max-steps", "3", "--checkpoint-every", "3", "--hidden", "32",
                           "--threads-per-rank", "1", "--run-dir", str(run)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    from_checkpoint = meshtrain.load(str(run))
    assert {k: v.shape for k, v in from_checkpoint.items()} == {
        "0.weight": (784, 32), "0.bias": (32,), "2.weight": (32, 10), "2.bias": (10,)}
    assert meshtrain.load(str(run), step=3).keys() == from_checkpoint.keys()
    shutil.rmtree(run / "checkpoints")  # now only model.safetensors holds it
    from_file = meshtrain.load(str(run))
    for name, value in from_checkpoint.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(from_file[name], value)
    with pytest.raises(meshtrain.InvalidArgument, match="has no checkpoint of step 7"):
        meshtrain.load(str(run), step=7)


def test_a_directory_without_a_run_is_named(tmp_path):
    with pytest.raises(meshtrain.IoError, match="holds neither checkpoints nor model.safetensors") as info:
        meshtrain.load(str(tmp_path))
    assert isinstance(info.value, OSError) and str(tmp_path) in str(info.value)
