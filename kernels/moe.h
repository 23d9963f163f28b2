#pragma once
// Mixture-of-experts routing and expert products. The router turns each token's logits over
// the experts into its top-k experts and their weights, as transformers defines it:
//   softmax scores (Qwen3-MoE, Mixtral): p = softmax(logits); the k largest; weights p,
//     renormalised to sum 1 when norm_topk;
//   sigmoid scores (GLM-4.5, DeepSeek-V3, MiniMax-M2): s = sigmoid(logits); the choice is
//     made on s + correction bias; with groups, each group scores the sum of its two largest
//     choice values, the topk_group best groups stay and the other experts leave the choice;
//     the k largest;
//     weights s (not s + bias), renormalised when norm_topk (sum + 1e-20), times the
//     routed scaling factor.
// Ties: the larger value first, equal values by the lower index (a stable order that every
// device and rank shares; transformers' topk gives no promise on ties, which the tests
// detect as near-ties rather than depend on).
// moe_route_ref is the twin of the CUDA routing kernel and what the CPU device runs.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"
#include "kernels/mxfp4.h"

namespace spark::kernels {

/// Most experts per token the kernels take.
inline constexpr int kMoeMaxTopK = 32;
/// Most routed experts per layer the routing kernel takes.
inline constexpr int kMoeMaxExperts = 1024;

struct MoeRouteArgs {
  int experts = 0;
  int top_k = 0;
  bool sigmoid = false;  // else softmax
  bool norm_topk = false;
  int n_group = 1, topk_group = 1;
  float scaling = 1.f;
};

/// Checks the arguments (counts in range, groups dividing the experts).
Status moe_route_check(const MoeRouteArgs& a);

/// Routes `rows` rows of fp32 logits [rows][experts] (bias: [experts] fp32 or null) into
/// ids [rows][top_k] and weights [rows][top_k] (chosen order: best first). When `margin` is
/// not null it receives per row the choice value of the last chosen expert and of the best
/// unchosen one ([rows][2]), for near-tie reports.
void moe_route_ref(const float* logits, const float* bias, const MoeRouteArgs& a, size_t rows,
                   int32_t* ids, float* weights, float* margin = nullptr);

}  // namespace spark::kernels

