"""meshtrain.plan returns what `meshtrain plan --json` prints (the same
prediction, as Python values), and the step time on a preset hardware."""

import json
import os
import subprocess

import pytest

import meshtrain

BUILD = os.environ.get("MESHTRAIN_BUILD_DIR", "")
MESHTRAIN = os.path.join(BUILD, "cli", "meshtrain")
KEYS = ["stage", "tensor_rank", "parameters", "gradients", "optimizer", "working", "activations", "comm_buffers",
        "total", "in_flight", "peak_at"]


@pytest.mark.skipif(not os.path.exists(MESHTRAIN), reason="no meshtrain command")
def test_plan_equals_the_command():
    flags = ["--size", "1.3B", "--mesh", "pipeline=2,fsdp=4", "--fsdp", "zero3", "--micro-batches", "8", "--batch",
             "32", "--seq", "2048", "--precision", "bf16"]
    printed = json.loads(subprocess.run([MESHTRAIN, "plan", *flags, "--json"], capture_output=True, text=True,
                                        check=True, timeout=120).stdout)
    got = meshtrain.plan(size="1.3B", mesh="pipeline=2,fsdp=4", fsdp="zero3", micro_batches=8, batch=32, seq=2048,
                         precision="bf16")
    assert got["model"] == {"vocab": 50257, "seq": 2048, "layers": 24, "heads": 32, "width": 2048}
    assert [{k: d[k] for k in KEYS} for d in got["memory"]] == [{k: d[k] for k in KEYS} for d in printed["devices"]]
    assert got["largest"]["total"] == max(d["total"] for d in printed["devices"])
    assert "time" not in got


def test_the_step_time_and_errors():
    got = meshtrain.plan(size="124M", mesh="data=8", seq=1024, batch=64, hardware="H100")
    assert got["time"]["step"] > 0 and got["time"]["devices"][0]["comm_by_group"]
    with pytest.raises(meshtrain.InvalidArgument, match="--size 9B: no such model"):
        meshtrain.plan(size="9B")
    with pytest.raises(meshtrain.InvalidArgument, match="unknown keyword 'nodes'"):
        meshtrain.plan(nodes=2)
