#!/usr/bin/env python3
"""The PyTorch peer of the MoE decode benchmark: the same model shape as spark-engine gpubench
--synthetic reads (a config.json of Qwen3-MoE or GLM-4.5 shape), random BF16 weights on the
GPU, batch 1, a static KV cache and one decode step captured as a CUDA graph and replayed,
as a well-written PyTorch server would run it: fused q|k|v and gate|up products, SDPA over
the static cache with a position mask, the router on the device, and the chosen experts as
one grouped product over the experts' weights (torch._grouped_mm: the rows sorted by expert,
no copy of the weights), greedy argmax on the device. Prints one JSON line: tokens/s and the
path the experts took.

gpt-oss (GptOssForCausalLM): its experts are random MXFP4 as published (packed e2m1 pairs and
e8m0 scales per 32: gpt-oss-120b in bf16 would not fit one GPU), and each step gathers the
chosen experts' packed bytes, widens them to bf16 with a lookup table and multiplies (what
PyTorch without a fused MXFP4 kernel does); attention adds each head's sink to the softmax
and the sliding layers mask all but their window; q/k/v/o, router and experts carry biases;
the clamped activation. RoPE is the plain rotation (YaRN's tables change no cost).

DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention decoded with kv_b_proj
absorbed (each head's q_nope taken into the latent space, scores over a static cache of the
normalised latent and the rotated RoPE key, the weighted latents taken out through the value
rows), the query through q_a/q_a_layernorm/q_b, grouped sigmoid routing with the correction
bias, a shared expert, dense first layers. The routed experts are random FP8 (e4m3 with a
float scale per 128x128 block, as published: the model's experts in bf16 would not fit one
GPU) and each step gathers the chosen experts' bytes and widens them to bf16 with their
scales before the products; the other matrices are bf16 (the peer has no block-scaled FP8
product), so it reads more bytes a token than the engine, which keeps them FP8.

Dense configs (no experts: Llama, Qwen3, and their FP8 checkpoints' shapes) run every layer's
gated MLP in bf16: for an FP8 shape that is what a user without FP8 kernels runs, the weights
dequantized to bf16 at load. The q/k norms are Qwen3's and MiniMax-M2's (and GLM's where
use_qk_norm says so).

  torch_moe_peer.py CONFIG.json [--layers N] [--prompt 128] [--tokens 256] [--json-out FILE]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("config")
p.add_argument("--layers", type=int, default=0, help="0: the config's")
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--tokens", type=int, default=256)
p.add_argument("--json-out")
a = p.parse_args()
c = json.load(open(a.config))
arch = c["architectures"][0]
L = a.layers or c["num_hidden_layers"]
H, V = c["hidden_size"], c["vocab_size"]
NH, NKV = c["num_attention_heads"], c["num_key_value_heads"]
HD = c.get("head_dim") or H // NH
EPS = c.get("rms_norm_eps", 1e-6)
glm = arch == "Glm4MoeForCausalLM"
gptoss = arch == "GptOssForCausalLM"
ds = arch == "DeepseekV3ForCausalLM"
E = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
K = c.get("num_experts_per_tok", 0)
dense = not E  # no experts: every layer a gated MLP
EI = c.get("moe_intermediate_size") or c["intermediate_size"]
I = c["intermediate_size"]
WINDOW = c.get("sliding_window") or 0
LAYER_TYPES = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(c["num_hidden_layers"])]
LIMIT = c.get("swiglu_limit", 7.0)
SI = EI * c.get("n_shared_experts", 0) if glm or ds else 0
dense_layers = (set(range(L)) if dense
                else set(range(c.get("first_k_dense_replace", 0))) if glm or ds
                else set(c.get("mlp_only_layers", [])))
if ds:
    R, NOPE, PE, VD = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    QR = c.get("q_lora_rank") or 0
    NG, TG = c.get("n_group", 1), c.get("topk_group", 1)
    rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
    MS = 1.0
    if rs.get("factor", 1) > 1 and rs.get("mscale_all_dim"):
        MS = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0
    DS_SCALE = (NOPE + PE) ** -0.5 * MS * MS
ROT = int(HD * c.get("partial_rotary_factor", 1.0))
qk_norm = arch.startswith(("Qwen3", "MiniMax")) or c.get("use_qk_norm", False)
bias = c.get("attention_bias", False)
scaling = c.get("routed_scaling_factor", 1.0)
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
S = a.prompt + a.tokens + 1


def w(*shape, fan=None):
    fan = fan or shape[-1]
    return (torch.randn(*shape, device=dev) / math.sqrt(fan)).to(dt)


def fp8_experts(rows, cols):
    """Random FP8 experts [E][rows][cols] (e4m3, about 1 / sqrt(cols) root mean square with
    scale 1) and their float scales [E][rows / 128][cols / 128], made an expert at a time."""
    q = torch.empty(E, rows, cols, device=dev, dtype=torch.uint8)  # gathered as any bytes
    for e in range(E):
        q[e] = (torch.randn(rows, cols, device=dev) * (cols ** -0.5)).to(
            torch.float8_e4m3fn).view(torch.uint8)
    sc = torch.ones(E, rows // 128, cols // 128, device=dev)
    return q, sc


def widen8(q, sc):
    """[n][rows][cols] e4m3 bytes + [n][rows / 128][cols / 128] scales -> [n][rows][cols] bf16."""
    n, rows, cols = q.shape
    v = q.view(torch.float8_e4m3fn).to(dt).view(n, rows // 128, 128, cols // 128, 128)
    return (v * sc.to(dt)[:, :, None, :, None]).view(n, rows, cols)


def ones(n):
    return torch.ones(n, device=dev, dtype=dt)


def mxfp4(rows, cols):
    """Random packed MXFP4 [E][rows][cols]: bytes of two e2m1 codes, one e8m0 scale per 32
    (a power of two that gives the weights about 1 / sqrt(cols) root mean square)."""
    blk = torch.randint(0, 256, (E, rows, cols // 2), device=dev, dtype=torch.uint8)
    e = round(math.log2(1 / math.sqrt(cols) / 2.93))
    sc = torch.full((E, rows, cols // 32), 127 + e, device=dev, dtype=torch.uint8)
    return blk, sc


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device=dev,
                    dtype=dt)


def widen(blk, sc):
    """[n][rows][cols / 2] packed + [n][rows][cols / 32] scales -> [n][rows][cols] bf16."""
    v = torch.stack([E2M1[(blk & 0xF).long()], E2M1[(blk >> 4).long()]], -1).flatten(-2)
    s = torch.exp2(sc.float() - 127).to(dt)
    return (v.unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2)


emb = w(V, H, fan=1)
lm_head = w(V, H)
final_norm = ones(H)
layers = []
for li in range(L):
    if ds:
        Lw = dict(ln1=ones(H), ln2=ones(H), o=w(H, NH * VD), kva=w(R + PE, H), kvn=ones(R),
                  wuk=w(NH, NOPE, R), wuv=w(NH, VD, R))
        if QR:
            Lw["qa"], Lw["qan"], Lw["qb"] = w(QR, H), ones(QR), w(NH * (NOPE + PE), QR)
        else:
            Lw["q"] = w(NH * (NOPE + PE), H)
        if li in dense_layers:
            Lw["gu"], Lw["down"] = w(2 * I, H), w(H, I)
        else:
            Lw["router"] = w(E, H).float()
            Lw["bias_e"] = 0.01 * torch.randn(E, device=dev)
            Lw["gu8"], Lw["gus"] = fp8_experts(2 * EI, H)
            Lw["dn8"], Lw["dns"] = fp8_experts(H, EI)
            Lw["gu"], Lw["down"] = w(2 * SI, H), w(H, SI)
        layers.append(Lw)
        continue
    Lw = dict(ln1=ones(H), qkv=w((NH + 2 * NKV) * HD, H), o=w(H, NH * HD), ln2=ones(H))
    if bias:
        Lw["qkv_b"] = w((NH + 2 * NKV) * HD, fan=100)
    if qk_norm:
        Lw["qn"], Lw["kn"] = ones(HD), ones(HD)
    if gptoss:
        Lw["o_b"] = w(H, fan=100)
        Lw["sinks"] = torch.randn(NH, device=dev)
        Lw["router"], Lw["router_b"] = w(E, H), w(E, fan=100)
        Lw["gu_blk"], Lw["gu_sc"] = mxfp4(2 * EI, H)
        Lw["dn_blk"], Lw["dn_sc"] = mxfp4(H, EI)
        Lw["gu_b"], Lw["dn_b"] = w(E, 2 * EI, fan=100), w(E, H, fan=100)
        Lw["window"] = WINDOW if LAYER_TYPES[li] == "sliding_attention" else 0
    elif li in dense_layers:
        Lw["gu"], Lw["down"] = w(2 * I, H), w(H, I)
    else:
        Lw["router"] = w(E, H)
        Lw["gu_e"] = w(E, 2 * EI, H)
        Lw["down_e"] = w(E, H, EI)
        if glm:
            Lw["bias_e"] = 0.01 * torch.randn(E, device=dev)
        if SI:
            Lw["gu"], Lw["down"] = w(2 * SI, H), w(H, SI)
    layers.append(Lw)
if ds:
    ckv = torch.zeros(L, S, R, device=dev, dtype=dt)  # the normalised latents
    kpe = torch.zeros(L, S, PE, device=dev, dtype=dt)  # the rotated RoPE keys
    inv_pe = 1.0 / (c.get("rope_theta", 10000.0) ** (torch.arange(0, PE, 2, device=dev).float() / PE))
    ang_pe = torch.arange(S, device=dev).float()[:, None] * inv_pe[None, :]
    cos_pe, sin_pe = ang_pe.cos().to(dt), ang_pe.sin().to(dt)
else:
    kcache = torch.zeros(L, 1, NKV, S, HD, device=dev, dtype=dt)
    vcache = torch.zeros_like(kcache)
inv = 1.0 / (c.get("rope_theta", 10000.0) ** (torch.arange(0, ROT, 2, device=dev).float() / ROT))
ang = torch.arange(S, device=dev).float()[:, None] * inv[None, :]
cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
grouped = hasattr(torch, "_grouped_mm")
arangeE = torch.arange(E or 1, device=dev)


def rms(x, wt):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dt) * wt


def rot(x, cc, ss):
    xr, xp = x[..., :ROT], x[..., ROT:]
    x1, x2 = xr[..., : ROT // 2], xr[..., ROT // 2:]
    return torch.cat([xr * cc + torch.cat([-x2, x1], -1) * ss, xp], -1)


def experts(h, Lw):
    lg = (h @ Lw["router"].t()).float()
    if glm:
        s = lg.sigmoid()
        ids = (s + Lw["bias_e"]).topk(K, -1)[1]
        wts = s.gather(1, ids)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * scaling
    else:
        pr = lg.softmax(-1)
        wts, ids = pr.topk(K, -1)
        wts = wts / wts.sum(-1, keepdim=True)
    ids, wts = ids[0], wts[0]
    if grouped:
        order = ids.argsort()
        sid = ids[order]
        offs = (sid[None, :] <= arangeE[:, None]).sum(1).to(torch.int32)
        xs = h.expand(K, H).contiguous()
        gu = torch._grouped_mm(xs, Lw["gu_e"].transpose(1, 2), offs=offs)
        act = (F.silu(gu[:, :EI]) * gu[:, EI:]).contiguous()
        y = torch._grouped_mm(act, Lw["down_e"].transpose(1, 2), offs=offs)
        return (y.float() * wts[order][:, None]).sum(0, keepdim=True).to(dt)
    gu = torch.bmm(Lw["gu_e"][ids], h.expand(K, H)[:, :, None])[..., 0]
    act = F.silu(gu[:, :EI]) * gu[:, EI:]
    y = torch.bmm(Lw["down_e"][ids], act[:, :, None])[..., 0]
    return (y.float() * wts[:, None]).sum(0, keepdim=True).to(dt)


def experts_gptoss(h, Lw):
    lg = (h @ Lw["router"].t() + Lw["router_b"]).float()
    top, ids = lg.topk(K, -1)
    wts, ids = top.softmax(-1)[0], ids[0]
    gu = torch.bmm(widen(Lw["gu_blk"][ids], Lw["gu_sc"][ids]), h.expand(K, H)[:, :, None])[..., 0]
    gu = gu + Lw["gu_b"][ids]
    g, u = gu[:, 0::2].clamp(max=LIMIT), gu[:, 1::2].clamp(-LIMIT, LIMIT)
    act = ((u + 1) * g * torch.sigmoid(1.702 * g)).to(dt)
    y = torch.bmm(widen(Lw["dn_blk"][ids], Lw["dn_sc"][ids]), act[:, :, None])[..., 0]
    y = y + Lw["dn_b"][ids]
    return (y.float() * wts[:, None]).sum(0, keepdim=True).to(dt)


def rot_pairs(x, cc, ss):
    """RoPE over the interleaved pairs (2i, 2i + 1), DeepSeek's layout."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cc - x1 * ss, x0 * ss + x1 * cc], -1).flatten(-2)


