"""meshtrain.train runs the trainer as `meshtrain train` does: the MLP example
on data=2 with the same settings gives the same losses and test metrics as
the command (both written to metrics.jsonl; the GEMM backends shared through
MESHTRAIN_GEMM_CACHE), and returns them."""

import json
import os
import subprocess
import sys

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
    # Same bits need the same GEMM backends: the command measures them per
    # shape class and writes them to a cache file, which the Python run
    # (its own process, as a user's would be) then reads.
    env = dict(os.environ, MESHTRAIN_GEMM_CACHE=str(tmp_path / "gemm.json"))
    settings = ["--mesh", "data=2", "--devices", "2", "--max-steps", "20", "--threads-per-rank", "1"]
    done = subprocess.run([MESHTRAIN, "train", "--config", EXAMPLE, *settings, "--run-dir", str(tmp_path / "cli")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    script = (
        "import json, meshtrain\n"
        f"r = meshtrain.train(config={EXAMPLE!r}, mesh='data=2', devices=2, max_steps=20, threads_per_rank=1, "
        f"run_dir={str(tmp_path / 'python')!r})\n"
        "print(json.dumps({'steps': r.steps, 'losses': len(r.step_losses), 'run_dir': r.run_dir, "
        "'accuracy': r.test_metrics['accuracy'], 'summary': r.test_summary}))\n")
    py = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert py.returncode == 0, py.stdout + py.stderr
    result = json.loads(py.stdout.strip().splitlines()[-1])
    assert result["steps"] == 20 and result["losses"] == 20
    assert result["run_dir"] == str(tmp_path / "python")
    assert metrics(result["run_dir"]) == metrics(tmp_path / "cli")
    assert result["accuracy"] == metrics(tmp_path / "cli")[-1][3]
    assert "test accuracy" in result["summary"]


def test_bad_settings_name_the_key():
    with pytest.raises(meshtrain.InvalidArgument, match="max_steps"):
        meshtrain.train(max_steps=-3)
    with pytest.raises(meshtrain.InvalidArgument, match="no_such_key"):
        meshtrain.train(no_such_key=1)


def test_a_resume_on_fewer_devices_is_replanned_as_the_command_does(tmp_path, capfd):
    run = str(tmp_path / "run")
    meshtrain.train(hidden="64,32", batch_size=64, mesh="data=4", max_steps=10, checkpoint_every=10,
                    threads_per_rank=1, run_dir=run)
    r = meshtrain.train(resume=run, devices=2, max_steps=20, threads_per_rank=1)
    assert r.steps == 20
    out = capfd.readouterr().out
    assert "# resuming on 2 devices: mesh data=4 -> data=2" in out
    assert "# micro_batches = 2 (was 1)" in out
    with open(os.path.join(run, "metrics.jsonl")) as f:
        changes = [json.loads(line) for line in f if "layout_change" in line]
    assert [(c["from"], c["to"], c["reason"], c["step"]) for c in changes] == [
        ("mesh data=4 (data parallel 4)", "mesh data=2 (data parallel 2)", "resumed", 10)]


def test_a_gpt_that_does_not_fit_the_devices_memory_is_refused():
    with pytest.raises(meshtrain.InvalidArgument, match=r"--device-memory: the run needs .* per device on 1 device "):
        meshtrain.train(model="gpt", vocab=512, layers=2, heads=2, width=64, context=32, batch_size=16,
                        device_memory="1MiB", max_steps=1)
