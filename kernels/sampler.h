#pragma once
// The sampler, one definition for both devices: penalties, temperature, top-k, top-p,
// min-p, then a draw by the Gumbel-max trick with Philox numbers keyed by (seed, request,
// step, token) (philox.h), plus logprobs and up to 20 top alternatives. sample_ref is the
// CPU twin of the CUDA kernels in sampler.cu; given the same logits and state they keep
// the same set and pick the same token: the kept set is decided on integer masses and
// counts, whose sums do not depend on the order of addition (sampler_core.h), and the only
// floating results that differ are the logprobs (log-sum-exp summed in another order:
// within 1e-6 relative). The Gumbel scores use a log of our own (sample_log), so they are
// the same bits on both sides too.
//
// Definition, for logits l (fp32) of one row and an optional mask of allowed ids
// (structured outputs: bit i of word i / 32; a row without one allows every id):
//   z_i   = l_i, divided by repetition_penalty if positive (times it if not) where seen_i,
//           minus presence_penalty + frequency_penalty * count_i where count_i > 0
//   mask: z_i = -inf where the mask excludes i, and at least -FLT_MAX where it allows i (after
//         the temperature below), so an allowed id outranks every excluded one
//   greedy (temperature 0): the lowest i with the largest z_i
//   else  z_i /= temperature; K = {i : z_i >= the top_k-th largest z} (all when top_k <= 0
//         or >= vocab); m_i = floor(2^32 exp(z_i - max z)) (sample_mass_q, an integer);
//         P = {i in K : z_i >= t}, t the largest value with
//         double(sum of m over {j in K : z_j >= t}) >= double(top_p) * double(sum of m over K);
//         M = {i : double(m_i) >= min_p * 2^32};
//         token = argmax over K & P & M of z_i + g_i, g_i = -log(-log(u_i)) (sample_log),
//         u_i = philox_uniform(seed, request, step, i); ties: the lowest id.
//   logprob = l_token - logsumexp(l); top = the top_logprobs largest l (ties: lowest id).
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// Most alternatives a row can report.
inline constexpr int kSampleMaxTop = 20;

/// Per-row sampling parameters (plain data, copied to the device as an array).
struct SampleParams {
  float temperature = 1.0f;  // 0: greedy
  int32_t top_k = 0;         // <= 0: off
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int32_t top_logprobs = 0;  // 0..kSampleMaxTop
  uint64_t seed = 0;
  uint64_t request = 0;   // the random stream: one per generated sequence
  uint32_t step = 0;      // index of the token being generated in that sequence
  uint32_t logprobs = 0;  // 1: fill logprob (top_logprobs > 0 implies it)
};

/// What a row's draw gives.
struct SampleResult {
  int32_t token = 0;
  float logprob = 0;  // log-softmax of the raw logits at token (when asked)
  int32_t n_top = 0;
  int32_t top_ids[kSampleMaxTop] = {};
  float top_logprobs[kSampleMaxTop] = {};
};

/// Checks one row's parameters against the ranges above; names the field.
Status sample_check_params(const SampleParams& p, int vocab);

/// Reference draw for one row: `seen` (vocab bytes, 1 = in prompt or output) and `counts`
/// (vocab ints, times generated) may be null when no penalty asks for them. Does not
/// update the state (sample_state_update_ref does).
/// `mask` (optional, (vocab + 31) / 32 words) excludes the ids whose bit is 0; the host
/// lowers top_k to 0 when it is at least the number of allowed ids (SampleParams is the same
/// on both devices, so the twins still agree).
SampleResult sample_ref(const float* logits, int vocab, const SampleParams& p, const uint8_t* seen,
                        const int32_t* counts, const uint32_t* mask = nullptr);

/// What the device's pre-filter did for one row (sample_prefilter_ref).
struct SamplePrefilterStats {
  size_t candidates = 0;      // tokens the exact selection sorted
  size_t sure = 0;            // tokens kept without comparison (bins above the floor's)
  size_t raw_candidates = 0;  // tokens the top alternatives were chosen from
  float k_floor = 0, p_floor = 0;
};

/// The device kernels' decomposition run on the CPU: the histogram plan, the candidate
/// sets it implies, the exact floors over the sorted candidates (sampler_core.h, the same
/// code the kernels run). Gives sample_ref's result; tests hold the two against each other.
SampleResult sample_prefilter_ref(const float* logits, int vocab, const SampleParams& p,
                                  const uint8_t* seen, const int32_t* counts,
                                  SamplePrefilterStats* stats, const uint32_t* mask = nullptr);

