#!/usr/bin/env python3
"""moe-expert-service inside Hugging Face transformers, on a GPU host.

Builds a Qwen3-MoE model with Qwen3-30B-A3B geometry and --layers decoder
layers (random init, bf16, on the GPU), saves it with save_pretrained, starts
moe-expert-server on that very checkpoint (shared memory) and loads it again
through the `moe_expert_service` experts backend of transformers
(moe_expert_service.hf: from_pretrained with experts_implementation=
"moe_expert_service", then attach() per cache setting; the expert weights are
never loaded by transformers), and runs greedy generate(). Prints (and writes
to --out) markdown tables:
  - correctness: per-layer outputs vs the all-GPU model's blocks (relative error,
    must be <= 1e-2) and the logits of the first --check-steps generated
    steps (teacher-forced on the all-GPU model's greedy tokens) vs the all-GPU
    model and vs an f32 copy of it;
  - speed: decode tokens/s at each --batch for all-GPU transformers, ours with
    each --cache fraction of the experts cached on the GPU (eager, and with
    the decode step captured in a CUDA graph: StaticCache + torch.cuda.graph,
    MoeLayer(capturable=True)), and
    transformers' own CPU offload of the experts (accelerate device_map) when
    it runs.
Exit 1 when a correctness bound is missed.

  MOE_LIBRARY=.../libmoe.so PYTHONPATH=python /opt/torch/.venv/bin/python3 \
      python/examples/transformers_offload.py --server-bin build/expert_server/moe-expert-server
"""
import argparse
import copy
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

import moe_expert_service as moe
import moe_expert_service.hf as moe_hf


def qwen3_30b_a3b_config(layers):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def decode_tokens_per_s(model, batch, prompt_len, new_tokens, vocab):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    t1, tn = run(1), run(new_tokens + 1)
    return batch * new_tokens / max(tn - t1, 1e-9)


def make_static_cache(model, batch, length):
    from transformers import StaticCache
    errors = []
    for kw in (dict(config=model.config, max_cache_len=length),
               dict(config=model.config, max_batch_size=batch, max_cache_len=length, device="cuda",
                    dtype=torch.bfloat16)):
        try:
            return StaticCache(**kw)
        except TypeError as e:
            errors.append(str(e))
    raise RuntimeError("StaticCache: " + "; ".join(errors))


