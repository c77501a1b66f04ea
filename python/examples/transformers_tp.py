#!/usr/bin/env python3
"""Tensor parallelism over several GPUs: one expert cache across their memory.

Builds a Qwen3-MoE model with Qwen3-30B-A3B geometry and --layers decoder
layers (random init, bf16), saves it, starts moe-expert-server on it (shared
memory), and runs --gpus ranks (torch.distributed, NCCL). Every rank holds the
model's attention and router (replicated here: the MoE contract is what is
shown) and sees every token; its sparse MoE blocks compute through a session
opened with group={"rank", "size"} (tensor parallelism), which returns the partial sum of the experts
its rank owns (moe/types.h ExpertOwner: hits from its cache, misses on the
CPU server), and torch's all-reduce adds the ranks' partials — the union of
the GPUs' caches is one cache, at no communication beyond that all-reduce.

Prints (rank 0; and writes to --out) markdown tables:
  - correctness: per-layer all-reduced output vs the original block (relative
    error <= 1e-2) and the greedy tokens of generate() vs the all-GPU model;
  - one cache vs independent caches at the same slots per GPU: each rank's
    hit rate and decode tokens/s at each --batch (independent: every rank
    opens a whole-model session with the same cache and computes every
    expert itself, no all-reduce — what a replica per GPU gets).
Exit 1 when a correctness bound is missed.

  MOE_LIBRARY=.../libmoe.so PYTHONPATH=python /opt/torch/.venv/bin/python3 \\
      python/examples/transformers_tp.py --server-bin build/expert_server/moe-expert-server --gpus 2
"""
import argparse
import os
import platform
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import moe_expert_service as moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers_offload import common_arguments, decode_tokens_per_s, qwen3_30b_a3b_config, rel  # noqa: E402
from moe_expert_service.hf import ExpertServer  # noqa: E402


def sparse_blocks(model):
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers)]


def gate_weight_of(block):
    gate = block.gate
    return gate.weight if hasattr(gate, "weight") else gate.linear.weight


class TensorParallelSparseMoeBlock(torch.nn.Module):
    """Drop-in for a transformers sparse-MoE block on one rank: the router in
    torch, this rank's experts through MoeLayer, the ranks' partial sums added
    by dist.all_reduce (with tp=False: the whole layer on this GPU alone)."""

    def __init__(self, session, layer, gate_weight, top_k, renormalize, returns_logits, tp):
        super().__init__()
        self.moe = moe.MoeLayer(session, layer)
        self.gate_weight = torch.nn.Parameter(gate_weight.detach().clone(), requires_grad=False)
        self.top_k, self.renormalize, self.returns_logits, self.tp = top_k, renormalize, returns_logits, tp

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x, self.gate_weight)
        ids, w = moe.select_experts(logits, self.top_k, renormalize=self.renormalize)
        y = self.moe(x, ids, w)
        if self.tp:
            dist.all_reduce(y)  # the engine's all-reduce of the layer output: the ranks' shares add up
        y = y.reshape(shape)
        return (y, logits) if self.returns_logits else y


