#!/usr/bin/env python3
"""llama.cpp's own reading of a GGUF, for gguf_test's cross-check (gguf-py + numpy).

  gguf_reference.py GGUF_PY vocab OUT.gguf
      writes a vocab-only GGUF (a handful of tokens) that make_model.py --vocab accepts
  gguf_reference.py GGUF_PY read FILE LAYER EXPERT OUT_PREFIX
      prints the MoE metadata as "key value" lines, and writes the dequantized values of
      expert EXPERT of layer LAYER (gate, up, down: OUT_PREFIX.{gate,up,down}.f32, row-major f32)
"""
import sys


def main():
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import gguf

    if sys.argv[2] == "vocab":
        w = gguf.GGUFWriter(sys.argv[3], "qwen3moe")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(["a", "b", "ab", "<|endoftext|>"])
        w.add_token_types([1, 1, 1, 3])
        w.add_token_merges(["a b"])
        w.add_eos_token_id(3)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return
    path, layer, expert, prefix = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    print("general.architecture", arch)
    for k in ("block_count", "embedding_length", "expert_count", "expert_used_count", "expert_feed_forward_length"):
        f = r.fields.get(f"{arch}.{k}")
        if f is not None:
            print(f"{arch}.{k}", f.contents())
    tensors = {t.name: t for t in r.tensors}
    for proj in ("gate", "up", "down"):
        t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
        print(f"{t.name} {t.tensor_type.name} {' '.join(str(int(d)) for d in t.shape)}")
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy shape (E, rows, cols)
        np.ascontiguousarray(values[expert], dtype=np.float32).tofile(f"{prefix}.{proj}.f32")


if __name__ == "__main__":
    main()
