#!/usr/bin/python3
"""Writes PyTorch golden files for meshtrain's parity tests (llm.c style).

    /usr/bin/python3 scripts/make_golden.py golden/   # Debian's python3 with python3-torch

For a small MLP, a small VAE, a small GPT and a small Llama-style GPT it stores, in safetensors files: the inputs,
the initial weights (Linear weights transposed to meshtrain's (in, out)
convention), the loss, every gradient after one backward, and the losses of
10 AdamW steps on the same batch (weight decay 0.01 on weights only, as
meshtrain decides by parameter metadata). For two mixture-of-experts layers
(moe_v1) it stores one forward and backward of sum(w * y) + L_aux. The VAE's reparameterization noise
is stored too, so both sides use the same eps. CI never runs this script; it
only reads the committed files (tests/golden_test.cc).
"""
import json
import math
import struct
import sys

import torch

VERSION = 1
torch.manual_seed(1234)
torch.set_default_dtype(torch.float32)


def save(path, tensors, meta):
    header, blobs, offset = {"__metadata__": {k: str(v) for k, v in meta.items()}}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        dtype = {torch.float32: "F32", torch.int64: "I64"}[t.dtype]
        data = t.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def linear_state(prefix, lin, out):
    out[f"init.{prefix}.weight"] = lin.weight.detach().t().clone()  # (in, out)
    out[f"init.{prefix}.bias"] = lin.bias.detach().clone()


def grads(named, out):
    for name, p in named:
        g = p.grad.detach()
        out[f"grad.{name}"] = g.t().clone() if g.dim() == 2 else g.clone()


def adamw(params, lr=1e-3):
    decay = [p for n, p in params if n.endswith("weight")]
    no_decay = [p for n, p in params if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.999), eps=1e-8)


def mlp(outdir):
    sizes = [784, 32, 16, 10]
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    x = torch.rand(8, 784)
    y = torch.randint(0, 10, (8,))
    out = {"x": x, "labels": y}
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    for i, m in enumerate(lin):
        linear_state(f"layers.{i}", m, out)
    params = [(f"layers.{i}.{k}", getattr(m, k)) for i, m in enumerate(lin) for k in ("weight", "bias")]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    out["loss"] = loss.detach().reshape(1)
    grads(params, out)
    opt = adamw(params)
    model.zero_grad()
    losses = []
    for _ in range(10):
        opt.zero_grad()
        l = torch.nn.functional.cross_entropy(model(x), y)
        l.backward()
        opt.step()
        losses.append(l.item())
    out["steps.loss"] = torch.tensor(losses)
    save(f"{outdir}/mlp_v{VERSION}.safetensors", out,
         {"version": VERSION, "torch": torch.__version__, "sizes": sizes, "optimizer": "adamw lr 1e-3 wd 0.01"})


class VAE(torch.nn.Module):
    def __init__(self, hidden=(32, 16), latent=4):
        super().__init__()
        self.enc = torch.nn.ModuleList([torch.nn.Linear(784, hidden[0]), torch.nn.Linear(hidden[0], hidden[1])])
        self.mu = torch.nn.Linear(hidden[1], latent)
        self.logvar = torch.nn.Linear(hidden[1], latent)
        self.dec = torch.nn.ModuleList([torch.nn.Linear(latent, hidden[1]), torch.nn.Linear(hidden[1], hidden[0]),
                                        torch.nn.Linear(hidden[0], 784)])

    def forward(self, x, eps):
        h = x
        for m in self.enc:
            h = torch.relu(m(h))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * eps
        for i, m in enumerate(self.dec):
            z = m(z)
            if i < len(self.dec) - 1:
                z = torch.relu(z)
        recon = torch.nn.functional.binary_cross_entropy_with_logits(z, x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar - mu * mu - logvar.exp()) / x.shape[0]
        return recon, kl


def vae(outdir):
    model = VAE()
    x = torch.rand(8, 784)
    eps = torch.randn(8, 4)
    out = {"x": x, "eps": eps}
    names = {"enc.0": model.enc[0], "enc.1": model.enc[1], "mu": model.mu, "logvar": model.logvar,
             "dec.0": model.dec[0], "dec.1": model.dec[1], "dec.2": model.dec[2]}
    for n, m in names.items():
        linear_state(n, m, out)
    params = [(f"{n}.{k}", getattr(m, k)) for n, m in names.items() for k in ("weight", "bias")]
    recon, kl = model(x, eps)
    (recon + kl).backward()
    out["loss"] = (recon + kl).detach().reshape(1)
    out["recon"] = recon.detach().reshape(1)
    out["kl"] = kl.detach().reshape(1)
    grads(params, out)
    opt = adamw(params)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        r, k = model(x, eps)
        (r + k).backward()
        opt.step()
        losses.append((r + k).item())
    out["steps.loss"] = torch.tensor(losses)
    save(f"{outdir}/vae_v{VERSION}.safetensors", out,
         {"version": VERSION, "torch": torch.__version__, "hidden": [32, 16], "latent": 4,
          "optimizer": "adamw lr 1e-3 wd 0.01"})