def graph_decode_tokens_per_s(model, batch, prompt_len, new_tokens, vocab, warm_steps=0):
    """Greedy decode with each step captured once in a CUDA graph (StaticCache,
    torch.cuda.graph) and replayed: tokens/s over new_tokens steps, timed after
    warm_steps untimed replays (an offloaded model's cache fills as it decodes)."""
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, prompt_len), device="cuda")
    cache = make_static_cache(model, batch, prompt_len + warm_steps + new_tokens + 8)
    out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt_len, device="cuda"),
                use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([prompt_len], device="cuda")

    def step():
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (also the eager first call each capturable layer needs)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    for i in range(warm_steps):
        pos.fill_(prompt_len + i)
        graph.replay()
        tok.copy_(logits[:, -1:].argmax(-1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(warm_steps, warm_steps + new_tokens):
        pos.fill_(prompt_len + i)
        graph.replay()
        tok.copy_(logits[:, -1:].argmax(-1))
    torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - t0)


def host_dram_read_gbps():
    """Host DRAM read bandwidth as torch's CPU threads see it: the best of 5
    sums over 2 GiB of f32 (what a floor of the experts' bytes is priced at)."""
    x = torch.ones(1 << 29, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def floor_tokens_per_s(config, batch, frac, all_gpu_tokens_per_s, dram_gbps):
    """Decode floor: the all-GPU step (attention and the rest, in a CUDA graph)
    plus the bytes of the experts the step misses read once at host DRAM
    speed. Routing taken as uniform (the random router): a layer's batch
    touches E * (1 - (1 - k/E)^batch) experts, a fraction `frac` of them cached."""
    E, k = config.num_experts, config.num_experts_per_tok
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * 2
    touched = E * (1 - (1 - k / E) ** batch)
    missed_bytes = config.num_hidden_layers * touched * (1 - frac) * expert_bytes
    step = batch / all_gpu_tokens_per_s + missed_bytes / (dram_gbps * 1e9)
    return batch / step


def experts_on_cpu_device_map(layers):
    """accelerate's device_map for transformers' own CPU offload of a Qwen3-MoE model's
    experts: everything on GPU 0 but each layer's experts module."""
    dm = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    for i in range(layers):
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
            dm[f"model.layers.{i}.{part}"] = 0
        dm[f"model.layers.{i}.mlp.experts"] = "cpu"
    return dm


def measure(fn, *args):
    try:
        return f"{fn(*args):.1f}"
    except Exception as e:  # the table says why a configuration did not run
        return f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def common_arguments(ap, cache, check_steps):
    """The flags this example shares with transformers_tp.py."""
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-30B-A3B-geometry model")
    ap.add_argument("--server-bin", required=True, help="path of moe-expert-server")
    ap.add_argument("--threads", type=int, default=0, help="expert-server compute threads (0: the server's default, which leaves cores to this process)")
    ap.add_argument("--batch", default="1,8", help="decode batch sizes")
    ap.add_argument("--cache", default=cache, help="fractions of each layer's experts cached on each GPU")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--check-steps", type=int, default=check_steps, help="generated steps compared")
    ap.add_argument("--out", default="", help="also write the tables to this markdown file")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, cache="0,0.25,0.5,1", check_steps=32)
    ap.add_argument("--no-offload-baseline", action="store_true", help="skip transformers' CPU offload")
    ap.add_argument("--workdir", default="", help="checkpoint directory (default: a temporary one)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("transformers_offload: needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers
    from transformers import Qwen3MoeForCausalLM

    work = a.workdir or tempfile.mkdtemp(prefix="moe_tf_")
    ckpt = os.path.join(work, "qwen3-moe")
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    say(f"## transformers_offload: Qwen3-30B-A3B geometry, {a.layers} layers")
    say(f"`{' '.join(sys.argv)}`; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name(0)}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    torch.manual_seed(0)
    config = qwen3_30b_a3b_config(a.layers)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):  # random init on the GPU, in bf16 (billions of parameters)
        model = Qwen3MoeForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(ckpt, safe_serialization=True)
    names = sorted(f for f in os.listdir(ckpt))
    say(f"save_pretrained wrote: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")

    server = moe_hf.ExpertServer(ckpt, server_bin=a.server_bin, threads=a.threads)
    failed = False
    try:
        servers = [f"unix://{server.socket}"]

        def attach(frac, capturable=False):
            return moe_hf.attach(ours, servers=servers, cache=frac, policy="static", max_tokens=512,
                                 capturable=capturable)

        ours = moe_hf.from_pretrained(ckpt, model_class=Qwen3MoeForCausalLM, servers=servers, cache=0.25,
                                      policy="static", max_tokens=512, dtype=torch.bfloat16).eval()

        # ---- correctness --------------------------------------------------
        say("\n### correctness\n\n| check | value | bound |\n|---|---|---|")
        worst = 0.0
        with torch.no_grad():
            for i in range(a.layers):
                x = torch.randn(2, 8, config.hidden_size, device="cuda", dtype=torch.bfloat16)
                ref, got = model.model.layers[i].mlp(x), ours.model.layers[i].mlp(x)
                ref = ref[0] if isinstance(ref, tuple) else ref
                got = got[0] if isinstance(got, tuple) else got
                worst = max(worst, rel(got, ref))
        failed |= worst > 1e-2
        say(f"| per-layer MoE output vs original block (max over {a.layers} layers, 25% cached) | {worst:.2e} | 1e-2 |")
        # Logits: greedy generate() of the all-GPU model gives the token sequence;
        # then the all-GPU model, ours and an f32 copy of the all-GPU model decode
        # that same sequence step by step (teacher forcing, KV cache, T=1 per
        # step), so a near-tie that flips one greedy token cannot make the later
        # steps incomparable. Bound: ours may be off the f32 model by at most
        # twice what the bf16 all-GPU model itself is off it, or 1e-2.
        torch.manual_seed(2)
        prompt = torch.randint(0, config.vocab_size, (1, a.prompt), device="cuda")
        kw = dict(do_sample=False, max_new_tokens=a.check_steps, min_new_tokens=a.check_steps, pad_token_id=0,
                  eos_token_id=None, return_dict_in_generate=True)
        with torch.no_grad():
            seq = model.generate(prompt, **kw).sequences
            l_ref = moe_hf.teacher_forced_logits(model, seq, a.prompt)
            g_our = ours.generate(prompt, **kw).sequences
            l_our = moe_hf.teacher_forced_logits(ours, seq, a.prompt)
            ref32 = copy.deepcopy(model).float()
            l_f32 = moe_hf.teacher_forced_logits(ref32, seq, a.prompt)
            del ref32
            torch.cuda.empty_cache()
        same = 0
        while same < a.check_steps and torch.equal(seq[0, a.prompt + same], g_our[0, a.prompt + same]):
            same += 1
        steps = len(l_ref)
        e_our = max(rel(l_our[j], l_ref[j]) for j in range(steps))
        f_our = max(rel(l_our[j], l_f32[j]) for j in range(steps))
        f_ref = max(rel(l_ref[j], l_f32[j]) for j in range(steps))
        bound = max(1e-2, 2 * f_ref)
        failed |= f_our > bound
        say(f"| logits of generated steps 1..{steps}, ours vs all-GPU bf16 (teacher-forced) | {e_our:.2e} | |")
        say(f"| same, all-GPU bf16 vs an f32 copy of the model (the bf16 floor) | {f_ref:.2e} | |")
        say(f"| same, ours vs the f32 copy | {f_our:.2e} | {bound:.1e} (max(1e-2, 2x floor)) |")
        say(f"| greedy tokens of our generate() equal to all-GPU's | {same}/{a.check_steps} | |")
        st = ours.moe_expert_service.session.totals()
        say(f"| session counters (25% cache) | hits {st['hit_pairs']}, CPU {st['cpu_pairs']}, copied "
            f"{st['copied_pairs']} pairs | |")

        # ---- speed --------------------------------------------------------
        batches = [int(b) for b in a.batch.split(",")]
        say("\n### decode tokens/s\n\n| configuration | " + " | ".join(f"batch {b}" for b in batches) + " |")
        say("|---|" + "---|" * len(batches))
        with torch.no_grad():
            say("| all-GPU transformers | " + " | ".join(
                f"{decode_tokens_per_s(model, b, a.prompt, a.new_tokens, config.vocab_size):.1f}" for b in batches)
                + " |")
            all_gpu_graph = [measure(graph_decode_tokens_per_s, model, b, a.prompt, a.new_tokens, config.vocab_size)
                             for b in batches]
            say("| all-GPU transformers, decode step in a CUDA graph | " + " | ".join(all_gpu_graph) + " |")
            dram = host_dram_read_gbps()
            for frac in [float(f) for f in a.cache.split(",")]:
                try:
                    say(f"| floor at {frac:.0%} cached: the all-GPU graph step + the missed experts' bytes at host "
                        f"DRAM speed ({dram:.0f} GB/s read, uniform routing) | " + " | ".join(
                            f"{floor_tokens_per_s(config, b, frac, float(g), dram):.1f}"
                            for b, g in zip(batches, all_gpu_graph)) + " |")
                except ValueError:  # the all-GPU graph row did not run: no floor
                    pass
                s = attach(frac).session
                row = [decode_tokens_per_s(ours, b, a.prompt, a.new_tokens, config.vocab_size) for b in batches]
                st = s.totals()
                pairs = max(st["hit_pairs"] + st["cpu_pairs"] + st["copied_pairs"], 1)
                say(f"| ours, {frac:.0%} cached, eager (hit rate {st['hit_pairs'] / pairs:.0%}) | "
                    + " | ".join(f"{r:.1f}" for r in row) + " |")
                s = attach(frac, capturable=True).session
                row = [measure(graph_decode_tokens_per_s, ours, b, a.prompt, a.new_tokens, config.vocab_size)
                       for b in batches]
                try:
                    s.take_stream_error()
                except moe.MoeError as e:
                    row = [f"replay error: {e}" for _ in batches]
                say(f"| ours, {frac:.0%} cached, decode step in a CUDA graph | " + " | ".join(row) + " |")
        ours.moe_expert_service.close()
        model = ours = None  # frees the all-GPU model (the closures above see None)
        torch.cuda.empty_cache()
        if not a.no_offload_baseline:
            try:
                off = Qwen3MoeForCausalLM.from_pretrained(ckpt, device_map=experts_on_cpu_device_map(a.layers),
                                                          dtype=torch.bfloat16).eval()
                with torch.no_grad():
                    row = [decode_tokens_per_s(off, b, a.prompt, min(a.new_tokens, 8), config.vocab_size)
                           for b in batches]
                say("| transformers CPU offload of the experts (accelerate device_map) | "
                    + " | ".join(f"{r:.2f}" for r in row) + " |")
            except Exception as e:  # report, do not hide: the row says why it did not run
                say(f"| transformers CPU offload of the experts | did not run: {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:120]} |")
    finally:
        server.close()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    say(f"\nresult: {'FAIL' if failed else 'ok'}")
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
