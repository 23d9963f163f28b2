#!/usr/bin/env python3
"""Reference checkpoints of the engine's newer families, written as their publishers store them.

tools/gen_reference.py builds each dense model in transformers and saves it. Here the files
come first: every tensor is made with its Hugging Face Hub name, shape and storage format
(bf16; FP8 e4m3 with 128x128 block scales; MXFP4 blocks with e8m0 scales), and transformers
then loads the directory with from_pretrained, as a user would. So the tensor names and
layouts the engine reads are the ones transformers accepts (its loading report must show no
missing or unexpected tensor, apart from the multi-token-prediction layers the engine skips
on purpose), and the reference logits are transformers' own, in float32 on the CPU, eager
attention and eager experts, no KV cache.

Quantized weights are drawn so that dequantizing them is exact (FP8 block scales and MXFP4's
e8m0 scales with few significant bits): the weights transformers dequantizes, the weights the
engine widens in its kernels and the weights of the float32 reference are the same numbers.
For each quantized checkpoint the reference model is the dequantized one; where transformers
has a dequantizing loader (FineGrainedFP8Config / Mxfp4Config with dequantize=True) the same
directory is also loaded through it and must give the same logits (recorded in the stats).

Per model: the logits of the prompt's last positions, a greedy continuation (full
recomputation each step), per-step top logits and full logits of a few steps, RoPE
frequencies, and stats: the smallest greedy top-2 gap and the smallest router margin (the
last chosen expert's choice value against the first unchosen one, over every MoE layer and
position the reference computed). Seeds with a greedy gap under MIN_GAP or a router margin
under MIN_ROUTER_MARGIN are skipped for the next seed.

Usage (on the GPU machine: torch, transformers, safetensors; no internet):
    python3 tools/gen_reference_hub.py --out OUTDIR [--only name,name]
"""

import argparse
import json
import math
import os
import sys
import traceback

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_reference import (FULL_STEP_LOGITS, GREEDY_STEPS, MAX_SEED_TRIES, MIN_GAP,  # noqa: E402
                           PROMPT_LOGIT_POSITIONS, TOPK_PER_STEP, f7, make_prompt)

MIN_ROUTER_MARGIN = 1e-4

