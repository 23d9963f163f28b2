#!/usr/bin/env python3
"""Writes a Llama-3-8B-shaped checkpoint with random BF16 weights (config.json, sharded
safetensors + index) for the GPU benchmark. Weights come from torch on the GPU when there
is one (seconds), else the CPU; norms are 1 + noise, matrices N(0, 0.02).

  make_checkpoint.py OUT_DIR [--layers 32] [--shard-gib 4]
"""
import argparse
import json
import os
import struct

import torch

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--layers", type=int, default=32)
p.add_argument("--shard-gib", type=float, default=4.0)
a = p.parse_args()

H, I, V, NH, NKV, HD = 4096, 14336, 128256, 32, 8, 128
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": a.layers, "num_attention_heads": NH,
    "num_key_value_heads": NKV, "head_dim": HD, "vocab_size": V, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}
dev = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator(device=dev).manual_seed(1234)

tensors = [("model.embed_tokens.weight", (V, H), "mat")]
for l in range(a.layers):
    pre = f"model.layers.{l}."
    tensors += [(pre + "input_layernorm.weight", (H,), "norm"),
                (pre + "self_attn.q_proj.weight", (NH * HD, H), "mat"),
                (pre + "self_attn.k_proj.weight", (NKV * HD, H), "mat"),
                (pre + "self_attn.v_proj.weight", (NKV * HD, H), "mat"),
                (pre + "self_attn.o_proj.weight", (H, NH * HD), "mat"),
                (pre + "post_attention_layernorm.weight", (H,), "norm"),
                (pre + "mlp.gate_proj.weight", (I, H), "mat"),
                (pre + "mlp.up_proj.weight", (I, H), "mat"),
                (pre + "mlp.down_proj.weight", (H, I), "mat")]
tensors += [("model.norm.weight", (H,), "norm"), ("lm_head.weight", (V, H), "mat")]

os.makedirs(a.out, exist_ok=True)
limit = int(a.shard_gib * (1 << 30))
shards, cur, size = [], [], 0
for t in tensors:
    n = 2
    for d in t[1]:
        n *= d
    if cur and size + n > limit:
        shards.append(cur)
        cur, size = [], 0
    cur.append(t)
    size += n
shards.append(cur)
weight_map = {}
for si, shard in enumerate(shards):
    name = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
    header, off = {}, 0
    for tname, shape, _ in shard:
        n = 2
        for d in shape:
            n *= d
        header[tname] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
        weight_map[tname] = name
    hj = json.dumps(header).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    tmp = os.path.join(a.out, name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for tname, shape, kind in shard:
            if kind == "norm":
                x = 1.0 + 0.02 * torch.randn(shape, generator=gen, device=dev)
            else:
                x = 0.02 * torch.randn(shape, generator=gen, device=dev)
            f.write(x.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    os.rename(tmp, os.path.join(a.out, name))
with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
with open(os.path.join(a.out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
print(json.dumps({"dir": a.out, "shards": len(shards), "tensors": len(tensors)}))
