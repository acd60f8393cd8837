"""Ctrl-C during meshtrain.train: every rank stops after the same step, the
run directory is not committed (its checkpoint kept for resume when
checkpoint_every is set), and KeyboardInterrupt is raised saying so. Run in
a child Python process that sends itself SIGINT while it trains."""

import json
import os
import subprocess
import sys

import meshtrain

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mlp_fashion.toml")

CHILD = r"""
import os, signal, sys, threading, time
import meshtrain
run_dir, checkpoint_every = sys.argv[1], int(sys.argv[2])
# SIGINT once the first step has been logged (metrics.jsonl has a row).
def interrupt():
    staging = run_dir + ".incomplete/metrics.jsonl"
    while not (os.path.exists(staging) and os.path.getsize(staging) > 0):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    meshtrain.train(config=sys.argv[3], mesh="data=2", devices=2, threads_per_rank=1, log_every=1,
                    checkpoint_every=checkpoint_every, run_dir=run_dir)
except KeyboardInterrupt as e:
    print("KeyboardInterrupt:", e)
    sys.exit(0)
print("finished without an interrupt")
sys.exit(1)
"""


def interrupt(run_dir, checkpoint_every):
    done = subprocess.run([sys.executable, "-c", CHILD, str(run_dir), str(checkpoint_every), EXAMPLE],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [x for x in done.stdout.splitlines() if x.startswith("KeyboardInterrupt:")]
    assert line, done.stdout
    return line[0]


def test_ctrl_c_stops_the_ranks_and_keeps_the_checkpoint_for_resume(tmp_path):
    run_dir = tmp_path / "run"
    message = interrupt(run_dir, 100000)
    step = int(message.split("stopped after step ")[1].split()[0])
    assert f"stopped after step {step} of 2340 (SIGINT): {run_dir} was not committed" in message
    assert f"keeps the checkpoint of step {step} (hint: continue with --resume {run_dir})" in message
    assert 1 <= step < 2340
    assert not (run_dir / "metrics.jsonl").exists()  # not committed
    staging = tmp_path / "run.incomplete"
    assert (staging / "checkpoints" / f"step_{step:08d}").is_dir()
    # Every rank stopped after that step: the log's last row is it, and resuming continues from it.
    rows = [json.loads(x) for x in (staging / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step
    result = meshtrain.train(resume=str(run_dir), max_steps=step + 3, threads_per_rank=1)
    assert result.steps == step + 3 and (run_dir / "metrics.jsonl").exists()


def test_without_checkpoints_nothing_is_left(tmp_path):
    run_dir = tmp_path / "run"
    message = interrupt(run_dir, 0)
    assert "was not committed and nothing was kept (hint: set --checkpoint-every N" in message
    assert not run_dir.exists() and not (tmp_path / "run.incomplete").exists()


def test_python_handles_ctrl_c_again_after_training(tmp_path):
    child = ("import os, signal, sys, time, meshtrain\n"
             "meshtrain.train(config=sys.argv[1], max_steps=1, threads_per_rank=1, run_dir=sys.argv[2])\n"
             "try:\n"
             "    os.kill(os.getpid(), signal.SIGINT)\n"
             "    time.sleep(5)\n"
             "except KeyboardInterrupt:\n"
             "    print('python raised KeyboardInterrupt')\n")
    done = subprocess.run([sys.executable, "-c", child, EXAMPLE, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "python raised KeyboardInterrupt" in done.stdout, done.stdout + done.stderr
