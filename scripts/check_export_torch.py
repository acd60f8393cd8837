#!/usr/bin/env python3
"""Load a `meshtrain export` of the MLP into torch.nn.Sequential and print its
Fashion-MNIST test accuracy (compare it with the run's "final test accuracy").

    meshtrain export --run-dir runs/mlp/version_0 --out mlp.safetensors
    /usr/bin/python3 scripts/check_export_torch.py mlp.safetensors

Needs Debian's python3-torch; reads the safetensors format itself (an 8-byte
header length, a JSON header, raw data), so the safetensors package is not
needed. The tests never run this.
"""
import gzip
import json
import struct
import sys

import torch

DATA = "/usr/share/datasets/fashion-mnist"


def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        a, b = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[base + a:base + b]), dtype=torch.float32).reshape(t["shape"])
    return out


def main():
    state = load(sys.argv[1])
    linears = sorted({int(k.split(".")[0]) for k in state}, key=int)
    layers = []
    for i, idx in enumerate(linears):
        w = state[f"{idx}.weight"]
        while len(layers) < idx:  # ReLU (and dropout) modules between the Linears keep PyTorch's numbering
            layers.append(torch.nn.ReLU() if len(layers) == idx - 1 else torch.nn.Dropout(0.0))
        layers.append(torch.nn.Linear(w.shape[1], w.shape[0]))
    model = torch.nn.Sequential(*layers)
    model.load_state_dict(state, strict=True)
    images = gzip.open(f"{DATA}/t10k-images-idx3-ubyte.gz").read()[16:]
    labels = gzip.open(f"{DATA}/t10k-labels-idx1-ubyte.gz").read()[8:]
    x = torch.frombuffer(bytearray(images), dtype=torch.uint8).reshape(-1, 784).float() / 255.0
    y = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
    with torch.no_grad():
        accuracy = (model.eval()(x).argmax(1) == y).float().mean().item()
    print(f"{sys.argv[1]}: torch.nn.Sequential {[type(m).__name__ for m in model]}, load_state_dict(strict=True), "
          f"test accuracy {100 * accuracy:.2f}%")


if __name__ == "__main__":
    main()