def decoder_golden(outdir, name, model, cfg):
    """A decoder's golden file: random ids and targets, the initial weights
    (Linear weights as meshtrain's (in, out)), the loss, every gradient, and
    10 AdamW steps (weight decay on matrices, as meshtrain decides by metadata)."""
    ids = torch.randint(0, cfg["vocab"], (2, cfg["block"]))
    targets = torch.randint(0, cfg["vocab"], (2, cfg["block"]))
    out = {"ids": ids, "targets": targets}
    named = model.named()
    for pname, t, lin in named:
        out[f"init.{pname}"] = t.detach().t().clone() if lin else t.detach().clone()

    def loss_of():
        return torch.nn.functional.cross_entropy(model(ids).view(-1, cfg["vocab"]), targets.view(-1))

    loss = loss_of()
    loss.backward()
    out["loss"] = loss.detach().reshape(1)
    for pname, t, lin in named:
        out[f"grad.{pname}"] = t.grad.detach().t().clone() if lin else t.grad.detach().clone()
    decay = [t for _, t, _ in named if t.dim() == 2]
    no_decay = [t for _, t, _ in named if t.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        l = loss_of()
        l.backward()
        opt.step()
        losses.append(l.item())
    out["steps.loss"] = torch.tensor(losses)
    save(f"{outdir}/{name}_v{VERSION}.safetensors", out,
         dict(cfg, version=VERSION, torch=torch.__version__, optimizer="adamw lr 1e-3 wd 0.01 on matrices"))


class GPT(torch.nn.Module):
    """GPT-2 as meshtrain builds it (nanoGPT's layout): pre-LN blocks, causal
    attention, GELU (tanh), the output head tied to the token embedding."""

    def __init__(self, vocab, block, layers, heads, width):
        super().__init__()
        self.heads = heads
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(block, width)
        self.h = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.ln_1, b.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            b.c_attn, b.attn_proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
            b.c_fc, b.mlp_proj = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
            self.h.append(b)
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, ids):
        bsz, t = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(t))
        for b in self.h:
            q, k, v = b.c_attn(b.ln_1(x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(bsz, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)  # plain causal attention
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = torch.softmax(att, dim=-1) @ v
            x = x + b.attn_proj(a.transpose(1, 2).reshape(bsz, t, -1))
            x = x + b.mlp_proj(torch.nn.functional.gelu(b.c_fc(b.ln_2(x)), approximate="tanh"))
        return torch.nn.functional.linear(self.ln_f(x), self.wte.weight)  # tied head

    def named(self):
        """(meshtrain name, tensor, is_linear_weight) in meshtrain's parameter order."""
        out = [("wte.weight", self.wte.weight, False), ("wpe.weight", self.wpe.weight, False)]
        for i, b in enumerate(self.h):
            p = f"h.{i}"
            for name, m, lin in (("ln_1", b.ln_1, False), ("attn.c_attn", b.c_attn, True),
                                 ("attn.c_proj", b.attn_proj, True), ("ln_2", b.ln_2, False),
                                 ("mlp.c_fc", b.c_fc, True), ("mlp.c_proj", b.mlp_proj, True)):
                out.append((f"{p}.{name}.weight", m.weight, lin))
                out.append((f"{p}.{name}.bias", m.bias, False))
        out += [("ln_f.weight", self.ln_f.weight, False), ("ln_f.bias", self.ln_f.bias, False)]
        return out


def gpt(outdir):
    torch.manual_seed(4321)  # its own stream: writing only this file gives the same values
    cfg = {"vocab": 13, "block": 32, "layers": 2, "heads": 2, "width": 16}
    model = GPT(**cfg)
    with torch.no_grad():  # nonzero LayerNorm and bias values so their gradients are exercised
        for name, t, _ in model.named():
            if not name.startswith(("wte", "wpe")) and not name.endswith("c_attn.weight"):
                t.add_(0.1 * torch.randn_like(t))
    decoder_golden(outdir, "gpt", model, cfg)


class Llama(torch.nn.Module):
    """Llama's decoder as Hugging Face's LlamaForCausalLM computes it (RMSNorm,
    rotate_half rotary embeddings, grouped-query attention, SwiGLU, no biases),
    with the head tied to the token embedding, in meshtrain's GPT container."""

    def __init__(self, vocab, layers, heads, kv_heads, width, ffn, rope_base):
        super().__init__()
        self.heads, self.kv_heads, self.rope_base, self.eps = heads, kv_heads, rope_base, 1e-5
        d = width // heads
        self.wte = torch.nn.Embedding(vocab, width)
        self.h = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.norm1, b.norm2 = torch.nn.Parameter(torch.ones(width)), torch.nn.Parameter(torch.ones(width))
            b.q = torch.nn.Linear(width, heads * d, bias=False)
            b.k = torch.nn.Linear(width, kv_heads * d, bias=False)
            b.v = torch.nn.Linear(width, kv_heads * d, bias=False)
            b.o = torch.nn.Linear(heads * d, width, bias=False)
            b.gate = torch.nn.Linear(width, ffn, bias=False)
            b.up = torch.nn.Linear(width, ffn, bias=False)
            b.down = torch.nn.Linear(ffn, width, bias=False)
            self.h.append(b)
        self.norm = torch.nn.Parameter(torch.ones(width))

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x):  # (B, H, T, D), Hugging Face's rotate_half
        t, d = x.shape[2], x.shape[3]
        inv = 1.0 / (self.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
        return x * cos + half * sin

    def forward(self, ids):
        bsz, t = ids.shape
        x = self.wte(ids)
        for b in self.h:
            a_in = self.rms(x, b.norm1)
            q = b.q(a_in).view(bsz, t, self.heads, -1).transpose(1, 2)
            k = b.k(a_in).view(bsz, t, self.kv_heads, -1).transpose(1, 2)
            v = b.v(a_in).view(bsz, t, self.kv_heads, -1).transpose(1, 2)
            q, k = self.rope(q), self.rope(k)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = torch.softmax(att, dim=-1) @ v
            x = x + b.o(a.transpose(1, 2).reshape(bsz, t, -1))
            m_in = self.rms(x, b.norm2)
            x = x + b.down(torch.nn.functional.silu(b.gate(m_in)) * b.up(m_in))
        return torch.nn.functional.linear(self.rms(x, self.norm), self.wte.weight)  # tied head

    def named(self):
        """(meshtrain name, tensor, is_linear_weight) in meshtrain's parameter order."""
        out = [("wte.weight", self.wte.weight, False)]
        for i, b in enumerate(self.h):
            p = f"h.{i}"
            out += [(f"{p}.input_layernorm.weight", b.norm1, False),
                    (f"{p}.self_attn.q_proj.weight", b.q.weight, True),
                    (f"{p}.self_attn.k_proj.weight", b.k.weight, True),
                    (f"{p}.self_attn.v_proj.weight", b.v.weight, True),
                    (f"{p}.self_attn.o_proj.weight", b.o.weight, True),
                    (f"{p}.post_attention_layernorm.weight", b.norm2, False),
                    (f"{p}.mlp.gate_proj.weight", b.gate.weight, True),
                    (f"{p}.mlp.up_proj.weight", b.up.weight, True),
                    (f"{p}.mlp.down_proj.weight", b.down.weight, True)]
        out.append(("ln_f.weight", self.norm, False))
        return out


def llama(outdir):
    torch.manual_seed(2718)  # its own stream
    cfg = {"vocab": 13, "block": 32, "layers": 2, "heads": 4, "kv_heads": 2, "width": 16, "ffn": 24,
           "rope_base": 10000.0}
    model = Llama(cfg["vocab"], cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["width"], cfg["ffn"],
                  cfg["rope_base"])
    with torch.no_grad():  # norms off 1 so their gradients are exercised
        for name, t, _ in model.named():
            if t.dim() == 1:
                t.add_(0.1 * torch.randn_like(t))
    decoder_golden(outdir, "llama", model, cfg)


class SwiGLU(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate = torch.nn.Linear(width, hidden, bias=False)
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    def named(self, prefix):
        return [(f"{prefix}.gate_proj.weight", self.gate.weight), (f"{prefix}.up_proj.weight", self.up.weight),
                (f"{prefix}.down_proj.weight", self.down.weight)]


class MoE(torch.nn.Module):
    """The mixture-of-experts layer as meshtrain defines it (nn/moe.h): scores
    softmax or sigmoid of a bias-free router, the top_k experts by score + bias
    (lower index on ties), weights the scores (normalized over the k when asked),
    capacity ceil(cf T k / E) per sequence and expert (slot 0 of every step first),
    shared experts, and the sequence-wise Switch/GShard auxiliary loss."""

    def __init__(self, width, hidden, experts, top_k, shared, score, normalize, aux, capacity):
        super().__init__()
        self.e, self.k, self.score, self.normalize, self.aux, self.cf = experts, top_k, score, normalize, aux, capacity
        self.gate = torch.nn.Linear(width, experts, bias=False)
        self.experts = torch.nn.ModuleList(SwiGLU(width, hidden) for _ in range(experts))
        self.shared = SwiGLU(width, shared * hidden) if shared else None
        self.bias = torch.zeros(experts)

    def forward(self, x):
        bsz, t, c = x.shape
        xs = x.reshape(bsz * t, c)
        logits = self.gate(xs)
        s = torch.softmax(logits, -1) if self.score == "softmax" else torch.sigmoid(logits)
        idx = torch.sort(s.detach() + self.bias, dim=-1, descending=True, stable=True).indices[:, : self.k]
        sel = s.gather(1, idx)
        w = sel / sel.sum(-1, keepdim=True) if self.normalize else sel
        kept = torch.ones(bsz * t, self.k, dtype=torch.bool)
        if self.cf > 0:
            cap = math.ceil(self.cf * t * self.k / self.e)
            for b in range(bsz):
                used = [0] * self.e
                for j in range(self.k):
                    for i in range(b * t, (b + 1) * t):
                        e = int(idx[i, j])
                        kept[i, j] = used[e] < cap
                        used[e] += 1
        y = torch.zeros_like(xs)
        for e in range(self.e):
            rows, slots = ((idx == e) & kept).nonzero(as_tuple=True)
            if len(rows):
                y = y.index_add(0, rows, w[rows, slots, None] * self.experts[e](xs[rows]))
        if self.shared is not None:
            y = y + self.shared(xs)
        p = s if self.score == "softmax" else s / s.sum(-1, keepdim=True)
        count = torch.zeros(bsz, self.e)
        for b in range(bsz):
            count[b] = torch.bincount(idx[b * t:(b + 1) * t].reshape(-1), minlength=self.e).float()
        mean_p = p.view(bsz, t, self.e).mean(1)
        aux = (self.aux * self.e / (self.k * t) * (count * mean_p).sum(-1)).mean()
        return y.view(bsz, t, c), aux, int((~kept).sum())

    def named(self, prefix):
        out = [(f"{prefix}.gate.weight", self.gate.weight)]
        for e, m in enumerate(self.experts):
            out += m.named(f"{prefix}.experts.{e}")
        if self.shared is not None:
            out += self.shared.named(f"{prefix}.shared_experts")
        return out


def moe(outdir):
    """Two layers: softmax top-2 with a capacity that drops tokens, and sigmoid
    top-2 with a shared expert and a nonzero selection bias. For each: x, the
    weights w of the loss sum(w * y) + L_aux, initial weights, y, L_aux, the
    dropped count, dx and every gradient."""
    torch.manual_seed(3141)  # its own stream
    out, meta = {}, {"version": VERSION}
    configs = {"soft": dict(width=8, hidden=6, experts=4, top_k=2, shared=0, score="softmax", normalize=True,
                            aux=0.05, capacity=0.75),
               "sig": dict(width=8, hidden=6, experts=4, top_k=2, shared=1, score="sigmoid", normalize=True,
                           aux=0.05, capacity=0.0)}
    for tag, cfg in configs.items():
        layer = MoE(**cfg)
        with torch.no_grad():
            for _, p in layer.named("mlp"):
                p.normal_(0.0, 0.4)
            if tag == "sig":
                layer.bias = torch.tensor([0.0, 0.2, -0.1, 0.05])
        x = torch.randn(3, 5, cfg["width"], requires_grad=True)
        w = torch.randn(3, 5, cfg["width"])
        y, aux, dropped = layer(x)
        ((y * w).sum() + aux).backward()
        meta.update({f"{tag}.{k}": v for k, v in cfg.items()})
        out[f"{tag}.x"], out[f"{tag}.w"], out[f"{tag}.y"] = x.detach(), w, y.detach()
        out[f"{tag}.aux"] = aux.detach().reshape(1)
        out[f"{tag}.dropped"] = torch.tensor([dropped], dtype=torch.int64)
        out[f"{tag}.bias"] = layer.bias.clone()
        out[f"{tag}.grad.x"] = x.grad
        for name, p in layer.named("mlp"):
            out[f"{tag}.init.{name}"] = p.detach().t().clone()  # (in, out)
            out[f"{tag}.grad.{name}"] = p.grad.detach().t().clone()
    save(f"{outdir}/moe_v{VERSION}.safetensors", out, meta)


if __name__ == "__main__":
    # make_golden.py [outdir [mlp|vae|gpt|llama|moe ...]]: every model by default.
    outdir = sys.argv[1] if len(sys.argv) > 1 else "golden"
    wanted = sys.argv[2:] or ["mlp", "vae", "gpt", "llama", "moe"]
    for name in ("mlp", "vae", "gpt", "llama", "moe"):
        if name in wanted:
            globals()[name](outdir)
            print(f"wrote {outdir}/{name}_v{VERSION}.safetensors")
