#pragma once
// The stated bound of an fp8 KV cache (KV_DTYPE=fp8: every K and V value rounded to e4m3,
// no scale). e4m3 keeps 3 mantissa bits, so each cached value moves by up to 2^-4 of itself
// (values under 2^-6 by up to 2^-10), and the logits by what those errors add up to through
// the attention of every layer. Measured on the CPU over the reference fixtures (where the
// pools hold the same e4m3 values in fp32; the reference test prints each fixture's worst),
// teacher-forced along transformers' tokens: at most 3.9% of the position's largest |logit|
// (llama; mistral 2.9%, qwen3 2.8%, qwen2 1.2%). The bound is 5%.
//
// A mixture of experts routes on attention's output: where the rounding moves a router
// choice, the experts differ and the logits after it move by more than any bound on the
// rounding (the random fixtures' routers are close to uniform, so their choices move within
// a few positions). Such a move must be at a near-tie: the router's margin between its last
// chosen and first unchosen expert, in the same run with a full-precision cache, under
// kFp8RouterTie (softmax probabilities or sigmoid scores).
//
// The FP8 tensor-core prefill rounds the activations entering each FP8 product to e4m3 (per
// row and 128 columns, scaled by the block's amax / 448): the same 2^-4 of each value, so
// the same bound holds for it, kFp8ActLogitBound, and the same near-tie excuse.
namespace spark::test {
inline constexpr double kFp8KvLogitBound = 0.05;
inline constexpr double kFp8ActLogitBound = 0.05;
inline constexpr double kFp8RouterTie = 0.05;
}  // namespace spark::test
