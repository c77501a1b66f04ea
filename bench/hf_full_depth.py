#!/usr/bin/env python3
"""Whole models through transformers' `moe_expert_service` experts backend, at full depth.

Two models, each a checkpoint of random weights written on this host and loaded with
from_pretrained through moe_expert_service.hf (the user's path: a server started on the
checkpoint, the product's default policy):

  --model qwen3     Qwen3-30B-A3B geometry, --layers decoder layers (48: the real model),
                    bf16, saved with save_pretrained;
  --model deepseek  DeepSeek-V3 geometry at reduced depth (--layers, the first dense) with
                    int4 experts as Kimi-K2 publishes them (compressed-tensors pack-quantized,
                    group 32, one tensor triple per expert); the non-expert weights bf16.

Prints (and appends to --out) markdown tables:
  - correctness: per MoE layer, ours vs the same block computed by transformers' own
    experts on the same weights (the int4 experts dequantized), relative error <= 1e-2;
    greedy tokens of generate() over --check-steps steps equal to the all-GPU model's, and the
    teacher-forced logits within max(1e-2, 2x the bf16-vs-f32 floor) of an f32 model (the f32
    model runs one decoder layer in f32 at a time, so a 61 GB model needs no second copy);
  - decode tokens/s at each --batch with each --cache fraction cached, eager and with the
    step in a CUDA graph, beside the all-GPU model (eager and graph);
  - prompt tokens/s at each --prompts length (one sequence, one forward);
  - memory: device memory in use (whole GPU) and host RSS of this process and of the server;
  - transformers' own CPU offload of the experts (accelerate device_map), batch 1.
Exit 1 when a correctness bound is missed.

  MOE_LIBRARY=.../libmoe.so PYTHONPATH=python /opt/torch/.venv/bin/python3 bench/hf_full_depth.py \\
      --model qwen3 --layers 48 --server-bin build/expert_server/moe-expert-server --workdir /tmp/hf48
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for d in (os.path.join(HERE, "..", "python", "examples"), os.path.join(HERE, "..", "examples")):
    if os.path.isdir(d):
        sys.path.insert(0, d)
import moe_expert_service.hf as moe_hf  # noqa: E402
from transformers_offload import (decode_tokens_per_s, experts_on_cpu_device_map,  # noqa: E402
                                  graph_decode_tokens_per_s, measure, qwen3_30b_a3b_config, rel)

T0 = time.time()


def deepseek_v3_config(layers):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gpu_used_gib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def proc_mem_gib(pid="self"):
    """VmRSS, VmHWM, RssAnon, RssFile and RssShmem of a process, GiB."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) / 2**20
    except OSError:
        pass
    return out


@contextlib.contextmanager
def f32_one_layer_at_a_time(model):
    """`model` computes in f32 while inside: everything but the decoder layers is converted
    once, each decoder layer on entry (and back to bf16 on exit: the bf16 -> f32 -> bf16
    round trip is exact), so the f32 reference needs one layer's f32 copy at a time."""
    layers = model.model.layers
    in_layers = {id(p) for p in layers.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_layers]
    for p in rest:
        p.data = p.data.float()

    def enter(m, args):
        for p in m.parameters():
            p.data = p.data.float()

    def leave(m, args, out):
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                              layer.register_forward_hook(leave))]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
        for p in rest:
            p.data = p.data.to(torch.bfloat16)


def prompt_tokens_per_s(model, T, vocab, repeats=2):
    """One sequence of T tokens in one forward (the prefill): best of `repeats` after a warm-up."""
    torch.manual_seed(3)
    ids = torch.randint(0, vocab, (1, T), device="cuda")
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=True)
        torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - t0)
    return T / best


# ---- checkpoints ------------------------------------------------------------


def make_qwen3(a, ckpt, say):
    from transformers import Qwen3MoeForCausalLM
    config = qwen3_30b_a3b_config(a.layers)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):  # random init on the GPU, in bf16
        model = Qwen3MoeForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    t0 = time.time()
    model.save_pretrained(ckpt, safe_serialization=True)
    say(f"save_pretrained: {dir_gib(ckpt):.1f} GiB in {time.time() - t0:.0f} s")
    return model, config, Qwen3MoeForCausalLM


