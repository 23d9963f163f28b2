#!/usr/bin/env python3
"""The PyTorch peer of the GPU decode benchmark: the same Llama-3-8B-shaped model (random
BF16 weights, same shapes), batch 1, a static KV cache and one decode step captured as a
CUDA graph and replayed, as a well-written PyTorch server would run it (SDPA attention over
the whole static cache with a position mask, fused qkv and gate|up products, greedy argmax
on the device). Prints one JSON line: tokens/s, and bytes/token for the roofline.

  torch_peer.py [--layers 32] [--prompt 128] [--tokens 256] [--json-out FILE]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=32)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--tokens", type=int, default=256)
p.add_argument("--json-out")
a = p.parse_args()

H, I, V, NH, NKV, HD, EPS = 4096, 14336, 128256, 32, 8, 128, 1e-5
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
S = a.prompt + a.tokens + 1  # static cache length


def w(*shape):
    return (0.02 * torch.randn(*shape, device=dev)).to(dt)


emb = w(V, H)
lm_head = w(V, H)
final_norm = torch.ones(H, device=dev, dtype=dt)
layers = []
for _ in range(a.layers):
    layers.append(dict(ln1=torch.ones(H, device=dev, dtype=dt), qkv=w((NH + 2 * NKV) * HD, H),
                       o=w(H, NH * HD), ln2=torch.ones(H, device=dev, dtype=dt),
                       gu=w(2 * I, H), down=w(H, I)))
kcache = torch.zeros(a.layers, 1, NKV, S, HD, device=dev, dtype=dt)
vcache = torch.zeros_like(kcache)
inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=dev).float() / HD))
ang = torch.arange(S, device=dev).float()[:, None] * inv[None, :]
cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)


def rms(x, wt):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dt) * wt


def rot(x, c, s):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


def step(tok, pos):
    """One decode step: tok [1] int64, pos [1] int64 (device tensors). Returns next tok."""
    x = emb[tok]  # [1, H]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    mask = (torch.arange(S, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
    for li, L in enumerate(layers):
        h = rms(x, L["ln1"])
        qkv = h @ L["qkv"].t()
        q = qkv[:, : NH * HD].view(1, NH, HD)
        k = qkv[:, NH * HD:(NH + NKV) * HD].view(1, NKV, HD)
        v = qkv[:, (NH + NKV) * HD:].view(1, NKV, HD)
        q, k = rot(q, c, s), rot(k, c, s)
        kcache[li].index_copy_(2, pos, k[:, :, None, :])
        vcache[li].index_copy_(2, pos, v[:, :, None, :])
        att = F.scaled_dot_product_attention(q[:, :, None, :], kcache[li], vcache[li],
                                             attn_mask=mask, enable_gqa=True)
        x = x + att.reshape(1, NH * HD) @ L["o"].t()
        h = rms(x, L["ln2"])
        gu = h @ L["gu"].t()
        x = x + (F.silu(gu[:, :I]) * gu[:, I:]) @ L["down"].t()
    logits = rms(x, final_norm) @ lm_head.t()
    return logits.argmax(-1)


tok = torch.tensor([1], device=dev)
pos = torch.tensor([0], device=dev)
with torch.no_grad():
    # Fill the cache up to the prompt length eagerly (the peer's prefill is not timed).
    for i in range(a.prompt):
        pos.fill_(i)
        tok = step(tok, pos)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            out = step(tok, pos)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    static_tok, static_pos = tok.clone(), pos.clone()
    with torch.cuda.graph(g):
        static_out = step(static_tok, static_pos)
    static_pos.fill_(a.prompt)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for i in range(a.tokens):
        g.replay()
        static_tok.copy_(static_out)
        static_pos.add_(1)
    e1.record()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1)
params = sum(t.numel() for L in layers for t in L.values()) + emb.numel() + lm_head.numel()
res = {"peer": "pytorch static KV cache + CUDA graph", "torch": torch.__version__,
       "device": torch.cuda.get_device_name(), "tokens": a.tokens,
       "tok_s": a.tokens / (ms / 1e3), "weight_bytes": params * 2,
       "kv_bytes_per_token_read": 2 * a.layers * NKV * S * HD * 2}
print(json.dumps(res))
if a.json_out:
    with open(a.json_out, "w") as f:
        json.dump(res, f, indent=1)