namespace spark::kernels {

/// Routing on the device, moe_route_ref's twin (fp32 softmax / sigmoid; the same choice
/// rule and order): one warp per row.
Status moe_route_cuda_device(const float* logits, const float* bias, const MoeRouteArgs& a,
                             size_t rows, int32_t* ids, float* weights, void* stream);

/// Most token rows the decode form of the expert products takes; more rows go to the
/// grouped form (tokens sorted by expert, one grouped product on the tensor cores).
inline constexpr int kMoeDecodeMaxRows = 8;

/// One MoE layer's expert products: out[r] (+)= sum_j weights[r][j] * E_{ids[r][j]}(x[r]) over
/// the held experts [expert0, expert0 + experts), plus the shared experts' MLP of x[r],
/// where each E is a gated SiLU MLP: act = silu(g) * u (g, u the [gate | up] rows' products
/// in fp32, act rounded to bf16), then down(act) in fp32; the sum in fp32, ascending expert
/// id then the shared experts, rounded once to bf16 (after adding out when accumulating).
/// Device pointers; bf16 activations, bf16, FP8 or MXFP4 weights (the fields below).
///
/// gpt-oss's routed experts (the fields after the FP8 ones; the shared experts stay plain):
/// g and u are the products plus the gate/up bias (fp32), read from rows 2i and 2i + 1 when
/// interleaved (the bias likewise); with swiglu_limit > 0 the activation is
/// (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g') with g' = min(g, limit), else
/// silu(g) * u; act rounded to bf16; each expert's output is weight * (down(act) + down
/// bias) in fp32 (transformers' GptOssExperts).
struct MoeExpertsArgs {
  const void* x = nullptr;         // [rows][hidden] bf16
  const int32_t* ids = nullptr;    // [rows][top_k]
  const float* weights = nullptr;  // [rows][top_k]
  int rows = 0, top_k = 0, hidden = 0;
  const void* gate_up = nullptr;  // [experts][2 * inter][hidden]: per expert [gate | up]
  const void* down = nullptr;     // [experts][hidden][inter]
  int expert0 = 0, experts = 0, inter = 0;
  const void* shared_gate_up = nullptr;  // [2 * shared_inter][hidden]
  const void* shared_down = nullptr;     // [hidden][shared_inter]
  int shared_inter = 0;                  // 0: none
  void* out = nullptr;                   // [rows][hidden] bf16
  bool accumulate = false;               // out += the sum (the residual stream)
  void* workspace = nullptr;             // moe_experts_workspace_bytes()
  size_t workspace_bytes = 0;
  /// 0: automatic (the decode form up to kMoeDecodeMaxRows rows, else grouped; gpt-oss's
  /// MXFP4 experts (clamped activation, no shared experts) on the fp32 decode kernels at one
  /// row and the tensor-core decode kernels from two rows up to 32, grouped past them; FP8
  /// experts (every routed and shared matrix FP8, whole 32-column blocks, 8-byte aligned
  /// rows) likewise; bf16 experts (whole 32-column blocks, 16-byte aligned rows) on the
  /// tensor-core kernels from 5 rows to kMoeDecodeMaxRows);
  /// 1: the decode form (fp32 kernels); 2: the grouped form (the tests run both on the same
  /// rows); 3: automatic with those experts on the tensor-core kernels at one row too;
  /// 4: automatic with them never on the tensor-core kernels.
  int form = 0;
  // FP8 experts (kernels/fp8.h's layout): when gate_up_fp8.q is set, the held experts'
  // weights are e4m3 with block scales and gate_up/down are not read. The scales index
  // rows of the stacked matrices: gate_up_fp8 covers [experts * 2 * inter][hidden] (scale_ld
  // >= ceil(hidden / 128)), down_fp8 [experts * hidden][inter] (scale_ld >= ceil(inter/128)),
  // row r's scale row r >> row_shift. The shared experts likewise (shared_*_fp8.q set: FP8).
  // Each weight is its e4m3 value times its scale. The decode form widens the bytes in
  // registers and multiplies each 8-column piece's fp32 partial sum by its scale; the grouped
  // form dequantizes weight tiles to bf16 (w * scale rounded to bf16, exact where the scale
  // is a power of two) for the tensor cores. q and ldq multiples of 8 bytes.
  Fp8Weight gate_up_fp8, down_fp8, shared_gate_up_fp8, shared_down_fp8;
  // MXFP4 experts (kernels/mxfp4.h's layout; gpt-oss's routed experts): when
  // gate_up_mx4.blocks is set, the held experts' weights are e2m1 codes with e8m0 scales per
  // 32 columns and gate_up/down (and the *_fp8 fields) are not read. gate_up_mx4 covers the
  // stacked [experts * 2 * inter][hidden] (rows as gate_up's: [gate | up] or interleaved),
  // down_mx4 [experts * hidden][inter]. hidden and inter multiples of 32, ldb >= k / 2 and
  // lds >= k / 32 (k: the matrix's columns), blocks and ldb multiples of 16 bytes; not with
  // FP8 weights (routed or shared); the shared experts stay bf16. Each weight is its e2m1
  // value times 2^(scale - 127). The decode form widens a lane's 16 bytes (32 columns, one
  // scale) in registers to value * scale in fp32 and sums the products in fp32; the grouped
  // form widens weight tiles to bf16 for the tensor cores. Both widenings are exact (two
  // significant bits times a power of two; +-inf only past fp32's and bf16's range, scale
  // bytes 253 and 254). The biases, interleaved rows and clamped activation apply as for bf16.
  Mxfp4Weight gate_up_mx4, down_mx4;
  // gpt-oss (routed experts only), indexed by the held expert (id - expert0).
  const void* gate_up_bias = nullptr;  // [experts][2 * inter] bf16 (null: none), rows' layout
  const void* down_bias = nullptr;     // [experts][hidden] bf16 (null: none, or another rank's)
  bool interleaved = false;            // gate/up rows 2i (gate), 2i + 1 (up); else [gate | up]
  float swiglu_limit = 0.f;            // > 0: the clamped activation; 0: silu(g) * u
  float swiglu_alpha = 0.f;            // the clamped activation's sigmoid slope (1.702)
};

/// Device workspace the expert products of `rows` rows need.
size_t moe_experts_workspace_bytes(int rows, int top_k, int hidden, int inter, int shared_inter,
                                   int experts);

/// Where the workspace's parts are (byte offsets, 256-byte aligned): per group (held experts,
/// then the shared experts) its row count, row and tile offsets; per (row, expert) pair its
/// sorted row and each sorted row's token row; act [pairs][act_stride] bf16; y [pairs][hidden]
/// fp32. The decode form uses act only.
struct MoeWorkspaceLayout {
  size_t counts = 0, row_off = 0, tile_off = 0, pos = 0, row_src = 0, act = 0, y = 0, total = 0;
  int pairs = 0, groups = 0, act_stride = 0;
};
MoeWorkspaceLayout moe_workspace_layout(int rows, int top_k, int hidden, int inter,
                                        int shared_inter, int experts);

/// Checks MoeExpertsArgs (sizes; hidden and the intermediate sizes multiples of 8; 16-byte
/// aligned bf16 operands; the FP8 weights' strides, scale_ld, row_shift and alignment; the
/// MXFP4 weights' (mxfp4_weight_check; hidden and inter multiples of 32; not with FP8); the
/// biases 2-byte aligned, swiglu_limit finite and >= 0, swiglu_alpha finite and > 0 with a
/// limit).
Status moe_experts_check(const MoeExpertsArgs& a);

/// The expert products on `stream`: no host synchronisation, so a decode step stays one graph.
Status moe_experts_cuda_device(const MoeExpertsArgs& a, void* stream);

/// The most shared memory a block the tensor-core decode kernels of moe_experts_cuda_device
/// plan for (process-wide; 0, the default: the device's opt-in limit). Below 16 staged rows
/// of x those kernels stage 8 a pass, and below 8 the other forms run, as on GB10 (99 KiB a
/// block) at gpt-oss's hidden of 2880; the GPU tests set GB10's limit on a larger GPU to run
/// that path.
void set_moe_smem_cap(size_t bytes);
size_t moe_smem_cap();

/// The rows of x the tensor-core decode kernels' gate/up stages a pass for `a` on the current
/// device under that cap: 16, 8, or 0 where 8 do not fit either (those kernels not taken).
int moe_mma_pass_rows(const MoeExpertsArgs& a);

/// The kernels moe_experts_cuda_device runs for `a` (its `form` and rows) on the current
/// device: 1 the fp32 decode kernels, 2 the grouped form, 3 the tensor-core decode kernels.
/// The launch takes this answer, so a test of the automatic form's rule asks it.
int moe_experts_kernels(const MoeExpertsArgs& a);

/// The reference of moe_experts_cuda_device on host floats (the same fields, host pointers to
/// float arrays; out is float): in double, act rounded to bf16, the result rounded to bf16.
/// FP8 weights (the *_fp8 fields set: host e4m3 bytes and host scales) are widened exactly
/// (value times scale in double), MXFP4 weights (gate_up_mx4.blocks set: host codes and
/// scale bytes) likewise (e2m1 value times 2^(scale - 127) in double). The biases are host
/// float arrays.
void moe_experts_ref(const MoeExpertsArgs& host_args);

}  // namespace spark::kernels
