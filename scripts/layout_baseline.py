#!/usr/bin/env python3
"""Records, or checks, what a fixed set of training runs computes.

A refactoring that must not change behaviour (issue: one training layout)
is checked with it: record on the commit before the change, check after
it. Each run trains a small model for a few steps on the threads engine
with one BLAS thread per rank; the record keeps every step's training loss
(as the trainer printed it, 17 significant digits) and a SHA-256 of every
final parameter's bytes. "Identical" means bit-identical on the same CPU:
GEMM libraries pick kernels by CPU, so a record names its CPU and ISA and is
only compared on the same ones.

  scripts/layout_baseline.py record OUT.json [--meshtrain BIN]
  scripts/layout_baseline.py check  OUT.json [--meshtrain BIN] [--only NAME]
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile

COMMON = ["--epochs", "1", "--log-every", "1", "--threads-per-rank", "1", "--max-steps", "4"]
MLP = ["--model", "mlp", "--hidden", "48,32", "--batch-size", "64"] + COMMON
VAE = ["--model", "vae", "--hidden", "64", "--latent", "8", "--batch-size", "64"] + COMMON
GPT = ["--model", "gpt", "--vocab", "512", "--seq-len", "16", "--layers", "4", "--heads", "4", "--width", "32",
       "--batch-size", "16"] + COMMON

RUNS = {
    # one per strategy
    "mlp_1": MLP,
    "mlp_data2": MLP + ["--mesh", "data=2"],
    "mlp_fsdp2_full": MLP + ["--mesh", "fsdp=2", "--fsdp", "full"],
    "mlp_fsdp2_zero1": MLP + ["--mesh", "fsdp=2", "--fsdp", "zero1"],
    "mlp_fsdp2_zero2_bf16": MLP + ["--mesh", "fsdp=2", "--fsdp", "zero2", "--mixed-precision", "bf16"],
    "mlp_fsdp2_shard_grad_op_fp16": MLP + ["--mesh", "fsdp=2", "--fsdp", "shard_grad_op", "--mixed-precision", "fp16"],
    "mlp_tensor2": MLP + ["--mesh", "tensor=2"],
    "mlp_pipeline2": MLP + ["--mesh", "pipeline=2", "--micro-batches", "4"],
    "mlp_zeropp": MLP + ["--mesh", "node=2,fsdp=2", "--fsdp", "zero3", "--zeropp", "qwz,qgz,hpz"],
    "mlp_hybrid": MLP + ["--mesh", "data=2,fsdp=2", "--fsdp", "hybrid_full"],
    "mlp_sgd_dropout": MLP + ["--mesh", "data=2", "--optimizer", "sgd", "--dropout", "0.1", "--clip-norm", "1"],
    "vae_1": VAE,
    "vae_fsdp2": VAE + ["--mesh", "fsdp=2", "--fsdp", "full"],
    "gpt_1": GPT,
    "gpt_data2_dropout": GPT + ["--mesh", "data=2", "--dropout", "0.1"],
    "gpt_fsdp2_zero3": GPT + ["--mesh", "fsdp=2", "--fsdp", "zero3"],
    "gpt_tensor2": GPT + ["--mesh", "tensor=2"],
    "gpt_tensor2_sp": GPT + ["--mesh", "tensor=2", "--sequence-parallel"],
    "gpt_pipeline2_1f1b": GPT + ["--mesh", "pipeline=2", "--micro-batches", "4"],
    "gpt_pipeline2_gpipe": GPT + ["--mesh", "pipeline=2", "--micro-batches", "4", "--pipeline-schedule", "gpipe"],
    "gpt_pipeline2_interleaved": GPT + ["--mesh", "pipeline=2", "--micro-batches", "4", "--pipeline-schedule",
                                        "interleaved", "--virtual-stages", "2"],
    "gpt_pipeline2_zb": GPT + ["--mesh", "pipeline=2", "--micro-batches", "4", "--pipeline-schedule", "zb"],
    "gpt_context2_ring": GPT + ["--mesh", "context=2"],
    "gpt_context2_a2a": GPT + ["--mesh", "context=2", "--cp-comm", "all_to_all"],
    "gpt_recompute_bf16": GPT + ["--recompute", "true", "--mixed-precision", "bf16", "--mesh", "fsdp=2"],
    # combinations
    "gpt_data2_tensor2": GPT + ["--mesh", "data=2,tensor=2"],
    "gpt_fsdp2_tensor2_sp": GPT + ["--mesh", "fsdp=2,tensor=2", "--sequence-parallel"],
    "gpt_data2_tensor2_pipeline2": GPT + ["--mesh", "data=2,tensor=2,pipeline=2", "--micro-batches", "2"],
    "gpt_fsdp2_context2_tensor2": GPT + ["--mesh", "fsdp=2,context=2,tensor=2", "--fsdp", "full"],
    "gpt_data2_context2": GPT + ["--mesh", "data=2,context=2"],
    "gpt_zeropp": GPT + ["--mesh", "node=2,fsdp=2", "--fsdp", "zero3", "--zeropp", "qwz,hpz"],
}


def cpu_model():
    """The CPU's name, family, model and vector extensions (GEMM kernels follow them)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                info[k.strip()] = v.strip()
    except OSError:
        return platform.processor()
    flags = set(info.get("flags", "").split())
    ext = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in flags]
    return (f"{info.get('model name', '?')} family {info.get('cpu family', '?')} model {info.get('model', '?')} "
            f"({','.join(ext)})")


