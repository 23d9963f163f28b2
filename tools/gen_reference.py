#!/usr/bin/env python3
"""Generate tiny random-weight reference checkpoints for sparkd's engine tests.

For each supported architecture this builds a small model from a config (seeded random
weights), saves it as a Hugging Face model directory (config.json + *.safetensors, one of
them sharded with an index), and computes with Hugging Face `transformers` in float32 on
the CPU, eager attention, no KV cache:
  - the logits of the last few prompt positions for a fixed prompt of token ids,
  - a greedy continuation of GREEDY_STEPS tokens (full recomputation every step),
  - the top logits of every greedy step and full logits of a few steps,
  - the RoPE inverse frequencies the model actually uses,
  - stats: max |logit|, smallest top-1/top-2 gap, and the float32-vs-float64 difference of
    the same computation (how much noise the reference itself carries).

Self-checks (the script exits 2 after writing everything if one fails):
  - the saved directory reloads through from_pretrained and gives the same logits,
  - the llama3 RoPE frequencies match an independent implementation of the formula,
  - float64 recomputation gives the same greedy tokens.
A seed whose greedy path has a near-tie (top-2 gap below MIN_GAP) is skipped for the next
seed, so the fixtures do not depend on float rounding.

Needs only torch, transformers, safetensors (no internet). Usage:
    python3 tools/gen_reference.py --out OUTDIR        # writes OUTDIR/<name>/...
"""

import argparse
import copy
import json
import math
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

GREEDY_STEPS = 72
PROMPT_LEN = 21          # deliberately not a multiple of the engine's 16-token KV block
PROMPT_LOGIT_POSITIONS = 4
FULL_STEP_LOGITS = (0, 1, 15, 31, 63, GREEDY_STEPS - 1)
TOPK_PER_STEP = 5
MIN_GAP = 2e-3
MAX_SEED_TRIES = 20

# name, class, weight dtype, shard size (None: one file), config kwargs, rope, init scale.
MODELS = [
    dict(
        name="llama",
        arch="LlamaForCausalLM",
        dtype="float32",
        max_shard_size="300KB",
        seed=1001,
        config=dict(vocab_size=512, hidden_size=64, intermediate_size=192,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    attention_bias=False, mlp_bias=False),
        rope=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=128),
    ),
    dict(
        name="qwen2",
        arch="Qwen2ForCausalLM",
        dtype="bfloat16",
        max_shard_size=None,
        seed=2002,
        config=dict(vocab_size=640, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                    use_sliding_window=False),
        rope=dict(rope_type="default", rope_theta=1000000.0),
    ),
    dict(
        name="qwen3",
        arch="Qwen3ForCausalLM",
        dtype="bfloat16",
        max_shard_size="150KB",
        seed=3003,
        # head_dim * heads (128) != hidden_size (64): Qwen3 allows it; the engine must too.
        config=dict(vocab_size=768, hidden_size=64, intermediate_size=160,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    attention_bias=False, use_sliding_window=False),
        rope=dict(rope_type="default", rope_theta=1000000.0),
    ),
    dict(
        name="mistral",
        arch="MistralForCausalLM",
        dtype="float32",
        max_shard_size=None,
        seed=4004,
        config=dict(vocab_size=1024, hidden_size=96, intermediate_size=256,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    sliding_window=None),
        rope=dict(rope_type="default", rope_theta=10000.0),
    ),
]

CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "MistralForCausalLM": "MistralConfig",
}


def transformers_major():
    try:
        return int(transformers.__version__.split(".")[0])
    except ValueError:
        return 5


def make_config(spec):
    cls = getattr(transformers, CONFIG_CLASSES[spec["arch"]])
    kwargs = dict(spec["config"])
    rope = dict(spec["rope"])
    probe = cls()
    if transformers_major() >= 5 or hasattr(probe, "rope_parameters"):
        # transformers 5: rope_theta and the scaling live together in rope_parameters.
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = rope
    cfg = cls(**kwargs)
    cfg.architectures = [spec["arch"]]
    return cfg


