"""Shared set-up of the Python tests: where the built binaries and libmoe.so
are (MOE_BIN_DIR: a build tree, or the flat bin/ of a device bundle), a
checkpoint written by moe-make-model, and a real moe-expert-server on
loopback (shared memory + gRPC) started as a child process."""
import json
import os
import shutil
import struct
import subprocess
import tempfile

import numpy as np

BIN_DIR = os.environ.get("MOE_BIN_DIR", "")


def binary(name, subdir):
    flat = os.path.join(BIN_DIR, name)
    return flat if os.path.exists(flat) else os.path.join(BIN_DIR, subdir, name)


def make_model(directory, preset="tiny", seed=7):
    subprocess.run([binary("moe-make-model", "model"), f"--preset={preset}", f"--out={directory}",
                    f"--seed={seed}"], check=True, stdout=subprocess.DEVNULL)
    return directory


def load_safetensors(directory):
    """{name: float32 array} of every tensor in the checkpoint (bf16/f16/f32), read with numpy only."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    tensors = {}
    for f in files:
        with open(os.path.join(directory, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            data = fh.read()
        for name, t in header.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            raw = data[a:b]
            if t["dtype"] == "BF16":
                arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif t["dtype"] == "F16":
                arr = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
            else:
                arr = np.frombuffer(raw, dtype=np.float32).copy()
            tensors[name] = arr.reshape(t["shape"])
    return tensors


def numpy_moe(tensors, layer, x, ids, w):
    """The SwiGLU MoE in float64 numpy: out[t] = sum_j w * down(silu(gate x) * up x)."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            p = f"model.layers.{layer}.mlp.experts.{e}."
            g = tensors[p + "gate_proj.weight"].astype(np.float64) @ x[t]
            u = tensors[p + "up_proj.weight"].astype(np.float64) @ x[t]
            h = g / (1 + np.exp(-g)) * u
            out[t] += w[t, j] * (tensors[p + "down_proj.weight"].astype(np.float64) @ h)
    return out


def rel_error(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_call(rng, T, H, k, E):
    x = rng.uniform(-1, 1, size=(T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    return x, ids, w


class ExpertServer:
    """moe-expert-server over `model` with --shm-socket and a loopback gRPC port."""

    def __init__(self, model):
        self.dir = tempfile.mkdtemp(prefix="moe_py_")
        self.socket = os.path.join(self.dir, "expert.sock")
        self.proc = subprocess.Popen(
            [binary("moe-expert-server", "expert_server"), "--insecure", f"--model={model}", "--threads=1",
             "--listen=127.0.0.1:0", f"--shm-socket={self.socket}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.address = None
        for line in self.proc.stdout:
            if "ready on " in line:
                self.address = line.split("ready on ", 1)[1].strip()
                break
        if self.address is None:
            self.close()
            raise RuntimeError("moe-expert-server did not come up")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