# ---- the models ------------------------------------------------------------------------------
# name: directory; arch; dtype: storage of unquantized tensors; quant: None | "fp8" | "mxfp4";
# config: config.json fields (transformers' config class fills the rest); shards: files.
MODELS = [
    dict(
        name="qwen3_moe", arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", dtype="bfloat16",
        quant=None, shards=2, seed=5005,
        config=dict(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, attention_bias=False,
                    use_sliding_window=False, num_experts=32, num_experts_per_tok=8,
                    moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[1], rope_theta=1000000.0),
    ),
    dict(
        name="mixtral", arch="MixtralForCausalLM", model_type="mixtral", dtype="bfloat16",
        quant=None, shards=1, seed=6006,
        config=dict(vocab_size=640, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=16, rope_theta=1000000.0),
    ),
    dict(
        # GLM-4.5's structure: 64 experts top-8 in 8 groups (4 kept), a shared expert, a first
        # dense layer, partial rotary 0.5, q/k/v bias, per-head q/k norm, routed scaling 2.5,
        # one multi-token-prediction layer in the files (skipped by the engine).
        name="glm4_moe", arch="Glm4MoeForCausalLM", model_type="glm4_moe", dtype="bfloat16",
        quant=None, shards=3, seed=7007, mtp_layers=1,
        config=dict(vocab_size=896, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, attention_bias=True, use_qk_norm=True,
                    partial_rotary_factor=0.5, n_routed_experts=64, n_shared_experts=1,
                    num_experts_per_tok=8, moe_intermediate_size=32, first_k_dense_replace=1,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                    num_nextn_predict_layers=1, rope_theta=10000.0),
    ),
    dict(
        name="minimax_m2", arch="MiniMaxM2ForCausalLM", model_type="minimax_m2",
        dtype="bfloat16", quant=None, shards=1, seed=8008,
        config=dict(vocab_size=640, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, num_local_experts=16, num_experts_per_tok=4,
                    partial_rotary_factor=0.5, rotary_dim=16, use_qk_norm=True,
                    qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
                    rope_theta=5000000.0),
    ),
    dict(
        # FP8 block-scaled dense Qwen3 (as Qwen3-*-FP8 are stored): every projection e4m3 with
        # 128x128 block scales; embedding, norms and lm_head bf16.
        name="qwen3_fp8", arch="Qwen3ForCausalLM", model_type="qwen3", dtype="bfloat16",
        quant="fp8", shards=2, seed=9009,
        config=dict(vocab_size=768, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, attention_bias=False,
                    use_sliding_window=False, rope_theta=1000000.0),
    ),
    dict(
        # FP8 MoE (Qwen3-30B-A3B-FP8's layout): experts, attention and the dense layer in FP8;
        # the router, norms, embedding and lm_head bf16. Expert width 256 keeps whole
        # 128-blocks at two ranks.
        name="qwen3_moe_fp8", arch="Qwen3MoeForCausalLM", model_type="qwen3_moe",
        dtype="bfloat16", quant="fp8", shards=2, seed=10010,
        config=dict(vocab_size=768, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, attention_bias=False,
                    use_sliding_window=False, num_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[0], rope_theta=1000000.0),
    ),
    dict(
        # gpt-oss: sinks, alternating sliding (window 8) and full layers, YaRN, q/k/v/o bias,
        # a router with bias, experts with biases and gate/up interleaved, the clamped
        # activation; experts in MXFP4.
        name="gpt_oss", arch="GptOssForCausalLM", model_type="gpt_oss", dtype="bfloat16",
        quant="mxfp4", shards=2, seed=11011,
        config=dict(vocab_size=640, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=8, swiglu_limit=7.0, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "full_attention"],
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                      beta_slow=1.0, original_max_position_embeddings=4096,
                                      truncate=False),
                    rope_theta=150000.0, experts_per_token=2),
    ),
    dict(
        # DeepSeek-V3's structure: q LoRA (layer 0 direct q via q_lora_rank null is in
        # deepseek_v3_qdirect), latent KV 64 + RoPE key 16, YaRN with mscale, 16 experts top-4
        # in 4 groups (2 kept), a shared expert, a first dense layer.
        name="deepseek_v3", arch="DeepseekV3ForCausalLM", model_type="deepseek_v3",
        dtype="bfloat16", quant=None, shards=2, seed=12012, mtp_layers=1,
        config=dict(vocab_size=768, hidden_size=128, intermediate_size=256,
                    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
                    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=48,
                    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                    v_head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    num_nextn_predict_layers=1, topk_method="noaux_tc", rope_interleave=True,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                      beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8,
                                      original_max_position_embeddings=128),
                    rope_theta=10000.0),
    ),
    dict(
        name="deepseek_v3_qdirect", arch="DeepseekV3ForCausalLM", model_type="deepseek_v3",
        dtype="bfloat16", quant=None, shards=1, seed=13013,
        config=dict(vocab_size=640, hidden_size=128, intermediate_size=256,
                    moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                    num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=None,
                    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                    v_head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    topk_method="noaux_tc", rope_interleave=True,
                    rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                      beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
                                      original_max_position_embeddings=1024),
                    rope_theta=10000.0),
    ),
    dict(
        # FP8 DeepSeek-V3 (as DeepSeek publishes it): every projection e4m3 with 128x128 block
        # scales, kv_a_proj_with_mqa's 192 rows a partial block; widths whose head and expert
        # splits stay whole 128-blocks at two ranks.
        name="deepseek_v3_fp8", arch="DeepseekV3ForCausalLM", model_type="deepseek_v3",
        dtype="bfloat16", quant="fp8", shards=2, seed=14014,
        config=dict(vocab_size=768, hidden_size=256, intermediate_size=512,
                    moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=256,
                    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                    v_head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    topk_method="noaux_tc", rope_interleave=True,
                    rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=32.0,
                                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                      original_max_position_embeddings=512),
                    rope_theta=10000.0),
    ),
]

# ---- tensors by Hub name ---------------------------------------------------------------------