def parameter_hashes(path):
    """SHA-256 of each tensor's dtype, shape and bytes, by name."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, entry in sorted(header.items()):
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        h = hashlib.sha256()
        h.update(json.dumps([entry["dtype"], entry["shape"]]).encode())
        h.update(data[begin:end])
        out[name] = h.hexdigest()
    return out


def run_one(binary, args, work, cache):
    run_dir = os.path.join(work, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [binary, "train"] + args + ["--run-dir", run_dir, "--text-cache", cache]
    # The GEMM backends of the recorded runs: oneDNN, f32 weight gradients on
    # OpenBLAS (the auto policy's choices are measured, so they may differ
    # between processes; core/matmul.h).
    env = dict(os.environ, MESHTRAIN_GEMM_BACKEND="fixed")
    p = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                       env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}")
    losses = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if m.get("split") == "train":
                losses.append(repr(m["loss"]))
            elif "loss" in m:
                losses.append(f"{m.get('split')}:{m['loss']!r}")
    return {"args": args, "losses": losses, "parameters": parameter_hashes(os.path.join(run_dir, "model.safetensors"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["record", "check"])
    ap.add_argument("file")
    ap.add_argument("--meshtrain", default="build/release/cli/meshtrain")
    ap.add_argument("--only", default="", help="run only the runs whose name contains this")
    a = ap.parse_args()
    binary = os.path.abspath(a.meshtrain)
    env_isa = os.environ.get("MESHTRAIN_CPU_ISA", "native")
    cache = os.path.abspath(os.path.join(os.path.dirname(binary), "layout-baseline-text"))
    want = None
    if a.mode == "check":
        with open(a.file) as f:
            want = json.load(f)
        if want["cpu"] != cpu_model() or want["isa"] != env_isa:
            raise SystemExit(f"{a.file} was recorded on {want['cpu']} (MESHTRAIN_CPU_ISA={want['isa']}); this is "
                             f"{cpu_model()} ({env_isa}): record the baseline commit {want['commit']} here first")
    got = {"cpu": cpu_model(), "isa": env_isa, "commit": subprocess.run(
        ["git", "rev-parse", "HEAD"], stdout=subprocess.PIPE, text=True).stdout.strip(), "runs": {}}
    bad = 0
    with tempfile.TemporaryDirectory(prefix="meshtrain-baseline-") as work:
        for name, args in RUNS.items():
            if a.only and a.only not in name:
                continue
            r = run_one(binary, args, work, cache)
            got["runs"][name] = r
            if want is None:
                print(f"{name:32s} {len(r['losses'])} losses, {len(r['parameters'])} parameters", flush=True)
                continue
            w = want["runs"].get(name)
            if w is None:
                print(f"{name:32s} not in the record", flush=True)
                bad += 1
            elif w["losses"] != r["losses"] or w["parameters"] != r["parameters"]:
                diff = [k for k in w["parameters"] if w["parameters"].get(k) != r["parameters"].get(k)]
                print(f"{name:32s} DIFFERS: losses {'same' if w['losses'] == r['losses'] else 'differ'}; "
                      f"parameters differing: {diff[:5]}{' ...' if len(diff) > 5 else ''}", flush=True)
                print(f"  recorded {w['losses']}\n  now      {r['losses']}", flush=True)
                bad += 1
            else:
                print(f"{name:32s} identical", flush=True)
    if want is None:
        with open(a.file, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
        print(f"recorded {len(got['runs'])} runs in {a.file}")
    elif bad:
        raise SystemExit(f"{bad} run(s) differ from {a.file}")
    else:
        print(f"all {len(got['runs'])} runs bit-identical to {a.file}")


if __name__ == "__main__":
    main()