def experts_ds(h, Lw):
    s = (h.float() @ Lw["router"].t()).sigmoid()
    sb = s + Lw["bias_e"]
    gs = sb.view(1, NG, E // NG).topk(2, -1)[0].sum(-1)
    keep = torch.zeros_like(gs).scatter_(1, gs.topk(TG, -1)[1], 1.0).bool()
    ids = sb.masked_fill(~keep.repeat_interleave(E // NG, 1), 0.0).topk(K, -1)[1]
    wts = s.gather(1, ids)
    wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * scaling
    ids, wts = ids[0], wts[0]
    gu = torch.bmm(widen8(Lw["gu8"][ids], Lw["gus"][ids]), h.expand(K, H)[:, :, None])[..., 0]
    act = F.silu(gu[:, :EI]) * gu[:, EI:]
    y = torch.bmm(widen8(Lw["dn8"][ids], Lw["dns"][ids]), act[:, :, None])[..., 0]
    return (y.float() * wts[:, None]).sum(0, keepdim=True).to(dt)


def attend_mla(h, li, pos, Lw):
    """Latent attention of one token with kv_b_proj absorbed; returns the o_proj input."""
    q = rms(h @ Lw["qa"].t(), Lw["qan"]) @ Lw["qb"].t() if QR else h @ Lw["q"].t()
    q = q.view(NH, NOPE + PE)
    cc, ss = cos_pe[pos], sin_pe[pos]
    kv = h @ Lw["kva"].t()
    ckv[li].index_copy_(0, pos, rms(kv[:, :R], Lw["kvn"]))
    kpe[li].index_copy_(0, pos, rot_pairs(kv[:, R:], cc, ss))
    ql = torch.bmm(q[:, None, :NOPE], Lw["wuk"])[:, 0]  # [NH][R]
    qp = rot_pairs(q[:, NOPE:], cc, ss)
    sc = (ql @ ckv[li].t() + qp @ kpe[li].t()).float() * DS_SCALE
    ok = torch.arange(S, device=dev) <= pos
    p = sc.masked_fill(~ok[None, :], float("-inf")).softmax(-1).to(dt)
    lat = p @ ckv[li]  # [NH][R]
    return torch.bmm(Lw["wuv"], lat[:, :, None])[..., 0].reshape(1, NH * VD)


def attend_sinks(q, li, pos, Lw):
    """One query row over the cache with each head's sink in the softmax (and the window)."""
    k = kcache[li][0].repeat_interleave(NH // NKV, 0)
    v = vcache[li][0].repeat_interleave(NH // NKV, 0)
    s = torch.einsum("hd,hsd->hs", q[0].float(), k.float()) * HD ** -0.5
    ar = torch.arange(S, device=dev)
    ok = ar <= pos
    if Lw["window"]:
        ok = ok & (ar > pos - Lw["window"])
    s = s.masked_fill(~ok[None, :], float("-inf"))
    p = torch.cat([s, Lw["sinks"][:, None]], -1).softmax(-1)[:, :-1]
    return torch.einsum("hs,hsd->hd", p.to(dt), v)


def mlp(h, gu_w, down_w, n):
    gu = h @ gu_w.t()
    return (F.silu(gu[:, :n]) * gu[:, n:]) @ down_w.t()


def step(tok, pos):
    x = emb[tok]
    cc, ss = cos[pos][:, None, :], sin[pos][:, None, :]
    mask = (torch.arange(S, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
    for li, Lw in enumerate(layers):
        h = rms(x, Lw["ln1"])
        if ds:
            x = x + attend_mla(h, li, pos, Lw) @ Lw["o"].t()
            h = rms(x, Lw["ln2"])
            if "gu8" in Lw:
                x = x + experts_ds(h, Lw) + mlp(h, Lw["gu"], Lw["down"], SI)
            else:
                x = x + mlp(h, Lw["gu"], Lw["down"], I)
            continue
        qkv = h @ Lw["qkv"].t()
        if bias:
            qkv = qkv + Lw["qkv_b"]
        q = qkv[:, : NH * HD].view(1, NH, HD)
        k = qkv[:, NH * HD:(NH + NKV) * HD].view(1, NKV, HD)
        v = qkv[:, (NH + NKV) * HD:].view(1, NKV, HD)
        if qk_norm:
            q, k = rms(q, Lw["qn"]), rms(k, Lw["kn"])
        q, k = rot(q, cc, ss), rot(k, cc, ss)
        kcache[li].index_copy_(2, pos, k[:, :, None, :])
        vcache[li].index_copy_(2, pos, v[:, :, None, :])
        if gptoss:
            att = attend_sinks(q, li, pos, Lw)
            x = x + att.reshape(1, NH * HD) @ Lw["o"].t() + Lw["o_b"]
            x = x + experts_gptoss(rms(x, Lw["ln2"]), Lw)
            continue
        att = F.scaled_dot_product_attention(q[:, :, None, :], kcache[li], vcache[li],
                                             attn_mask=mask, enable_gqa=True)
        x = x + att.reshape(1, NH * HD) @ Lw["o"].t()
        h = rms(x, Lw["ln2"])
        if "gu_e" in Lw:
            out = experts(h, Lw)
            if "gu" in Lw:
                out = out + mlp(h, Lw["gu"], Lw["down"], SI)
        else:
            out = mlp(h, Lw["gu"], Lw["down"], I)
        x = x + out
    return (rms(x, final_norm) @ lm_head.t()).argmax(-1)


tok = torch.tensor([1], device=dev)
pos = torch.tensor([0], device=dev)
with torch.no_grad():
    try:
        step(tok, pos)
    except Exception as e:  # noqa: BLE001 - the grouped product missing or refusing
        print(f"# torch._grouped_mm failed ({e!r}): gathering the chosen experts instead")
        grouped = False
    for i in range(a.prompt):
        pos.fill_(i)
        tok = step(tok, pos)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            out = step(tok, pos)
    torch.cuda.current_stream().wait_stream(st)
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
res = {"peer": "pytorch static KV cache + CUDA graph, "
               + ("dense, every matrix bf16 (an FP8 checkpoint dequantized at load)" if dense
                  else "experts by gathering the chosen experts' packed MXFP4 and widening them "
                       "to bf16" if gptoss
                  else "experts by gathering the chosen experts' FP8 and widening them to bf16 "
                       "(latent attention absorbed, other matrices bf16)" if ds
                  else "experts by torch._grouped_mm" if grouped
                  else "experts by gathering the chosen experts' weights"),
       "torch": torch.__version__, "device": torch.cuda.get_device_name(), "config": a.config,
       "layers": L, "tokens": a.tokens, "tok_s": a.tokens / (ms / 1e3)}
print(json.dumps(res))
if a.json_out:
    with open(a.json_out, "w") as f:
        json.dump(res, f, indent=1)