class Gen:
    """Seeded tensors with the scales that give well-separated logits."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape):
        return torch.randn(shape, generator=self.g, dtype=torch.float32)

    def linear(self, out, inn, scale=1.0):
        return self.randn(out, inn) * (scale / math.sqrt(inn))

    def norm(self, n):
        return 1.0 + 0.2 * self.randn(n)

    def bias(self, n, scale=0.3):
        return scale * self.randn(n)


def attention_tensors(g, p, c, out, qk_norm):
    H, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    out[p + "input_layernorm.weight"] = g.norm(H)
    out[p + "post_attention_layernorm.weight"] = g.norm(H)
    out[p + "self_attn.q_proj.weight"] = g.linear(nh * hd, H)
    out[p + "self_attn.k_proj.weight"] = g.linear(nkv * hd, H)
    out[p + "self_attn.v_proj.weight"] = g.linear(nkv * hd, H)
    out[p + "self_attn.o_proj.weight"] = g.linear(H, nh * hd)
    if c.get("attention_bias"):
        out[p + "self_attn.q_proj.bias"] = g.bias(nh * hd)
        out[p + "self_attn.k_proj.bias"] = g.bias(nkv * hd)
        out[p + "self_attn.v_proj.bias"] = g.bias(nkv * hd)
    if qk_norm == "head":
        out[p + "self_attn.q_norm.weight"] = g.norm(hd)
        out[p + "self_attn.k_norm.weight"] = g.norm(hd)
    elif qk_norm == "layer":
        out[p + "self_attn.q_norm.weight"] = g.norm(nh * hd)
        out[p + "self_attn.k_norm.weight"] = g.norm(nkv * hd)


def mlp_tensors(g, p, H, I, out, names=("gate_proj", "up_proj", "down_proj")):
    out[p + names[0] + ".weight"] = g.linear(I, H)
    out[p + names[1] + ".weight"] = g.linear(I, H)
    out[p + names[2] + ".weight"] = g.linear(H, I)


def make_tensors(spec, seed):
    """The checkpoint's tensors (float32 values, Hub names) before storage rounding."""
    c, arch, g, t = spec["config"], spec["arch"], Gen(seed), {}
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    t["model.embed_tokens.weight"] = g.randn(V, H)
    t["model.norm.weight"] = g.norm(H)
    if not c.get("tie_word_embeddings"):
        t["lm_head.weight"] = g.linear(V, H, 2.0)
    layers = L + spec.get("mtp_layers", 0)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        if arch == "Qwen3MoeForCausalLM":
            attention_tensors(g, p, c, t, "head")
            moe = layer not in c["mlp_only_layers"] and (layer + 1) % c["decoder_sparse_step"] == 0
            if moe:
                E, I = c["num_experts"], c["moe_intermediate_size"]
                t[p + "mlp.gate.weight"] = g.linear(E, H)
                for e in range(E):
                    mlp_tensors(g, p + f"mlp.experts.{e}.", H, I, t)
            else:
                mlp_tensors(g, p + "mlp.", H, c["intermediate_size"], t)
        elif arch == "Qwen3ForCausalLM":
            attention_tensors(g, p, c, t, "head")
            mlp_tensors(g, p + "mlp.", H, c["intermediate_size"], t)
        elif arch == "MixtralForCausalLM":
            attention_tensors(g, p, c, t, None)
            E, I = c["num_local_experts"], c["intermediate_size"]
            t[p + "block_sparse_moe.gate.weight"] = g.linear(E, H)
            for e in range(E):
                mlp_tensors(g, p + f"block_sparse_moe.experts.{e}.", H, I, t, ("w1", "w3", "w2"))
        elif arch == "MiniMaxM2ForCausalLM":
            attention_tensors(g, p, c, t, "layer")
            E, I = c["num_local_experts"], c["intermediate_size"]
            t[p + "block_sparse_moe.gate.weight"] = g.linear(E, H)
            t[p + "block_sparse_moe.e_score_correction_bias"] = g.bias(E, 0.1)
            for e in range(E):
                mlp_tensors(g, p + f"block_sparse_moe.experts.{e}.", H, I, t, ("w1", "w3", "w2"))
        elif arch == "Glm4MoeForCausalLM":
            attention_tensors(g, p, c, t, "head" if c.get("use_qk_norm") else None)
            if layer < c["first_k_dense_replace"]:
                mlp_tensors(g, p + "mlp.", H, c["intermediate_size"], t)
            else:
                E, I = c["n_routed_experts"], c["moe_intermediate_size"]
                t[p + "mlp.gate.weight"] = g.linear(E, H)
                t[p + "mlp.gate.e_score_correction_bias"] = g.bias(E, 0.1)
                for e in range(E):
                    mlp_tensors(g, p + f"mlp.experts.{e}.", H, I, t)
                mlp_tensors(g, p + "mlp.shared_experts.", H, I * c["n_shared_experts"], t)
        elif arch == "GptOssForCausalLM":
            attention_tensors(g, p, c, t, None)
            nh = c["num_attention_heads"]
            t[p + "self_attn.o_proj.bias"] = g.bias(H)
            t[p + "self_attn.sinks"] = g.bias(nh, 1.0)
            E, I = c["num_local_experts"], c["intermediate_size"]
            t[p + "mlp.router.weight"] = g.linear(E, H)
            t[p + "mlp.router.bias"] = g.bias(E, 0.3)
            # Dequantized values; the MXFP4 storage is made from them in store().
            t[p + "mlp.experts.gate_up_proj"] = torch.stack([g.linear(2 * I, H) for _ in range(E)])
            t[p + "mlp.experts.gate_up_proj_bias"] = g.bias(E * 2 * I, 0.3).view(E, 2 * I)
            t[p + "mlp.experts.down_proj"] = torch.stack([g.linear(H, I) for _ in range(E)])
            t[p + "mlp.experts.down_proj_bias"] = g.bias(E * H, 0.3).view(E, H)
        elif arch == "DeepseekV3ForCausalLM":
            nh = c["num_attention_heads"]
            qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            t[p + "input_layernorm.weight"] = g.norm(H)
            t[p + "post_attention_layernorm.weight"] = g.norm(H)
            if c.get("q_lora_rank"):
                r = c["q_lora_rank"]
                t[p + "self_attn.q_a_proj.weight"] = g.linear(r, H)
                t[p + "self_attn.q_a_layernorm.weight"] = g.norm(r)
                t[p + "self_attn.q_b_proj.weight"] = g.linear(nh * qk, r)
            else:
                t[p + "self_attn.q_proj.weight"] = g.linear(nh * qk, H)
            kr = c["kv_lora_rank"]
            t[p + "self_attn.kv_a_proj_with_mqa.weight"] = g.linear(kr + c["qk_rope_head_dim"], H)
            t[p + "self_attn.kv_a_layernorm.weight"] = g.norm(kr)
            t[p + "self_attn.kv_b_proj.weight"] = g.linear(
                nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), kr)
            t[p + "self_attn.o_proj.weight"] = g.linear(H, nh * c["v_head_dim"])
            if layer < c["first_k_dense_replace"]:
                mlp_tensors(g, p + "mlp.", H, c["intermediate_size"], t)
            else:
                E, I = c["n_routed_experts"], c["moe_intermediate_size"]
                t[p + "mlp.gate.weight"] = g.linear(E, H)
                t[p + "mlp.gate.e_score_correction_bias"] = g.bias(E, 0.1)
                for e in range(E):
                    mlp_tensors(g, p + f"mlp.experts.{e}.", H, I, t)
                mlp_tensors(g, p + "mlp.shared_experts.", H, I * c["n_shared_experts"], t)
            if layer >= L:  # the multi-token-prediction layer's own tensors
                t[p + "enorm.weight"] = g.norm(H)
                t[p + "hnorm.weight"] = g.norm(H)
                t[p + "eh_proj.weight"] = g.linear(H, 2 * H)
                t[p + "shared_head.norm.weight"] = g.norm(H)
        else:
            raise SystemExit(f"no tensor recipe for {arch}")
    return t