def rope_params_of(cfg):
    """(theta, scaling dict or None) from either config generation."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        scaling = rp if rp.get("rope_type", "default") != "default" else None
        return float(rp["rope_theta"]), scaling
    return float(cfg.rope_theta), getattr(cfg, "rope_scaling", None)


def expected_inv_freq(head_dim, theta, scaling):
    """Independent float64 implementation of default and llama3 RoPE frequencies."""
    inv = [1.0 / (theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low = scaling["low_freq_factor"]
        high = scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        low_wavelen = orig / low
        high_wavelen = orig / high
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (orig / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    return inv


def init_weights(model, seed, round_bf16):
    """Seeded weights with a scale that gives well-separated logits (HF's 0.02 init makes
    near-uniform logits, where greedy decoding would hinge on rounding)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            r = torch.randn(shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * r
            elif name.endswith(".bias"):
                v = 0.3 * r
            elif "embed_tokens" in name:
                v = r
            elif name.startswith("lm_head"):
                v = r * (2.0 / math.sqrt(shape[1]))
            elif len(shape) == 2:
                v = r * (1.0 / math.sqrt(shape[1]))
            else:
                v = 0.2 * r
            if round_bf16:
                v = v.to(torch.bfloat16).to(torch.float32)
            p.copy_(v)


def logits_of(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0]


def greedy(model, prompt, steps):
    """Greedy continuation by full recomputation (no KV cache in the reference)."""
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


def f7(v):
    return float("%.8g" % float(v))


def make_prompt(vocab):
    # BOS, then a fixed spread of ids; deterministic and independent of any tokenizer.
    return [1] + [(i * 37 + 11) % (vocab - 3) + 3 for i in range(PROMPT_LEN - 1)]


def save_model(model, spec, outdir):
    save_model_ = copy.deepcopy(model)
    if spec["dtype"] == "bfloat16":
        save_model_ = save_model_.to(torch.bfloat16)
    kwargs = {}
    import inspect
    params = inspect.signature(save_model_.save_pretrained).parameters
    if "safe_serialization" in params:
        kwargs["safe_serialization"] = True
    if spec["max_shard_size"]:
        kwargs["max_shard_size"] = spec["max_shard_size"]
    save_model_.save_pretrained(outdir, **kwargs)
    if spec["max_shard_size"] and not os.path.exists(
            os.path.join(outdir, "model.safetensors.index.json")):
        reshard(outdir, 2)
    for f in os.listdir(outdir):
        if f.endswith((".bin", ".pt", ".pth")):
            raise SystemExit(f"{outdir}/{f}: save_pretrained wrote a pickle, not safetensors")


def reshard(outdir, n):
    """Fallback when save_pretrained ignored max_shard_size: split into n files + index."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    single = os.path.join(outdir, "model.safetensors")
    tensors = {}
    with safe_open(single, framework="pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    keys = sorted(tensors)
    per = (len(keys) + n - 1) // n
    weight_map, total = {}, 0
    for s in range(n):
        fname = "model-%05d-of-%05d.safetensors" % (s + 1, n)
        part = {k: tensors[k].contiguous() for k in keys[s * per:(s + 1) * per]}
        save_file(part, os.path.join(outdir, fname), metadata={"format": "pt"})
        for k, t in part.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(outdir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    os.remove(single)


def build(spec, seed):
    cfg = make_config(spec)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    init_weights(model, seed, spec["dtype"] == "bfloat16")
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), \
            "tie_word_embeddings did not tie lm_head to embed_tokens"
    return cfg, model


def generate_one(spec, outroot):
    failures = []
    prompt = make_prompt(spec["config"]["vocab_size"])
    chosen = None
    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        cfg, model = build(spec, seed)
        gen, tops, full, gaps = greedy(model, prompt, GREEDY_STEPS)
        if min(gaps) >= MIN_GAP:
            chosen = (seed, cfg, model, gen, tops, full, gaps)
            break
        print(f"# {spec['name']}: seed {seed} has a greedy near-tie "
              f"(gap {min(gaps):.2e}), trying the next seed", file=sys.stderr)
    if chosen is None:
        failures.append(f"{spec['name']}: no seed without near-ties in {MAX_SEED_TRIES} tries")
        chosen = (seed, cfg, model, gen, tops, full, gaps)
    seed, cfg, model, gen, tops, full, gaps = chosen

    all_logits = logits_of(model, prompt)
    prompt_logits = all_logits[-PROMPT_LOGIT_POSITIONS:]

    # Reference noise: the same computation in float64.
    m64 = copy.deepcopy(model).to(torch.float64)
    l64 = logits_of(m64, prompt)
    fp64_diff = float((all_logits.double() - l64).abs().max())
    gen64, _, _, _ = greedy(m64, prompt, GREEDY_STEPS)
    if gen64 != gen:
        failures.append(f"{spec['name']}: float64 greedy tokens differ from float32")

    # RoPE frequencies actually used, against an independent implementation.
    theta, scaling = rope_params_of(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    expect = expected_inv_freq(head_dim, theta, scaling)
    rot = getattr(model.model, "rotary_emb", None)
    inv_freq = [float(x) for x in rot.inv_freq] if rot is not None and hasattr(rot, "inv_freq") else []
    if inv_freq:
        worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(inv_freq, expect))
        if len(inv_freq) != len(expect) or worst > 1e-5:
            failures.append(f"{spec['name']}: model inv_freq differs from the formula "
                            f"(rel {worst:.2e}); rope config did not take effect")
    else:
        failures.append(f"{spec['name']}: could not read model.model.rotary_emb.inv_freq")

    outdir = os.path.join(outroot, spec["name"])
    os.makedirs(outdir, exist_ok=True)
    save_model(model, spec, outdir)

    # Reload the saved files the way a user would and compare.
    reload_diff = None
    try:
        m2 = AutoModelForCausalLM.from_pretrained(outdir, attn_implementation="eager")
        m2 = m2.to(torch.float32).eval()
        reload_diff = float((logits_of(m2, prompt) - all_logits).abs().max())
        if reload_diff > 1e-5:
            failures.append(f"{spec['name']}: reloaded checkpoint differs (max {reload_diff:.3e})")
    except Exception as e:  # noqa: BLE001 - report, keep the outputs
        failures.append(f"{spec['name']}: reload failed: {e!r}")

    files = sorted(os.listdir(outdir))
    ref = {
        "name": spec["name"],
        "architecture": spec["arch"],
        "weights_dtype": spec["dtype"],
        "sharded": os.path.exists(os.path.join(outdir, "model.safetensors.index.json")),
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "seed": seed,
        "compute": "float32, CPU, attn_implementation=eager, no KV cache",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "vocab_size": cfg.vocab_size,
        "prompt_ids": prompt,
        "prompt_logits_positions": list(range(len(prompt) - PROMPT_LOGIT_POSITIONS, len(prompt))),
        "prompt_logits": [[f7(v) for v in row] for row in prompt_logits],
        "greedy_steps": GREEDY_STEPS,
        "greedy_ids": gen,
        "greedy_top": tops,
        "greedy_full_logits": full,
        "rope_inv_freq": inv_freq,
        "rope_inv_freq_expected": expect,
        "stats": {
            "max_abs_prompt_logit": float(all_logits.abs().max()),
            "max_abs_greedy_top_logit": max(abs(t["logits"][0]) for t in tops),
            "min_greedy_top2_gap": min(gaps),
            "fp32_vs_fp64_max_abs_logit_diff": fp64_diff,
            "reload_max_abs_logit_diff": reload_diff,
        },
        "files": files,
    }
    with open(os.path.join(outdir, "reference.json"), "w") as fh:
        json.dump(ref, fh, indent=1)
    size = sum(os.path.getsize(os.path.join(outdir, f)) for f in os.listdir(outdir))
    print(f"{spec['name']:8s} {spec['arch']:20s} {spec['dtype']:9s} seed={seed} "
          f"files={len(files)} bytes={size} min_gap={min(gaps):.3e} fp64_diff={fp64_diff:.2e} "
          f"reload_diff={reload_diff}")
    return failures, size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (one subdirectory per model)")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    if hasattr(torch.backends, "cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    failures, total = [], 0
    print(f"# torch {torch.__version__} transformers {transformers.__version__}")
    for spec in MODELS:
        if only and spec["name"] not in only:
            continue
        f, size = generate_one(spec, args.out)
        failures += f
        total += size
    manifest = {
        "generator": "tools/gen_reference.py",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "models": [s["name"] for s in MODELS if not only or s["name"] in only],
        "failures": failures,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    print(f"# total bytes {total}")
    if total > 8 * 1024 * 1024:
        failures.append(f"outputs are {total} bytes, over the 8 MiB budget")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
