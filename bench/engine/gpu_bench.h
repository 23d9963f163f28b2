#pragma once
// The engine on a CUDA GPU against that machine's own ceilings, all measured in one run:
// HBM read bandwidth (a 16-byte-load read kernel over 4 GiB) -> the decode roofline
// (bandwidth / bytes one token reads: every weight once plus the KV of its context); the
// bf16 cuBLASLt peak (8192^3) for prefill; the sequential read rate of the checkpoint's
// files from a cold page cache for time to READY. Measures batch-1 decode, aggregate
// decode at 8 and 32 streams, prefill at 1k/8k/32k tokens and READY from a cold cache.
// Prints a table and one JSON line (and writes it to json-out).
#include <map>
#include <string>

#include "core/error.h"

namespace spark::engine {

/// Options (spark-engine gpubench --key value): model (directory, required), context
/// (33792), max-batch-tokens (8192), prompt-tokens (128), max-tokens (256), graphs (1),
/// b1-runs (3: batch 1 is the median of that many runs), decode-only (0; 1 skips the
/// aggregate and prefill rows), kv-dtype (auto; bf16, fp8, fp32: the KV cache's type, and
/// the bytes the roofline counts for it), json-out. Returns the exit code (1 when a row produced wrong
/// output).
Result<int> run_gpu_bench(const std::map<std::string, std::string>& opt);

}  // namespace spark::engine