# ---- storage formats -------------------------------------------------------------------------

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                     -4.0, -6.0])


def bf16_round(x):
    return x.to(torch.bfloat16).to(torch.float32)


def fp8_block(w, block=128):
    """(e4m3 tensor, fp32 scale_inv [ceil(N/128)][ceil(K/128)], dequantized fp32) for one
    weight: each block's scale is a bf16 number (8 significant bits), so value x scale is
    exact in fp32 and in bf16."""
    N, K = w.shape
    nb, kb = (N + block - 1) // block, (K + block - 1) // block
    scale = torch.empty(nb, kb, dtype=torch.float32)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = bf16_round(torch.tensor(float(blk.abs().max()) / FP8_MAX + 1e-12))
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                (blk / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = q.to(torch.float32) * scale.repeat_interleave(block, 0)[:N].repeat_interleave(
        block, 1)[:, :K]
    return q, scale, deq


def mxfp4(w):
    """(blocks U8 [rows][cols/32][16], scales U8 [rows][cols/32], dequantized fp32) of a
    [rows][cols] weight: each 32-value block takes the power-of-two scale that fits its
    largest value into e2m1's 6, values round to the nearest e2m1 code; low nibble first."""
    rows, cols = w.shape
    assert cols % 32 == 0
    wb = w.view(rows, cols // 32, 32)
    amax = wb.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scale = torch.pow(2.0, exp)
    x = wb / scale.unsqueeze(-1)
    pos = E2M1[:8]
    idx = (x.abs().unsqueeze(-1) - pos).abs().argmin(-1)  # nearest magnitude
    code = idx + (x < 0).to(torch.int64) * 8
    deq = (E2M1[code] * scale.unsqueeze(-1)).view(rows, cols)
    code = code.to(torch.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()  # [rows][cols/32][16]
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales, deq


FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", ".bias", "sinks")


def store(spec, t):
    """(tensors to write, dequantized float32 tensors for the reference model, quant config)."""
    quant = spec["quant"]
    files, ref = {}, {}
    qcfg = None
    if quant == "fp8":
        qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    if quant == "mxfp4":
        qcfg = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
    for name, v in t.items():
        if quant == "fp8" and v.dim() == 2 and not any(s in name for s in FP8_SKIP):
            q, s, deq = fp8_block(v)
            files[name] = q
            files[name + "_scale_inv"] = s
            ref[name] = deq
            continue
        if quant == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E = v.shape[0]
            bl, sc, dq = zip(*(mxfp4(v[e]) for e in range(E)))
            files[name + "_blocks"] = torch.stack(bl)
            files[name + "_scales"] = torch.stack(sc)
            ref[name] = torch.stack(dq)
            continue
        keep_f32 = name.endswith("e_score_correction_bias")
        if spec["dtype"] == "bfloat16" and not keep_f32:
            files[name] = v.to(torch.bfloat16)
            ref[name] = bf16_round(v)
        else:
            files[name] = v.clone()
            ref[name] = v.clone()
    return files, ref, qcfg


def write_dir(outdir, spec, files, cfg_json):
    os.makedirs(outdir, exist_ok=True)
    for f in os.listdir(outdir):
        os.remove(os.path.join(outdir, f))
    names = sorted(files)
    n = spec["shards"]
    per = (len(names) + n - 1) // n
    weight_map, total = {}, 0
    for s in range(n):
        part = names[s * per:(s + 1) * per]
        if not part:
            continue
        fname = "model.safetensors" if n == 1 else "model-%05d-of-%05d.safetensors" % (s + 1, n)
        save_file({k: files[k].contiguous() for k in part}, os.path.join(outdir, fname),
                  metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += files[k].numel() * files[k].element_size()
    if n > 1:
        with open(os.path.join(outdir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(outdir, "config.json"), "w") as fh:
        json.dump(cfg_json, fh, indent=2)
    with open(os.path.join(outdir, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": cfg_json.get("bos_token_id"),
                   "eos_token_id": cfg_json.get("eos_token_id")}, fh, indent=2)


def config_json(spec, qcfg):
    """config.json through transformers' config class (as save_pretrained writes it), with
    the fields it does not keep added back. transformers 5 keeps rope_theta, the scaling and
    the partial rotary factor together in rope_parameters."""
    kwargs = dict(spec["config"])
    rope = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 10000.0)}
    scaling = kwargs.pop("rope_scaling", None)
    if scaling:
        rope.update(scaling)
    if "partial_rotary_factor" in kwargs:
        rope["partial_rotary_factor"] = kwargs["partial_rotary_factor"]
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type") != "default":
            kwargs["rope_scaling"] = rope
    cfg = AutoConfig.for_model(spec["model_type"], **kwargs)
    cfg.architectures = [spec["arch"]]
    d = cfg.to_dict()
    for k, v in kwargs.items():  # what the class dropped stays as given
        d.setdefault(k, v)
    d["torch_dtype"] = spec["dtype"]
    if qcfg:
        d["quantization_config"] = qcfg
    elif "quantization_config" in d:
        del d["quantization_config"]
    return d


# ---- loading and the reference ---------------------------------------------------------------

def load(outdir, **extra):
    kw = dict(attn_implementation="eager", dtype=torch.float32)
    try:
        m, info = AutoModelForCausalLM.from_pretrained(outdir, output_loading_info=True,
                                                       experts_implementation="eager", **kw,
                                                       **extra)
    except TypeError:
        m, info = AutoModelForCausalLM.from_pretrained(outdir, output_loading_info=True, **kw,
                                                       **extra)
    return m.to(torch.float32).eval(), info


def logits_of(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0]


class RouterProbe:
    """Hooks on every router: the smallest margin between the last chosen and the first
    unchosen expert's choice value, recomputed from the router logits as the family routes."""

    def __init__(self, model, spec):
        self.min_margin = math.inf
        self.hooks = []
        c = spec["config"]
        arch = spec["arch"]
        self.k = c.get("num_experts_per_tok") or c.get("experts_per_token")
        for name, mod in model.named_modules():
            leaf = name.split(".")[-1]
            if leaf in ("gate", "router") and hasattr(mod, "weight") and mod.weight.dim() == 2:
                parent = model.get_submodule(name.rsplit(".", 1)[0])
                self.hooks.append(mod.register_forward_hook(self.make(parent, mod, arch, c)))

    def make(self, parent, mod, arch, c):
        def hook(_m, inp, out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            logits = x @ mod.weight.float().t()
            if getattr(mod, "bias", None) is not None and arch == "GptOssForCausalLM":
                logits = logits + mod.bias.float()
            if arch in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM"):
                s = torch.sigmoid(logits)
                bias = getattr(mod, "e_score_correction_bias", None)
                if bias is None:
                    bias = getattr(parent, "e_score_correction_bias", None)
                choice = s + (bias.float() if bias is not None else 0)
                ng, tg = c.get("n_group", 1) or 1, c.get("topk_group", 1) or 1
                if ng > 1:
                    E = choice.shape[-1]
                    gs = choice.view(-1, ng, E // ng).topk(2, dim=-1)[0].sum(-1)
                    gi = gs.topk(tg, dim=-1)[1]
                    gm = torch.zeros_like(gs).scatter_(1, gi, 1)
                    sm = gm.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
                    choice = choice.masked_fill(~sm.bool(), float("-inf"))
            elif arch == "GptOssForCausalLM":
                choice = logits
            else:
                choice = torch.softmax(logits, dim=-1)
            top = choice.topk(self.k + 1, dim=-1)[0]
            m = float((top[:, self.k - 1] - top[:, self.k]).min())
            self.min_margin = min(self.min_margin, m)
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def greedy(model, prompt, steps):
    ids = list(prompt)
    gen, tops, full, gaps = [], [], {}, []
    for step in range(steps):
        last = logits_of(model, ids)[-1]
        vals, idx = torch.topk(last, TOPK_PER_STEP)
        nxt = int(torch.argmax(last).item())
        gen.append(nxt)
        gaps.append(float(vals[0] - vals[1]))
        tops.append({"ids": [int(i) for i in idx], "logits": [f7(v) for v in vals]})
        if step in FULL_STEP_LOGITS:
            full[str(step)] = [f7(v) for v in last]
        ids.append(nxt)
    return gen, tops, full, gaps


def reference_model(outdir, ref_tensors, spec, qcfg):
    """The float32 reference: the directory loaded by transformers; for a quantized
    checkpoint the same architecture built unquantized from the dequantized values."""
    if not qcfg:
        model, info = load(outdir)
        return model, info, {}
    # Build an unquantized twin directory (float32 values) and load it.
    twin = outdir + ".dequantized"
    files = {k: v.contiguous() for k, v in ref_tensors.items()}
    if spec["quant"] == "mxfp4":
        # Unquantized gpt-oss checkpoints keep the experts as transformers holds them:
        # gate_up_proj [E][hidden][2 x inter], down_proj [E][inter][hidden].
        for k in list(files):
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                files[k] = files[k].transpose(1, 2).contiguous()
    cfg = config_json(spec, None)
    cfg["torch_dtype"] = "float32"
    write_dir(twin, dict(spec, shards=1), files, cfg)
    model, info = load(twin)
    return model, info, {"reference": "dequantized copy (exact values) loaded unquantized"}


def check_loading(info, spec):
    bad = []
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    unexpected = list(info.get("unexpected_keys", []))
    L = spec["config"]["num_hidden_layers"]
    mtp = [f"model.layers.{L + i}." for i in range(spec.get("mtp_layers", 0))]
    unexpected = [k for k in unexpected if not any(k.startswith(p) for p in mtp)]
    if missing:
        bad.append(f"missing after loading: {sorted(missing)[:8]}")
    if unexpected:
        bad.append(f"not used by transformers: {sorted(unexpected)[:8]}")
    mism = info.get("mismatched_keys", [])
    if mism:
        bad.append(f"shape mismatches: {list(mism)[:4]}")
    return bad


def generate_one(spec, outroot):
    failures = []
    prompt = make_prompt(spec["config"]["vocab_size"])
    outdir = os.path.join(outroot, spec["name"])
    chosen = None
    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        t = make_tensors(spec, seed)
        files, ref_t, qcfg = store(spec, t)
        cfg = config_json(spec, qcfg)
        write_dir(outdir, spec, files, cfg)
        model, info, notes = reference_model(outdir, ref_t, spec, qcfg)
        bad = check_loading(info, spec)
        if bad:
            failures += [f"{spec['name']}: {b}" for b in bad]
            chosen = (seed, model, None, None, None, None, notes, math.nan)
            break
        probe = RouterProbe(model, spec)
        gen, tops, full, gaps = greedy(model, prompt, GREEDY_STEPS)
        probe.remove()
        margin = probe.min_margin if probe.hooks else math.inf
        if min(gaps) >= MIN_GAP and margin >= MIN_ROUTER_MARGIN:
            chosen = (seed, model, gen, tops, full, gaps, notes, margin)
            break
        print(f"# {spec['name']}: seed {seed}: greedy gap {min(gaps):.2e}, router margin "
              f"{margin:.2e}: trying the next seed", file=sys.stderr)
        chosen = (seed, model, gen, tops, full, gaps, notes, margin)
    seed, model, gen, tops, full, gaps, notes, margin = chosen
    if gen is None:
        return failures, 0
    if min(gaps) < MIN_GAP or margin < MIN_ROUTER_MARGIN:
        failures.append(f"{spec['name']}: no seed without near-ties in {MAX_SEED_TRIES} tries")

    all_logits = logits_of(model, prompt)
    prompt_logits = all_logits[-PROMPT_LOGIT_POSITIONS:]
    # A model without a router has no margin: null in the JSON (Infinity is not JSON).
    stats = {"max_abs_prompt_logit": float(all_logits.abs().max()),
             "min_greedy_top2_gap": min(gaps),
             "min_router_margin": margin if math.isfinite(margin) else None}
    # Reference noise: float64 (experts eager).
    try:
        import copy
        m64 = copy.deepcopy(model).to(torch.float64)
        stats["fp32_vs_fp64_max_abs_logit_diff"] = float(
            (all_logits.double() - logits_of(m64, prompt)).abs().max())
    except Exception as e:  # noqa: BLE001
        stats["fp32_vs_fp64_max_abs_logit_diff"] = None
        notes["fp64"] = f"float64 failed: {e!r}"
    # A quantized checkpoint through transformers' own dequantizing loader, when it has one.
    if spec["quant"]:
        try:
            if spec["quant"] == "fp8":
                qc = transformers.FineGrainedFP8Config(dequantize=True)
            else:
                qc = transformers.Mxfp4Config(dequantize=True)
            mq, _ = load(outdir, quantization_config=qc)
            mq = mq.to(torch.float32)
            d = float((logits_of(mq, prompt) - all_logits).abs().max())
            stats["transformers_dequantize_max_abs_logit_diff"] = d
            if d > 1e-4:
                partial = partial_block_differences(mq, model) if spec["quant"] == "fp8" else None
                if partial:
                    # transformers' dequantizing loader spreads a tensor's rows evenly over its
                    # scale rows when the last 128-block is partial (kv_a_proj_with_mqa's 576
                    # rows in DeepSeek-V3), so some rows take the next block's scale. The
                    # publishers' own kernels use whole 128-row blocks, as the reference does.
                    notes["transformers_dequantize"] = (
                        f"differs by {d:.3e} only in tensors whose last 128-block is partial "
                        f"({', '.join(partial)}): transformers' loader does not keep 128-row "
                        "blocks there; the reference is the exact block dequantization")
                else:
                    failures.append(f"{spec['name']}: transformers' dequantizing loader differs "
                                    f"from the exact dequantized reference by {d:.3e}")
        except Exception as e:  # noqa: BLE001
            stats["transformers_dequantize_max_abs_logit_diff"] = None
            notes["transformers_dequantize"] = f"failed: {e!r}"

    rot = getattr(model.model, "rotary_emb", None)
    inv_freq = [float(x) for x in rot.inv_freq] if rot is not None and hasattr(rot, "inv_freq") else []
    att_scale = float(getattr(rot, "attention_scaling", 1.0)) if rot is not None else 1.0
    files_list = sorted(f for f in os.listdir(outdir))
    ref = {
        "name": spec["name"], "architecture": spec["arch"], "weights_dtype": spec["dtype"],
        "quantization": spec["quant"], "sharded": spec["shards"] > 1, "seed": seed,
        "compute": "float32, CPU, attn_implementation=eager, experts eager, no KV cache",
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "vocab_size": spec["config"]["vocab_size"], "prompt_ids": prompt,
        "prompt_logits_positions": list(range(len(prompt) - PROMPT_LOGIT_POSITIONS, len(prompt))),
        "prompt_logits": [[f7(v) for v in row] for row in prompt_logits],
        "greedy_steps": GREEDY_STEPS, "greedy_ids": gen, "greedy_top": tops,
        "greedy_full_logits": full, "rope_inv_freq": inv_freq,
        "rope_attention_scaling": att_scale, "stats": stats, "notes": notes,
        "files": files_list,
    }
    with open(os.path.join(outdir, "reference.json"), "w") as fh:
        json.dump(ref, fh, indent=1)
    size = sum(os.path.getsize(os.path.join(outdir, f)) for f in files_list)
    print(f"{spec['name']:20s} {spec['arch']:24s} quant={spec['quant']} seed={seed} "
          f"bytes={size} min_gap={min(gaps):.3e} router_margin={margin:.3e} {stats}")
    return failures, size


def partial_block_differences(mq, model, block=128):
    """Names of the 2-D weights where two loads differ, when every such weight has a partial
    128-block (rows or columns not a multiple of it); None when any other weight differs."""
    sa, sb = mq.state_dict(), model.state_dict()
    names = []
    for k, y in sb.items():
        x = sa.get(k)
        if x is None or x.shape != y.shape:
            return None
        if torch.equal(x.float(), y.float()):
            continue
        if y.dim() != 2 or (y.shape[0] % block == 0 and y.shape[1] % block == 0):
            return None
        names.append(k)
    return names or None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(max(1, args.threads))
    os.makedirs(args.out, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    failures, total, done = [], 0, []
    print(f"# torch {torch.__version__} transformers {transformers.__version__}")
    for spec in MODELS:
        if only and spec["name"] not in only:
            continue
        try:
            f, size = generate_one(spec, args.out)
        except Exception as e:  # noqa: BLE001 - one family's failure leaves the others
            traceback.print_exc()
            f, size = [f"{spec['name']}: {e!r}"], 0
        failures += f
        total += size
        done.append(spec["name"])
    # The manifest lists every fixture in the directory: those of earlier runs with --only
    # stay, and their failures with them unless regenerated now.
    manifest = os.path.join(args.out, "manifest-hub.json")
    models, old_failures = [], []
    if os.path.exists(manifest):
        with open(manifest) as fh:
            prev = json.load(fh)
        models = [m for m in prev.get("models", []) if m not in done]
        old_failures = [f for f in prev.get("failures", []) if f.split(":")[0] not in done]
    with open(manifest + ".tmp", "w") as fh:
        json.dump({"generator": "tools/gen_reference_hub.py", "torch_version": torch.__version__,
                   "transformers_version": transformers.__version__, "models": models + done,
                   "failures": old_failures + failures}, fh, indent=1)
    os.replace(manifest + ".tmp", manifest)
    print(f"# total bytes {total}")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
