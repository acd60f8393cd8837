"""A user's own model in numpy, trained data-parallel on meshtrain's engines.

A two-layer MLP (8 -> 16 -> 3, tanh, softmax cross-entropy) with
hand-written gradients, plain SGD, on a fixed synthetic dataset. Each rank
takes its rows of every global batch and all-reduces the summed gradients,
so any number of ranks computes what one rank computes.

    mpirun -np 2 python3 numpy_mlp.py out.npz                       # mpi engine
    meshtrain launch --nproc-per-node 2 -- python3 numpy_mlp.py out.npz   # gloo engine

Rank 0 writes the final parameters and the per-step losses to out.npz.
"""

import sys

import numpy as np

import meshtrain

STEPS = 20
BATCH = 32  # global
LR = 0.5


def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((BATCH * STEPS, 8))
    y = (np.argmax(x[:, :3] + 0.5 * x[:, 3:6], axis=1)).astype(np.int64)
    return x, y


def init():
    rng = np.random.default_rng(42)
    return {"w1": rng.standard_normal((8, 16)) * 0.3, "b1": np.zeros(16),
            "w2": rng.standard_normal((16, 3)) * 0.3, "b2": np.zeros(3)}


def loss_and_grads(p, x, y, n):
    """Cross-entropy summed over these rows / n (the global batch), and its gradients."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    z = h @ p["w2"] + p["b2"]
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.log(prob[np.arange(len(y)), y]).sum() / n
    dz = prob
    dz[np.arange(len(y)), y] -= 1
    dz /= n
    dh = (dz @ p["w2"].T) * (1 - h * h)
    return loss, {"w2": h.T @ dz, "b2": dz.sum(axis=0), "w1": x.T @ dh, "b1": dh.sum(axis=0)}


def train(world):
    """Runs on every rank; returns (parameters, per-step losses)."""
    x, y = data()
    p = init()
    rows = BATCH // world.size
    losses = []
    for step in range(STEPS):
        lo = step * BATCH + world.rank * rows
        loss, g = loss_and_grads(p, x[lo:lo + rows], y[lo:lo + rows], BATCH)
        flat = np.concatenate([g[k].ravel() for k in sorted(g)] + [np.array([loss])])
        world.all_reduce(flat)  # the global batch's gradient and loss, on every rank
        at = 0
        for k in sorted(g):
            p[k] -= LR * flat[at:at + g[k].size].reshape(g[k].shape)
            at += g[k].size
        losses.append(float(flat[-1]))
    return p, losses


if __name__ == "__main__":
    results = meshtrain.launch(train)  # the job's engine: mpi under mpirun, gloo under meshtrain launch
    mine = [r for r in results if r is not None]
    assert len(mine) == 1, results
    params, losses = mine[0]
    if results.index(mine[0]) == 0:
        np.savez(sys.argv[1], losses=np.array(losses), **params)