/// After a draw: seen[token] = 1, ++counts[token].
void sample_state_update_ref(uint8_t* seen, int32_t* counts, int32_t token);

/// A batch of rows for the device sampler. Pointers are device pointers.
struct SampleBatch {
  DType logits_dtype = DType::f32;
  const void* logits = nullptr;  // [rows] of vocab, row stride logits_stride elements
  size_t logits_stride = 0;
  int vocab = 0;
  int rows = 0;
  const SampleParams* params = nullptr;  // [rows]
  // Penalty state, one row per sequence slot: seen [n_state][vocab] bytes, counts
  // [n_state][vocab] int32. state_row[r] picks row r's slot (null: row r uses slot r).
  // seen/counts may be null when no row has a penalty.
  uint8_t* seen = nullptr;
  int32_t* counts = nullptr;
  const int32_t* state_row = nullptr;
  bool update_state = true;  // record the drawn token in seen/counts
  // Allowed ids per row (structured outputs): row r's bitset at mask + r * mask_words
  // (bit i of word i / 32); null: every id of every row. Applied before the penalties'
  // result is tempered, as sample_ref does (z = -inf where excluded).
  const uint32_t* mask = nullptr;
  size_t mask_words = 0;
  SampleResult* results = nullptr;  // [rows]
  int32_t* tokens = nullptr;        // optional [rows]: the drawn ids alone (for graphs)
  void* workspace = nullptr;        // sample_workspace_bytes(rows, vocab)
  size_t workspace_bytes = 0;
};

/// Scratch bytes the device sampler needs for `rows` rows of `vocab`.
size_t sample_workspace_bytes(int rows, int vocab);

/// Draws one token per row on `stream`: each row split over several blocks (three launches:
/// penalties and maxima; histograms and the plan; candidates, the draw and the results).
Status sample_cuda_device(const SampleBatch& b, void* stream);

/// How the device sampler launches (the defaults are sample_cuda_device's; the benchmark
/// and the tests try the others).
struct SampleLaunch {
  bool pdl = true;        // launches 2 and 3 start while the previous one drains (sm_90+)
  int blocks_per_sm = 2;  // blocks over the whole batch, per multiprocessor (>= 1)
};
Status sample_cuda_device(const SampleBatch& b, void* stream, const SampleLaunch& how);

/// The previous device sampler (one block of 1024 threads per row, radix selection over
/// the whole row, top-p on float masses), kept so the kernel benchmark can time the two
/// side by side. Same batch and workspace as sample_cuda_device.
Status sample_cuda_device_v1(const SampleBatch& b, void* stream);

/// Resets one slot's penalty state on the device: seen = the prompt's tokens (ids outside
/// [0, vocab) ignored), counts = 0. prompt is a device array of n ids.
Status sample_state_reset_cuda_device(uint8_t* seen_row, int32_t* counts_row, int vocab,
                                      const int32_t* prompt, size_t n, void* stream);

/// Penalty state of one row from its token list, as the host sampler keeps it: seen = 1 for
/// every token of tokens[0 .. n) (prompt and output), counts = occurrences among the output
/// part tokens[out_start .. n); the rest 0. Ids outside [0, vocab) are ignored.
void sample_state_build_ref(uint8_t* seen, int32_t* counts, int vocab, const int32_t* tokens, int n,
                            int out_start);

/// sample_state_build_ref for `rows` rows on the device: seen and counts are [rows][vocab]
/// (overwritten whole); row r's list is tokens[start[r] .. start[r + 1]) with its output
/// from start[r] + out_start[r] on. tokens, start (rows + 1) and out_start (rows) are
/// device arrays.
Status sample_state_build_cuda_device(uint8_t* seen, int32_t* counts, int vocab, int rows,
                                      const int32_t* tokens, const int32_t* start,
                                      const int32_t* out_start, void* stream);

/// Reference argmax per row: the lowest index of the largest value.
void argmax_ref(const float* x, size_t rows, size_t dim, int32_t* out);

/// Argmax per row on the device (x of type dt, rows of dim; ties: the lowest index).
Status argmax_cuda_device(DType dt, const void* x, size_t rows, size_t dim, int32_t* out,
                          void* stream);

}  // namespace spark::kernels
