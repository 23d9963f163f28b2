#!/usr/bin/env python3
"""How far transformers itself moves in bf16: for each reference fixture
(tests/fixtures/models/<name>/), the logits of prompt + greedy path computed by
transformers on the GPU in bfloat16 against the same in float32 (eager attention, one
forward over the whole sequence). A quantized fixture (FP8 blocks, MXFP4) is loaded through
transformers' dequantizing loader, so both runs see the same dequantized weights and no
quantized kernel package is needed. The engine's bf16 bound on the GPU
(tests/daemon/engine_cuda_test.cc) is justified against these numbers.

    python3 tools/bf16_bound.py [FIXTURES_DIR] [--json-out FILE]
"""
import argparse
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("fixtures", nargs="?", default=os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "models"))
p.add_argument("--json-out")
a = p.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
       "torch": torch.__version__, "fixtures": {}}
for name in sorted(os.listdir(a.fixtures)):
    d = os.path.join(a.fixtures, name)
    if not os.path.exists(os.path.join(d, "reference.json")):
        continue
    ref = json.load(open(os.path.join(d, "reference.json")))
    ids = torch.tensor([ref["prompt_ids"] + ref["greedy_ids"]], device=dev)
    cfg = json.load(open(os.path.join(d, "config.json")))
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    extra = {}
    if quant == "fp8":
        extra["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    elif quant == "mxfp4":
        extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    elif quant is not None:
        raise SystemExit(f"{d}/config.json: quantization_config.quant_method {quant!r} "
                         "has no dequantizing loader here")
    logits = {}
    for dt in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=dt, attn_implementation="eager",
                                                 **extra).to(dev)
        with torch.no_grad():
            logits[dt] = m(ids).logits[0].float()
        del m
    n = len(ref["prompt_ids"])
    diff = (logits[torch.bfloat16] - logits[torch.float32]).abs()
    # Positions the engine test compares: the last prompt positions and every greedy step.
    sel = diff[n - len(ref["prompt_logits_positions"]):n + len(ref["greedy_ids"]) - 1]
    flips = int((logits[torch.bfloat16][n - 1:-1].argmax(-1) !=
                 logits[torch.float32][n - 1:-1].argmax(-1)).sum())
    out["fixtures"][name] = {"weights": ref["weights_dtype"],
                             "max_abs_bf16_vs_fp32": float(sel.max()),
                             "mean_abs_bf16_vs_fp32": float(sel.mean()),
                             "max_abs_logit": float(logits[torch.float32].abs().max()),
                             "greedy_argmax_flips": flips}
    print(name, json.dumps(out["fixtures"][name]))
out["max_abs_bf16_vs_fp32"] = max(f["max_abs_bf16_vs_fp32"] for f in out["fixtures"].values())
print(json.dumps({"max_abs_bf16_vs_fp32": out["max_abs_bf16_vs_fp32"]}))
if a.json_out:
    with open(a.json_out, "w") as f:
        json.dump(out, f, indent=1)
