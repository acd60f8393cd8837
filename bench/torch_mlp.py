#!/usr/bin/python3
"""PyTorch reference for `meshtrain bench train`: MLP 784-512-512-10, batch 256,
fp32 (or bf16 autocast: --dtype bf16), one thread, AdamW; prints the median
step time (forward, backward, optimizer step) over the timed steps.

    /usr/bin/python3 bench/torch_mlp.py [--steps 200] [--threads 1] [--dtype fp32|bf16]

Needs Debian's python3-torch (installed only for benchmarking, never by CI).
"""
import argparse
import statistics
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--batch", type=int, default=256)
p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.rand(a.batch, 784)
y = torch.randint(0, 10, (a.batch,))
times = []
for i in range(a.warmup + a.steps):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if i >= a.warmup:
        times.append(time.perf_counter() - t0)
med = statistics.median(times)
print(f"torch {torch.__version__} {a.dtype} threads={a.threads} batch={a.batch}: median step {med * 1e3:.3f} ms "
      f"({a.batch / med:.0f} samples/s) over {a.steps} steps")
