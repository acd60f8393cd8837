#!/usr/bin/python3
"""PyTorch peer of `meshtrain bench gpt`: the same GPT-2 (pre-LayerNorm
blocks, causal attention, GELU-tanh MLP, tied head; defaults: the 124M
shape) and the same step (forward, cross-entropy, backward, AdamW) on
synthetic tokens, fp32 (or bf16 autocast: --dtype bf16), N threads. Prints one JSON line: the median step
time over the timed steps.

    /usr/bin/python3 bench/torch_gpt.py [--steps 10] [--threads 2] [--layers 12] ...

Debian's python3-torch (1.13) has no scaled_dot_product_attention, so
attention is the plain masked softmax, as PyTorch users of that version
wrote it (nanoGPT's fallback path). Needs python3-torch (benchmarks only,
never CI).
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=12)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--width", type=int, default=768)
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--context", type=int, default=64)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")  # bf16: autocast, f32 masters
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, c, h, t):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)
        self.register_buffer("mask", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.width)
        self.wpe = nn.Embedding(a.context, a.width)
        self.h = nn.ModuleList(Block(a.width, a.heads, a.context) for _ in range(a.layers))
        self.ln_f = nn.LayerNorm(a.width)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the tied head


model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
x = torch.randint(0, a.vocab, (a.batch, a.context))
y = torch.randint(0, a.vocab, (a.batch, a.context))
times = []
for i in range(a.warmup + a.steps):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        loss = F.cross_entropy(model(x).view(-1, a.vocab).float(), y.view(-1))
    loss.backward()
    opt.step()
    if i >= a.warmup:
        times.append(time.perf_counter() - t0)
print(json.dumps({"torch": torch.__version__, "dtype": a.dtype, "threads": a.threads, "median_step_ms": statistics.median(times) * 1e3,
                  "steps": a.steps, "parameters": sum(q.numel() for q in model.parameters())}))