def pack_int4(q):
    """compressed-tensors pack-quantized: int32 [rows, cols/8], value j of a word in bits
    [4j, 4j+4) as q + 8 (q int8 in [-8, 7], [rows, cols])."""
    u = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)
    word = torch.zeros(u.shape[:2], dtype=torch.int64, device=q.device)
    for j in range(8):
        word |= u[:, :, j] << (4 * j)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def make_deepseek_int4(a, ckpt, say, group=32):
    """A DeepSeek-V3-geometry model whose routed experts are int4 (Kimi-K2's format): random
    bf16 non-expert weights, random int4 values with random bf16 group scales for the experts.
    The all-GPU reference model holds the experts dequantized (the checkpoint's exact values)."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM
    config = deepseek_v3_config(a.layers)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    os.makedirs(ckpt, exist_ok=True)
    t0 = time.time()
    rest = {k: v.contiguous() for k, v in model.state_dict().items() if ".mlp.experts." not in k}
    weight_map = {}
    save_file({k: v.cpu() for k, v in rest.items()}, os.path.join(ckpt, "model-rest.safetensors"),
              metadata={"format": "pt"})
    weight_map.update({k: "model-rest.safetensors" for k in rest})
    del rest
    g = torch.Generator(device="cuda").manual_seed(1)
    std = 0.02
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            ex = getattr(layer.mlp, "experts", None)
            if ex is None:
                continue
            E, I, H = ex.num_experts, ex.intermediate_dim, ex.hidden_dim
            shard, name = {}, f"model-experts-{li:03d}.safetensors"
            for e in range(E):
                deq = {}
                for proj, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    q = torch.randint(-8, 8, (rows, cols), device="cuda", generator=g, dtype=torch.int8)
                    s = (torch.rand(rows, cols // group, device="cuda", generator=g) + 0.5) * (std / 4.6)
                    s = s.to(torch.bfloat16)
                    deq[proj] = (q.float() * s.float().repeat_interleave(group, dim=1)).to(torch.bfloat16)
                    base = f"model.layers.{li}.mlp.experts.{e}.{proj}."
                    shard[base + "weight_packed"] = pack_int4(q).cpu()
                    shard[base + "weight_scale"] = s.cpu()
                    shard[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
                ex.gate_up_proj[e].copy_(torch.cat([deq["gate_proj"], deq["up_proj"]], 0))
                ex.down_proj[e].copy_(deq["down_proj"])
            save_file(shard, os.path.join(ckpt, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            del shard
    config.save_pretrained(ckpt)
    with open(os.path.join(ckpt, "config.json")) as f:
        cj = json.load(f)
    for k in ("experts_implementation", "_experts_implementation"):
        cj.pop(k, None)
    cj["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                   "re:.*mlp\\.gate$"]}
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cj, f, indent=2)
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    say(f"int4 checkpoint (compressed-tensors, group {group}): {dir_gib(ckpt):.1f} GiB in {time.time() - t0:.0f} s")
    return model, config, DeepseekV3ForCausalLM


def dir_gib(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 2**30


# ---- the run ------------------------------------------------------------------


def transformers_offload_row(a, ckpt, cls, config, say, left):
    """transformers' own CPU offload of the experts (accelerate device_map), batch-1 decode."""
    if a.offload_tokens <= 0 or a.model != "qwen3":
        return
    if left() < 180:
        say(f"\ntransformers' CPU offload: skipped ({left():.0f} s left of --deadline-s)")
        return
    try:
        t0 = time.time()
        off = cls.from_pretrained(ckpt, device_map=experts_on_cpu_device_map(a.layers), dtype=torch.bfloat16).eval()
        load = time.time() - t0
        with torch.no_grad():
            r = decode_tokens_per_s(off, 1, a.prompt, a.offload_tokens, config.vocab_size)
        say(f"\ntransformers' CPU offload of the experts (accelerate device_map, loaded in {load:.0f} s): "
            f"batch 1 decode {r:.3f} tokens/s; this process peak RSS {proc_mem_gib().get('VmHWM', 0):.1f} GiB")
        del off
    except Exception as e:  # noqa: BLE001 (report, do not hide)
        say(f"\ntransformers' CPU offload: did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("qwen3", "deepseek"), default="qwen3")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--server-bin", required=True, help="path of moe-expert-server")
    ap.add_argument("--threads", type=int, default=0, help="server compute threads (0: its default)")
    ap.add_argument("--batch", default="1,8", help="decode batch sizes")
    ap.add_argument("--cache", default="0,0.25,0.5", help="fractions of each layer's experts cached")
    ap.add_argument("--prompts", default="512,2048", help="prompt lengths (one sequence)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before decode")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--check-steps", type=int, default=16)
    ap.add_argument("--warm-steps", type=int, default=32, help="untimed graph replays before the timed ones")
    ap.add_argument("--no-eager", dest="eager", action="store_false", help="skip our eager decode rows")
    ap.add_argument("--offload-tokens", type=int, default=2, help="decode steps timed for transformers' offload "
                    "(0: skip it)")
    ap.add_argument("--workdir", required=True, help="where the checkpoint is written (removed at the end)")
    ap.add_argument("--deadline-s", type=float, default=560, help="skip what would not finish by then")
    ap.add_argument("--out", default="")
    ap.add_argument("--only-offload", action="store_true",
                    help="the checkpoint, then transformers' own offload alone (ours skipped: a call of its own)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("hf_full_depth: needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    def left():
        return a.deadline_s - (time.time() - T0)

    ckpt = os.path.join(a.workdir, a.model)
    shutil.rmtree(ckpt, ignore_errors=True)
    os.makedirs(a.workdir, exist_ok=True)
    du = shutil.disk_usage(a.workdir)
    say(f"## hf_full_depth: {a.model}, {a.layers} layers, through transformers' experts backend")
    say(f"`{' '.join(sys.argv)}`; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name(0)}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"{du.free / 2**30:.0f} GiB free in {a.workdir}")
    make = make_qwen3 if a.model == "qwen3" else make_deepseek_int4
    model, config, cls = make(a, ckpt, say)
    model_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    say(f"all-GPU model: {model_gib:.1f} GiB of parameters; GPU in use {gpu_used_gib():.1f} GiB")
    if a.only_offload:
        del model
        torch.cuda.empty_cache()
        transformers_offload_row(a, ckpt, cls, config, say, left)
        return finish(a, ckpt, say, lines, False)
    batches = [int(b) for b in a.batch.split(",")]
    fracs = [float(f) for f in a.cache.split(",")]
    prompts = [int(p) for p in a.prompts.split(",") if p]
    failed = False
    t0 = time.time()
    server = moe_hf.ExpertServer(ckpt, server_bin=a.server_bin, threads=a.threads)
    smem = proc_mem_gib(server.proc.pid)
    say(f"expert server ready in {time.time() - t0:.0f} s: RSS {smem.get('VmRSS', 0):.1f} GiB "
        f"(shared host copy {smem.get('RssShmem', 0):.1f} GiB)")
    servers = [f"unix://{server.socket}"]
    try:
        t0 = time.time()
        ours = moe_hf.from_pretrained(ckpt, model_class=cls, servers=servers, cache=0.25, max_tokens=2048,
                                      dtype=torch.bfloat16).eval()
        say(f"from_pretrained through the backend: {time.time() - t0:.0f} s; this process RSS "
            f"{proc_mem_gib().get('VmRSS', 0):.1f} GiB")
        moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]

        # ---- correctness ------------------------------------------------------
        say("\n### correctness\n\n| check | value | bound |\n|---|---|---|")
        worst = 0.0
        with torch.no_grad():
            for i in moe_layers:
                x = torch.randn(2, 8, config.hidden_size, device="cuda", dtype=torch.bfloat16)
                ref, got = model.model.layers[i].mlp(x), ours.model.layers[i].mlp(x)
                ref = ref[0] if isinstance(ref, tuple) else ref
                got = got[0] if isinstance(got, tuple) else got
                worst = max(worst, rel(got, ref))
        failed |= worst > 1e-2
        say(f"| MoE block output vs transformers' own experts (max over {len(moe_layers)} layers, 25% cached) | "
            f"{worst:.2e} | 1e-2 |")
        torch.manual_seed(2)
        prompt = torch.randint(0, config.vocab_size, (1, a.prompt), device="cuda")
        kw = dict(do_sample=False, max_new_tokens=a.check_steps, min_new_tokens=a.check_steps, pad_token_id=0,
                  eos_token_id=None, return_dict_in_generate=True)
        with torch.no_grad():
            seq = model.generate(prompt, **kw).sequences
            l_ref = moe_hf.teacher_forced_logits(model, seq, a.prompt)
            g_our = ours.generate(prompt, **kw).sequences
            l_our = moe_hf.teacher_forced_logits(ours, seq, a.prompt)
            with f32_one_layer_at_a_time(model):
                l_f32 = moe_hf.teacher_forced_logits(model, seq, a.prompt)
        same = 0
        while same < a.check_steps and torch.equal(seq[0, a.prompt + same], g_our[0, a.prompt + same]):
            same += 1
        steps = len(l_ref)
        f_our = max(rel(l_our[j], l_f32[j]) for j in range(steps))
        f_ref = max(rel(l_ref[j], l_f32[j]) for j in range(steps))
        bound = max(1e-2, 2 * f_ref)
        failed |= same < a.check_steps and f_our > bound
        say(f"| greedy tokens of our generate() equal to the all-GPU model's | {same}/{a.check_steps} | "
            f"all, or the logits row below |")
        say(f"| logits (teacher-forced, {steps} steps), ours vs all-GPU bf16 | "
            f"{max(rel(l_our[j], l_ref[j]) for j in range(steps)):.2e} | |")
        say(f"| same, all-GPU bf16 vs the f32 model (the bf16 floor) | {f_ref:.2e} | |")
        say(f"| same, ours vs the f32 model | {f_our:.2e} | {bound:.1e} |")

        # ---- all-GPU rows, then the all-GPU model goes ---------------------------
        say("\n### decode tokens/s (graph: the step captured in a CUDA graph)\n\n| configuration | "
            + " | ".join(f"batch {b}" for b in batches) + " | GPU in use, GiB |")
        say("|---|" + "---|" * (len(batches) + 1))
        prompt_rows = []
        with torch.no_grad():
            row = [decode_tokens_per_s(model, b, a.prompt, a.new_tokens, config.vocab_size) for b in batches]
            say("| all-GPU transformers, eager | " + " | ".join(f"{r:.1f}" for r in row) + f" | {gpu_used_gib():.1f} |")
            row = [measure(graph_decode_tokens_per_s, model, b, a.prompt, a.new_tokens, config.vocab_size)
                   for b in batches]
            say("| all-GPU transformers, graph | " + " | ".join(row) + f" | {gpu_used_gib():.1f} |")
            prompt_rows.append(("all-GPU transformers", [measure(prompt_tokens_per_s, model, T, config.vocab_size)
                                                         for T in prompts]))
        del model
        torch.cuda.empty_cache()
        base = gpu_used_gib()
        say(f"| (the all-GPU model freed: GPU in use {base:.1f} GiB, ours' non-expert weights and CUDA context) | | |")
        def split(before, after):
            """The split of the pairs between two totals (a captured step's calls reach them at
            take_stream_error); with no pairs, the cache's own hit rate so far (mean over the layers)."""
            d = {key: after[key] - before[key] for key in ("hit_pairs", "cpu_pairs", "copied_pairs")}
            n = sum(d.values())
            if n == 0:
                rates = [s.hit_rate(i) for i in s.served_layers]
                return f"cache hit rate so far {sum(rates) / max(len(rates), 1):.0%}"
            return f"hits {d['hit_pairs'] / n:.0%}, CPU {d['cpu_pairs'] / n:.0%}, copied {d['copied_pairs'] / n:.0%}"

        with torch.no_grad():
            for frac in fracs:
                if left() < 60:
                    say(f"| ours, {frac:.0%} cached | skipped: {left():.0f} s left of --deadline-s |")
                    continue
                # One session per cache size, as an engine holds it: eager decode, the prompts,
                # then the decode step captured in a CUDA graph (the cache warm from what ran before).
                s = moe_hf.attach(ours, servers=servers, cache=frac, max_tokens=2048, capturable=True).session
                if a.eager:
                    before = s.totals()
                    row = [decode_tokens_per_s(ours, b, a.prompt, a.new_tokens, config.vocab_size) for b in batches]
                    say(f"| ours, {frac:.0%} cached, eager (pairs: {split(before, s.totals())}) | "
                        + " | ".join(f"{r:.1f}" for r in row) + f" | {gpu_used_gib():.1f} |")
                before = s.totals()
                row = [measure(prompt_tokens_per_s, ours, T, config.vocab_size) for T in prompts]
                prompt_rows.append((f"ours, {frac:.0%} cached (pairs: {split(before, s.totals())})", row))
                before = s.totals()
                row = [measure(graph_decode_tokens_per_s, ours, b, a.prompt, a.new_tokens, config.vocab_size,
                               a.warm_steps) for b in batches]
                try:
                    s.take_stream_error()
                except Exception as e:  # noqa: BLE001 (the row says why)
                    row = [f"replay error: {e}" for _ in batches]
                say(f"| ours, {frac:.0%} cached, graph, after {a.warm_steps} untimed steps (pairs: "
                    f"{split(before, s.totals())}) | " + " | ".join(row) + f" | {gpu_used_gib():.1f} |")
        say("\n### prompt tokens/s (one sequence, one forward)\n\n| configuration | "
            + " | ".join(f"{T} tokens" for T in prompts) + " |")
        say("|---|" + "---|" * len(prompts))
        for name, row in prompt_rows:
            say(f"| {name} | " + " | ".join(row) + " |")
        me, sm = proc_mem_gib(), proc_mem_gib(server.proc.pid)
        say(f"\nhost memory, GiB: this process RSS {me.get('VmRSS', 0):.1f} = its own {me.get('RssAnon', 0):.1f} + "
            f"the server's shared host copy {me.get('RssShmem', 0):.1f} + mapped checkpoint files "
            f"{me.get('RssFile', 0):.1f} (page cache); the server RSS {sm.get('VmRSS', 0):.1f} = its own "
            f"{sm.get('RssAnon', 0):.1f} + the host copy {sm.get('RssShmem', 0):.1f}")
        ours.moe_expert_service.close()
        ours = None
    finally:
        server.close()
    torch.cuda.empty_cache()

    transformers_offload_row(a, ckpt, cls, config, say, left)
    return finish(a, ckpt, say, lines, failed)


def finish(a, ckpt, say, lines, failed):
    shutil.rmtree(ckpt, ignore_errors=True)
    say(f"\nresult: {'FAIL' if failed else 'ok'} ({time.time() - T0:.0f} s)")
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