def rank_main(rank, a, ckpt, socket, result_file):
    from transformers import Qwen3MoeForCausalLM
    world = a.gpus
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.dirname(ckpt)}/rendezvous", rank=rank,
                            world_size=world)
    lines, failed = [], False

    def say(s=""):
        if rank == 0:
            print(s, flush=True)
            lines.append(s)

    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(f"cuda:{rank}").eval()
    config = model.config
    blocks = sparse_blocks(model)
    E, k = config.num_experts, config.num_experts_per_tok
    probe = torch.randn(1, 4, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        returns_logits = isinstance(blocks[0][1](probe), tuple)

    def session(frac, tp):
        opts = dict(model=ckpt, servers=[f"unix://{socket}"], device="cuda",
                    cache_experts_per_layer=int(round(frac * E)), max_tokens=512, max_top_k=k)
        if tp:
            opts.update(group={"rank": rank, "size": world})
        return moe.Session(**opts)

    def swap(s, tp):
        for i, blk in blocks:
            model.model.layers[i].mlp = TensorParallelSparseMoeBlock(
                s, i, gate_weight_of(blk), k, config.norm_topk_prob, returns_logits, tp)

    def restore():
        for i, blk in blocks:
            model.model.layers[i].mlp = blk

    say(f"## transformers_tp: Qwen3-30B-A3B geometry, {a.layers} layers, {world} GPUs (tensor parallel)")
    say(f"`{' '.join(sys.argv)}`; torch {torch.__version__}, {torch.cuda.get_device_name(rank)} x {world}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    # ---- correctness ----------------------------------------------------------
    say("\n### correctness\n\n| check | value | bound |\n|---|---|---|")
    s = session(0.25, tp=True)
    worst = 0.0
    with torch.no_grad():
        for i, blk in blocks:
            torch.manual_seed(100 + i)  # the same tokens on every rank
            x = torch.randn(2, 8, config.hidden_size, device="cuda", dtype=torch.bfloat16)
            ref = blk(x)
            ref = ref[0] if isinstance(ref, tuple) else ref
            got = TensorParallelSparseMoeBlock(s, i, gate_weight_of(blk), k, config.norm_topk_prob, returns_logits,
                                               True)(x)
            got = got[0] if isinstance(got, tuple) else got
            worst = max(worst, rel(got, ref))
    failed |= worst > 1e-2
    say(f"| per-layer all-reduced MoE output vs original block (max over {len(blocks)} layers, rank {rank}) | "
        f"{worst:.2e} | 1e-2 |")
    torch.manual_seed(2)
    prompt = torch.randint(0, config.vocab_size, (1, a.prompt), device="cuda")
    kw = dict(do_sample=False, max_new_tokens=a.check_steps, min_new_tokens=a.check_steps, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        want = model.generate(prompt, **kw)
        swap(s, tp=True)
        got = model.generate(prompt, **kw)
        restore()
    same = 0
    while same < a.check_steps and torch.equal(want[0, a.prompt + same], got[0, a.prompt + same]):
        same += 1
    say(f"| greedy tokens of generate() with the ranks' caches equal to the all-GPU model's | "
        f"{same}/{a.check_steps} | |")
    st = s.totals()
    own = st["hit_pairs"] + st["cpu_pairs"] + st["copied_pairs"]
    say(f"| rank 0 session counters: pairs of its own experts / hits | {own} / {st['hit_pairs']} | |")
    s.close()

    # ---- one cache vs independent caches ---------------------------------------
    batches = [int(b) for b in a.batch.split(",")]
    say("\n### one cache over the GPUs vs a cache per GPU (same slots per GPU)\n")
    say("| configuration | hit rate (rank 0) | " + " | ".join(f"decode tok/s, batch {b}" for b in batches) + " |")
    say("|---|---|" + "---|" * len(batches))
    for frac in [float(f) for f in a.cache.split(",")]:
        for tp in (False, True):
            s = session(frac, tp)
            swap(s, tp)
            with torch.no_grad():
                decode_tokens_per_s(model, 1, a.prompt, a.new_tokens, config.vocab_size)  # warms the caches
                before = s.totals()
                rows = [decode_tokens_per_s(model, b, a.prompt, a.new_tokens, config.vocab_size) for b in batches]
            restore()
            st = s.totals()
            hits = st["hit_pairs"] - before["hit_pairs"]
            pairs = max(hits + st["cpu_pairs"] - before["cpu_pairs"] + st["copied_pairs"] - before["copied_pairs"], 1)
            name = (f"one cache: {world} ranks x {int(round(frac * E))} slots/layer, each rank its experts, "
                    f"all-reduce" if tp else f"independent: every GPU caches {int(round(frac * E))} slots/layer "
                    f"of all experts")
            say(f"| {name} | {hits / pairs:.1%} | " + " | ".join(f"{r:.1f}" for r in rows) + " |")
            s.close()
    flags = torch.tensor([1.0 if failed else 0.0], device="cuda")
    dist.all_reduce(flags)
    say(f"\nresult: {'FAIL' if flags.item() > 0 else 'ok'}")
    if rank == 0:
        with open(result_file, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()
    if flags.item() > 0:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, cache="0.25", check_steps=16)
    ap.add_argument("--gpus", type=int, default=2, help="ranks (one GPU each)")
    a = ap.parse_args()
    if torch.cuda.device_count() < a.gpus:
        print(f"transformers_tp: needs {a.gpus} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    from transformers import Qwen3MoeForCausalLM
    work = tempfile.mkdtemp(prefix="moe_tp_")
    ckpt = os.path.join(work, "qwen3-moe")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda:0"):
        model = Qwen3MoeForCausalLM(qwen3_30b_a3b_config(a.layers)).eval()
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(ckpt, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    server = ExpertServer(ckpt, server_bin=a.server_bin, threads=a.threads)
    result = os.path.join(work, "result.md")
    try:
        mp.spawn(rank_main, args=(a, ckpt, server.socket, result), nprocs=a.gpus, join=True)
        rc = 0
    except mp.ProcessRaisedException as e:
        print(f"transformers_tp: a rank failed: {e}", file=sys.stderr)
        rc = 1
    except mp.ProcessExitedException as e:
        print(f"transformers_tp: a rank exited: {e}", file=sys.stderr)
        rc = 1
    finally:
        server.close()
    if a.out and os.path.exists(result):
        with open(a.out, "a") as f, open(result) as r:
            f.write(r.read())
    shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
