"""meshtrain.train runs the trainer as `meshtrain train` does: the MLP example
on data=2 with the same settings gives the same losses and test metrics as
the command (both written to metrics.jsonl), and returns them."""

import json
import os
import subprocess

import pytest

import meshtrain

BUILD = os.environ.get("MESHTRAIN_BUILD_DIR", "")
MESHTRAIN = os.path.join(BUILD, "cli", "meshtrain")
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mlp_fashion.toml")


def metrics(run_dir):
    """(split, step, loss, accuracy) of every row of metrics.jsonl (not the timings)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["split"], r["step"], r["loss"], r.get("accuracy")) for r in rows]


@pytest.mark.skipif(not os.path.exists(MESHTRAIN), reason="no meshtrain command")
def test_the_mlp_example_on_data_2_equals_the_command(tmp_path):
    settings = ["--mesh", "data=2", "--devices", "2", "--max-steps", "20", "--threads-per-rank", "1"]
    done = subprocess.run([MESHTRAIN, "train", "--config", EXAMPLE, *settings, "--run-dir", str(tmp_path / "cli")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = meshtrain.train(config=EXAMPLE, mesh="data=2", devices=2, max_steps=20, threads_per_rank=1,
                             run_dir=str(tmp_path / "python"))
    assert result.steps == 20 and len(result.step_losses) == 20
    assert result.run_dir == str(tmp_path / "python")
    assert metrics(result.run_dir) == metrics(tmp_path / "cli")
    assert result.test_metrics["accuracy"] == metrics(tmp_path / "cli")[-1][3]
    assert "test accuracy" in result.test_summary


def test_bad_settings_name_the_key():
    with pytest.raises(meshtrain.InvalidArgument, match="max_steps"):
        meshtrain.train(max_steps=-3)
    with pytest.raises(meshtrain.InvalidArgument, match="no_such_key"):
        meshtrain.train(no_such_key=1)
