#!/usr/bin/env python3
"""Write a whole GPT-OSS model (architecture gpt-oss) with random weights as one GGUF that llama.cpp loads and
that moe-expert-server --model reads: the peer comparison's model (scripts/device_check.sh gptoss*), one file
for both systems.

Uses llama.cpp's own gguf-py (--gguf-py DIR: the peer's copy, ../shared/peers/llama/gguf-py). The layout is
what llama.cpp's convert_hf_to_gguf.py writes for openai/gpt-oss-*:
  token_embd, output_norm, output; per layer attn_norm, post_attention_norm, attn_{q,k,v,output}.{weight,bias},
  attn_sinks.weight, ffn_gate_inp.{weight,bias} (the router), ffn_{gate,up,down}_exps.weight (gate and up
  separate) with their .bias.
Keys: gpt-oss.{block_count, context_length, embedding_length, feed_forward_length, expert_feed_forward_length,
expert_count, expert_used_count, attention.head_count, .head_count_kv, .key_length, .value_length,
.sliding_window, .layer_norm_rms_eps, rope.freq_base, rope.scaling.{type=yarn, factor, original_context_length}};
no key carries the SwiGLU limit (llama.cpp fixes alpha 1.702, limit 7).

Geometry (--preset): gpt-oss-120b: 36 layers, 128 experts top-4; gpt-oss-20b: 24 layers, 32 experts top-4; both
hidden 2880, expert I 2880, 64 query heads / 8 kv heads of dim 64, sliding window 128 on alternate layers
(llama.cpp's gpt-oss graph sets the pattern), attention sinks and biases, rope theta 150000 with YaRN x32
over 4096. --layers N keeps the first N.

Types: experts MXFP4 (ggml type 39, blocks of 32: one E8M0 exponent, 16 bytes of E2M1 nibbles) with uniform
random nibbles and one exponent chosen so that the values' std is about --std (uniform E2M1 codes have an RMS
of 2.93: e = 127 + round(log2(std / 2.93))); attention weights BF16 ~ N(0, --std); norms 1.0; biases, sinks
and the router F32 ~ N(0, --std); token_embd and output Q8_0 (--embd-type bf16 for BF16) ~ N(0, --embd-std).
The tokenizer comes from a vocab GGUF (--vocab, e.g. the peer tarball's share/ggml-vocab-qwen2.gguf; any is
fine for llama-bench), the vocabulary size is its token count. Random data is made once into pools and written
from random offsets, so the file is written at disk speed (36 layers: about 63 GB).

usage: make_peer_gguf.py OUT.gguf --vocab VOCAB.gguf --gguf-py DIR [--preset gpt-oss-120b|gpt-oss-20b]
                         [--layers N] [--std 0.02] [--embd-std 1.0] [--embd-type q8_0|bf16] [--seed 0]
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path

PRESETS = {
    # name: (layers, experts, top-k)
    "gpt-oss-120b": (36, 128, 4),
    "gpt-oss-20b": (24, 32, 4),
}
HIDDEN, EXPERT_FF, N_HEAD, N_HEAD_KV, HEAD_DIM = 2880, 2880, 64, 8, 64
SLIDING_WINDOW, ROPE_THETA, YARN_FACTOR, YARN_ORIG_CTX, CTX, RMS_EPS = 128, 150000.0, 32.0, 4096, 131072, 1e-5
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # uniform random codes


def read_gguf_kv(path):
    """The key/value section of a GGUF (arrays as lists), read directly: gguf-py's GGUFReader parses every
    vocabulary string through numpy and takes tens of seconds on a 150k-token vocabulary."""
    import struct
    data = Path(path).read_bytes()
    magic, version, _, n_kv = struct.unpack_from("<IIQQ", data, 0)
    if magic != 0x46554747 or version < 2:
        sys.exit(f"{path}: not a GGUF v2+ file")
    scal = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def rd_str(o):
        (n,) = struct.unpack_from("<Q", data, o)
        return data[o + 8:o + 8 + n].decode("utf-8", errors="surrogateescape"), o + 8 + n

    def rd_val(t, o):
        if t == 8:
            return rd_str(o)
        if t == 9:
            et, cnt = struct.unpack_from("<IQ", data, o)
            o += 12
            if et in scal:
                fmt = scal[et]
                return list(struct.unpack_from("<%d%s" % (cnt, fmt[1]), data, o)), o + struct.calcsize(fmt) * cnt
            out = []
            for _ in range(cnt):
                v, o = rd_val(et, o)
                out.append(v)
            return out, o
        return struct.unpack_from(scal[t], data, o)[0], o + struct.calcsize(scal[t])

    kv, off = {}, 24
    for _ in range(n_kv):
        k, off = rd_str(off)
        (t,) = struct.unpack_from("<I", data, off)
        kv[k], off = rd_val(t, off + 4)
    return kv


def tensor_list(layers, n_expert, n_vocab):
    """(name, numpy-order shape, kind): kind is the type class written (see the module docstring)."""
    H, I, E = HIDDEN, EXPERT_FF, n_expert
    q, kv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    tl = [("token_embd.weight", (n_vocab, H), "embd")]
    for i in range(layers):
        p = f"blk.{i}."
        tl += [
            (p + "attn_norm.weight", (H,), "ones"),
            (p + "attn_q.weight", (q, H), "bf16"), (p + "attn_q.bias", (q,), "f32"),
            (p + "attn_k.weight", (kv, H), "bf16"), (p + "attn_k.bias", (kv,), "f32"),
            (p + "attn_v.weight", (kv, H), "bf16"), (p + "attn_v.bias", (kv,), "f32"),
            (p + "attn_output.weight", (H, q), "bf16"), (p + "attn_output.bias", (H,), "f32"),
            (p + "attn_sinks.weight", (N_HEAD,), "f32"),
            (p + "post_attention_norm.weight", (H,), "ones"),
            (p + "ffn_gate_inp.weight", (E, H), "f32"), (p + "ffn_gate_inp.bias", (E,), "f32"),
            (p + "ffn_gate_exps.weight", (E, I, H), "mxfp4"), (p + "ffn_gate_exps.bias", (E, I), "f32"),
            (p + "ffn_up_exps.weight", (E, I, H), "mxfp4"), (p + "ffn_up_exps.bias", (E, I), "f32"),
            (p + "ffn_down_exps.weight", (E, H, I), "mxfp4"), (p + "ffn_down_exps.bias", (E, H), "f32"),
        ]
    tl += [("output_norm.weight", (H,), "ones"), ("output.weight", (n_vocab, H), "embd")]
    return tl


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt-oss-120b")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: the preset's)")
    ap.add_argument("--vocab", required=True, help="vocab-only GGUF to copy the tokenizer from")
    ap.add_argument("--gguf-py", required=True, help="directory that contains llama.cpp's gguf package")
    ap.add_argument("--std", type=float, default=0.02, help="std of the weights, biases and router")
    ap.add_argument("--embd-std", type=float, default=1.0,
                    help="std of the token embeddings and output head: 1.0 makes each token route on its own\n"
                         "(with 0.02 the attention output dominates and a prompt's tokens share a few experts)")
    ap.add_argument("--embd-type", choices=["q8_0", "bf16"], default="q8_0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-mib", type=int, default=64, help="size of each random pool")
    args = ap.parse_args()

    layers_max, n_expert, n_used = PRESETS[args.preset]
    L = args.layers or layers_max
    if not 1 <= L <= layers_max:
        sys.exit(f"--layers: {L} is not in [1, {layers_max}] ({args.preset})")
    if not (args.std > 0 and args.embd_std > 0):
        sys.exit("--std and --embd-std must be positive")
    if not (Path(args.gguf_py) / "gguf").is_dir():
        sys.exit(f"--gguf-py: {args.gguf_py} holds no gguf package")
    sys.path.insert(0, str(args.gguf_py))
    import numpy as np
    import gguf

    t0 = time.time()
    vf = read_gguf_kv(args.vocab)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        if key not in vf:
            sys.exit(f"--vocab {args.vocab}: no {key}")
    tokens = list(vf["tokenizer.ggml.tokens"])
    n_vocab = len(tokens)
    Q = gguf.GGMLQuantizationType
    embd_q = Q.Q8_0 if args.embd_type == "q8_0" else Q.BF16
    sizes = {"bf16": (Q.BF16, 1, 2), "f32": (Q.F32, 1, 4), "ones": (Q.F32, 1, 4), "mxfp4": (Q.MXFP4, 32, 17),
             "embd": (embd_q,) + tuple(gguf.GGML_QUANT_SIZES[embd_q])}
    tl = tensor_list(L, n_expert, n_vocab)

    w = gguf.GGUFWriter(args.out, "gpt-oss")
    w.add_name(f"synthetic-{args.preset}-{L}L-mxfp4")
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(EXPERT_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_sliding_window(SLIDING_WINDOW)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN_FACTOR)
    w.add_rope_scaling_orig_ctx_len(YARN_ORIG_CTX)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE))
    w.add_tokenizer_model(vf["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in vf:
        w.add_tokenizer_pre(vf["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in vf["tokenizer.ggml.token_type"]])
    if "tokenizer.ggml.merges" in vf:
        w.add_token_merges(list(vf["tokenizer.ggml.merges"]))
    for key, fn in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                    ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                    ("tokenizer.ggml.padding_token_id", w.add_pad_token_id)):
        if key in vf:
            fn(int(vf[key]))
    w.add_add_bos_token(False)

    total = 0
    for name, shape, kind in tl:
        qt, blk_elems, blk_bytes = sizes[kind]
        if shape[-1] % blk_elems:
            sys.exit(f"{name}: {shape[-1]} columns are not whole blocks of {blk_elems}")
        nbytes = int(np.prod(shape)) // blk_elems * blk_bytes
        if blk_elems > 1:  # quantized: gguf-py takes the byte shape
            w.add_tensor_info(name, tuple(shape[:-1]) + (shape[-1] // blk_elems * blk_bytes,), np.dtype(np.uint8), nbytes,
                              raw_dtype=qt)
        elif qt == Q.BF16:
            w.add_tensor_info(name, shape, np.dtype(np.uint16), nbytes, raw_dtype=Q.BF16)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        total += nbytes
    out_dir = os.path.dirname(os.path.abspath(args.out))
    free = shutil.disk_usage(out_dir).free
    if free < total + (1 << 30):
        sys.exit(f"{args.out}: needs {total / 1e9:.1f} GB (+1 GB spare), {out_dir} has {free / 1e9:.1f} GB free")

    # ---- random pools: whole blocks, written from random offsets ----
    rng = np.random.default_rng(args.seed)
    pool_bytes = args.pool_mib << 20
    n_blocks = pool_bytes // 17
    mx = np.empty((n_blocks, 17), dtype=np.uint8)
    exponent = int(np.clip(127 + round(math.log2(args.std / E2M1_RMS)), 1, 254))
    mx[:, 0] = exponent
    mx[:, 1:] = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    normal = rng.standard_normal(pool_bytes // 4, dtype=np.float32)

    def bf16_pool(std):
        u = (normal * np.float32(std)).view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16).view(np.uint8)

    pools = {"mxfp4": mx.reshape(-1), "bf16": bf16_pool(args.std)}
    if embd_q == Q.Q8_0:
        pools["embd"] = gguf.quants.quantize((normal * np.float32(args.embd_std)).reshape(-1, 4096), Q.Q8_0).reshape(-1).view(np.uint8)
    else:
        pools["embd"] = bf16_pool(args.embd_std)
    print(f"[make_peer_gguf] {args.out}: {args.preset}, {L} layers, {len(tl)} tensors, {total / 1e9:.2f} GB; "
          f"MXFP4 exponent {exponent} (std {E2M1_RMS * 2.0 ** (exponent - 127):.4f}); pools ready in {time.time() - t0:.1f}s",
          flush=True)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment

    def pad():
        n = (-fout.tell()) % align
        if n:
            fout.write(b"\0" * n)

    written, last = 0, time.time()
    for name, shape, kind in tl:
        pad()
        n = int(np.prod(shape))
        if kind == "ones":
            fout.write(np.ones(n, dtype=np.float32).tobytes())
        elif kind == "f32":
            fout.write((rng.standard_normal(n, dtype=np.float32) * np.float32(args.std)).tobytes())
        else:
            _, blk_elems, blk_bytes = sizes[kind]
            src = pools[kind]
            pool_units = src.nbytes // blk_bytes
            units = n // blk_elems
            while units > 0:
                c = min(units, pool_units, (64 << 20) // blk_bytes)
                off = int(rng.integers(0, pool_units - c + 1))
                fout.write(memoryview(src[off * blk_bytes:(off + c) * blk_bytes]))
                units -= c
                written += c * blk_bytes
        if time.time() - last > 10:
            last = time.time()
            print(f"[make_peer_gguf] {written / 1e9:.1f} / {total / 1e9:.1f} GB, {time.time() - t0:.0f}s", flush=True)
    pad()
    fout.flush()
    w.close()
    print(f"[make_peer_gguf] done: {os.path.getsize(args.out) / 1e9:.2f} GB in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
