#!/usr/bin/env python3
"""Python-call overhead per MoE layer call: the same call through (1) the C
ABI called straight with prepared pointers (ctypes; the C++ call plus one
foreign call), (2) Session.forward_layer with numpy arrays, (3) MoeLayer with torch
tensors (CPU, and CUDA with the current stream when a GPU is there), (4) a
capturable call (CUDA). Every expert cached (all hits) on a synthetic model,
so the service's own work is small and the wrapper's share shows. Prints a
markdown table with the machine; the target is <= 20 us of Python over (1).

  MOE_LIBRARY=build/c_api/libmoe.so PYTHONPATH=python python3 bench/python_overhead.py \
      --server-bin build/expert_server/moe-expert-server [--preset qwen3-30b-a3b --layers 2]
"""
import argparse
import ctypes
import os
import platform
import subprocess
import tempfile
import time

import numpy as np

import moe_expert_service as moe
from moe_expert_service import _lib


def timed(fn, iters):
    for _ in range(max(iters // 10, 3)):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server-bin", required=True)
    ap.add_argument("--preset", default="tiny", help="synthetic model preset")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    model = f"synthetic:{a.preset}:layers={a.layers}:seed=1"
    d = tempfile.mkdtemp(prefix="moe_bench_py_")
    sock = os.path.join(d, "e.sock")
    server = subprocess.Popen([a.server_bin, "--insecure", f"--model={model}", "--listen=127.0.0.1:0",
                               f"--shm-socket={sock}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in server.stdout:
        if "ready on " in line:
            break
    try:
        probe = moe.Session(model=model, device="cpu", host_copy=False, servers=[f"unix://{sock}"])
        E = probe.model_info["num_experts"]
        probe.close()
        s = moe.Session(model=model, servers=[f"unix://{sock}"], device=a.device, policy="static",
                        cache_experts_per_layer=E, max_tokens=max(a.tokens, 8), cpu_threads=1)
        L = s.served_layers[0]
        s.apply_assignment(L, range(E))
        s.flush_copies()
        H, k, T = s.model_info["hidden"], s.model_info["top_k"], a.tokens
        rng = np.random.default_rng(0)
        x = moe.to_bf16_bits(rng.standard_normal((T, H)).astype(np.float32))
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
        w = np.full((T, k), 1.0 / k, dtype=np.float32)
        out = np.empty((T, H), dtype=np.uint16)
        lib = _lib.lib()
        ptrs = [x.ctypes.data, ids.ctypes.data, w.ctypes.data, out.ctypes.data]
        rows = []
        raw = timed(lambda: lib.moe_forward_layer(s._handle, L, T, k, *ptrs, 0, None, None), a.iters)
        rows.append(("C ABI via ctypes, prepared pointers (host memory)", raw, 0.0))
        t = timed(lambda: s.forward_layer(L, x, ids, w, out=out), a.iters)
        rows.append(("Session.forward_layer, numpy", t, t - raw))
        try:
            import torch
            m = moe.MoeLayer(s, L)
            xt, it, wt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(ids), \
                torch.from_numpy(w)
            t = timed(lambda: m(xt, it, wt), a.iters)
            rows.append(("MoeLayer, torch CPU tensors", t, t - raw))
            if torch.cuda.is_available() and s.device == "cuda":
                xc, ic, wc = xt.cuda(), it.cuda(), wt.cuda()
                oc = torch.empty_like(xc)
                stream = torch.cuda.current_stream().cuda_stream
                dp = [xc.data_ptr(), ic.data_ptr(), wc.data_ptr(), oc.data_ptr()]
                raw_d = timed(lambda: lib.moe_forward_layer(s._handle, L, T, k, *dp, 1, ctypes.c_void_p(stream), None),
                              a.iters)
                rows.append(("C ABI via ctypes, device pointers + stream", raw_d, 0.0))
                t = timed(lambda: m(xc, ic, wc), a.iters)
                rows.append(("MoeLayer, torch CUDA tensors", t, t - raw_d))
                mc = moe.MoeLayer(s, L, capturable=True)

                def cap():
                    mc(xc, ic, wc)
                    torch.cuda.current_stream().synchronize()
                rawc = timed(lambda: (lib.moe_forward_layer_capturable(s._handle, L, T, k, *dp, ctypes.c_void_p(stream)),
                                      torch.cuda.current_stream().synchronize()), a.iters)
                rows.append(("C ABI capturable call + stream sync", rawc, 0.0))
                t = timed(cap, a.iters)
                rows.append(("MoeLayer(capturable=True) + stream sync", t, t - rawc))
        except ImportError:
            rows.append(("MoeLayer (torch not installed)", float("nan"), float("nan")))
        print(f"## python_overhead: {model}, T={T}, k={k}, all experts cached, device {s.device}")
        print(f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}\n")
        print("| call | us/call | Python over the C ABI call (us) |\n|---|---|---|")
        for name, us, over in rows:
            print(f"| {name} | {us:.1f} | {over:.1f} |")
        s.close()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
