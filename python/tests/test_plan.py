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
    assert got["model"] == {"vocab": 50257, "seq": 2048, "layers": 24, "heads": 32, "width": 2048, "arch": "gpt2",
                            "kv_heads": 32, "mlp_hidden": 8192, "experts": 0, "top_k": 2}
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


@pytest.mark.skipif(not os.path.exists(MESHTRAIN), reason="no meshtrain command")
def test_a_mixture_of_experts_by_train_keys_equals_the_command():
    # The blocks by the names meshtrain.train takes; an expert axis halves
    # the experts' parameters on each device.
    flags = ["--layers", "4", "--heads", "8", "--width", "256", "--vocab", "1024", "--seq", "128", "--batch", "8",
             "--arch", "llama", "--kv-heads", "2", "--experts", "8", "--top-k", "2", "--expert-hidden", "128",
             "--mesh", "data=2,expert=2"]
    printed = json.loads(subprocess.run([MESHTRAIN, "plan", *flags, "--json"], capture_output=True, text=True,
                                        check=True, timeout=120).stdout)
    sizes = dict(layers=4, heads=8, width=256, vocab=1024, seq=128, batch=8, arch="llama", kv_heads=2)
    got = meshtrain.plan(**sizes, experts=8, top_k=2, expert_hidden=128, mesh="data=2,expert=2")
    assert got["model"]["arch"] == "llama" and got["model"]["experts"] == 8 and got["model"]["kv_heads"] == 2
    assert [{k: d[k] for k in KEYS} for d in got["memory"]] == [{k: d[k] for k in KEYS} for d in printed["devices"]]
    whole = meshtrain.plan(**sizes, experts=8, top_k=2, expert_hidden=128, mesh="data=4")
    experts = 4 * 8 * 3 * 256 * 128  # elements of the routed experts
    assert whole["largest"]["elements"] - got["largest"]["elements"] == experts // 2
    uneven = meshtrain.plan(**sizes, experts=8, top_k=2, expert_hidden=128, mesh="data=2,expert=2",
                            expert_imbalance=1.5)
    assert uneven["largest"]["activations"] > got["largest"]["activations"]
    with pytest.raises(meshtrain.InvalidArgument, match="--experts: 8 experts over an expert axis of 3"):
        meshtrain.plan(**sizes, experts=8, mesh="expert=3")
