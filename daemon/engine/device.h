#pragma once
// The device seam: everything the layer recipe (model.cc) does to numbers goes through a
// Device, so the recipe is written once and runs on the CPU (device_cpu.cc: fp32, OpenBLAS
// and the reference twins in kernels/) or on a CUDA GPU (device_cuda.cc: BF16 weights and
// KV, the CUDA entry points in kernels/, a stream, CUDA graphs for decode steps). Memory is
// a Buffer owned by the device that allocated it; the recipe never dereferences one.
//
// A step is described once (StepLayout: token ids, positions, per-sequence chunks and block
// tables, the rows whose logits are wanted), handed to begin_step(), and every op of that
// step reads it from there, so a device can keep it in its own memory and a captured CUDA
// graph can replay with new contents at the same addresses.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "daemon/engine/safetensors.h"
#include "kernels/fp8.h"
#include "kernels/mla.h"
#include "kernels/mxfp4.h"
#include "kernels/sampler.h"

namespace spark::engine {

class Collective;

/// Element types of device buffers. fp8_e4m3: an FP8 weight matrix kept as the checkpoint
/// stores it, its block scales beside (Buffer::scales()). mxfp4_e2m1: an MXFP4 weight matrix
/// kept packed as stored (two e2m1 values a byte, the even column in the low nibble; half a
/// byte an element), its e8m0 scales beside (Buffer::scales(), u8). u8: raw bytes (those
/// scales).
enum class ElemType : uint8_t { f32, bf16, i32, fp8_e4m3, mxfp4_e2m1, u8 };
/// Bytes per element (MXFP4: 0, it has half a byte an element: use elem_bytes).
size_t elem_size(ElemType t);
/// Bytes of `numel` elements (MXFP4: numel / 2, numel even).
size_t elem_bytes(ElemType t, size_t numel);
/// "fp32", "bf16", "i32", "fp8", "mxfp4", "u8".
const char* elem_name(ElemType t);

class Buffer;
/// The block scales of a weight matrix kept as stored: FP8 (kernels/fp8.h's layout: one fp32
/// per 128 columns and per `1 << row_shift` rows) or MXFP4 (kernels/mxfp4.h's: one e8m0 byte
/// per 32 columns of each row) of the [rows][cols] matrix whose first element is at `base`.
struct BlockScales;

/// A view of device memory: shares ownership of the allocation it points into.
class Buffer {
 public:
  Buffer() = default;
  Buffer(std::shared_ptr<void> owner, void* data, size_t numel, ElemType type)
      : owner_(std::move(owner)), data_(data), numel_(numel), type_(type) {}
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t numel() const { return numel_; }
  size_t bytes() const { return elem_bytes(type_, numel_); }
  ElemType type() const { return type_; }
  bool empty() const { return numel_ == 0; }
  /// Elements [offset, offset + n) of this view (clamped to it); a view of an FP8 or MXFP4
  /// matrix keeps the matrix's scales (an MXFP4 view starts at an even element).
  Buffer view(size_t offset, size_t n) const;
  /// An FP8 or MXFP4 matrix's block scales (null for every other buffer).
  const BlockScales* scales() const { return scales_.get(); }
  void set_scales(std::shared_ptr<const BlockScales> s) { scales_ = std::move(s); }

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  size_t numel_ = 0;
  ElemType type_ = ElemType::f32;
  std::shared_ptr<const BlockScales> scales_;
};

struct BlockScales {
  Buffer scales;               // FP8: f32 [((rows - 1) >> row_shift) + 1][ld]; MXFP4: u8 [rows][ld]
  size_t ld = 0;               // FP8: ceil(cols / 128); MXFP4: cols / 32
  int row_shift = 7;           // FP8 7: 128-row blocks as stored; 0: one scale row per matrix row
  const void* base = nullptr;  // the matrix's first byte (a view's rows count from here)
  size_t cols = 0;             // the matrix's row width
};

/// The FP8 matrix `w` (a view of whole rows of one) as kernels/fp8.h takes it: its bytes, its
/// scales from its first row on. Errc::internal when `w` is not FP8 or starts inside a
/// scale block.
Result<kernels::Fp8Weight> fp8_weight(const Buffer& w);
/// The MXFP4 matrix `w` (a view of whole rows of one) as kernels/mxfp4.h takes it: its packed
/// bytes and its scales from its first row on. Errc::internal when `w` is not MXFP4 or does
/// not start on a row.
Result<kernels::Mxfp4Weight> mxfp4_weight(const Buffer& w);

/// One layer's paged K/V pools: blocks of [block_size][n_kv_heads][head_dim] elements.
struct KVLayerView {
  void* k = nullptr;
  void* v = nullptr;
  int num_blocks = 0;
  int block_size = 16;
  int n_kv_heads = 0;
  int head_dim = 0;
  ElemType type = ElemType::f32;
  /// A windowed layer's own pool (KVCache): read through StepLayout's window tables and
  /// written through its window slots.
  bool windowed = false;
  /// fp32 pools that hold e4m3 values (KV_DTYPE=fp8 on the CPU): the KV write rounds each
  /// value as the GPU's e4m3 store does, so both devices attend over the same values.
  bool fp8_values = false;
};

/// One forward step, flattened. Token row t belongs to chunk c when
/// chunk_begin[c] <= t < chunk_begin[c + 1]; its position is positions[t]. Chunk c's block
/// table is block_tables[c * table_width ...] (padded with 0), covering its positions.
/// Where the cache keeps windowed layers apart, window_tables and window_slots are the same
/// for those layers' pools: chunk c's logical block i is its ring's block i mod ring size
/// (the ring holds the window and the step's tokens, so what a query reads is never
/// overwritten by the step). A token's slot is -1 where it is not written: a prefix-cache
/// hit recomputes tokens whose full layers' K/V are already in shared blocks.
struct StepLayout {
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<int32_t> chunk_begin;  // size chunks + 1
  std::vector<int32_t> chunk_len;    // per chunk: positions[last] + 1 (its context length)
  std::vector<int32_t> block_tables;
  int table_width = 0;
  std::vector<int32_t> slots;          // per token: its cache slot (block * block_size + offset)
  std::vector<int32_t> window_tables;  // empty: the cache keeps no layer apart
  std::vector<int32_t> window_slots;
  std::vector<int32_t> logit_rows;  // token rows whose logits are computed, in order
  int max_seq_len_bound = 0;        // > 0: size attention for contexts up to this (graph capture)
  int tokens_n() const { return static_cast<int>(tokens.size()); }
  int chunks_n() const {
    return static_cast<int>(chunk_begin.empty() ? 0 : chunk_begin.size() - 1);
  }
  /// True when every chunk is one token (a decode-only step: graph-capturable).
  bool decode_only() const { return tokens_n() == chunks_n(); }
};

/// WEIGHTS_PLACEMENT: where a CUDA rank keeps its weights. `device`: device memory, filled
/// through page-locked staging buffers. `host_mapped`: one page-locked host allocation that
/// the GPU reads in place, filled by reading the files straight into it (no staging, no
/// device copy): on unified memory (GB10) that is the same DRAM the GPU reads at full speed,
/// so the weights exist once; on a discrete GPU every read crosses the bus (slow, but the
/// same kernels over the same bytes, which is how it is tested there). `auto`: host_mapped
/// on an integrated GPU that can map host memory, else device.
enum class WeightsPlacement { automatic, device, host_mapped };
/// "auto", "device", "host-mapped" (Errc::config naming the value otherwise).
Result<WeightsPlacement> parse_weights_placement(const std::string& s);
const char* weights_placement_name(WeightsPlacement p);

/// What serves a rank, for logs, /health and `sparkctl status`.
struct DeviceInfo {
  std::string kind;             // "cpu" or "cuda"
  std::string name;             // "cpu (OpenBLAS, 4 threads)", "NVIDIA H200 (sm_90, 139.8 GiB)"
  int ordinal = -1;             // CUDA device index
  int sm = 0;                   // compute capability x 10 (90, 121)
  bool unified_memory = false;  // the GPU shares the host's memory (GB10)
  std::string gpu_uuid;         // the physical GPU ("" on the CPU)
  uint64_t total_bytes = 0;     // device memory (0 on the CPU)
  /// Where the weights live (never `automatic`; the CPU's are host memory: `device`).
  WeightsPlacement weights = WeightsPlacement::device;
  /// The kind and name, and on CUDA where the weights are ("cuda sm_90 (NVIDIA H200, device
  /// 0) (139.8 GiB); weights in device memory"), as /health and `sparkctl status` show a
  /// rank's device.
  std::string describe() const;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const DeviceInfo& info() const = 0;
  /// Element type the device keeps weight matrices and KV in by default, and computes
  /// activations in (CPU: fp32; CUDA: bf16).
  virtual ElemType compute_type() const = 0;

  // ---- memory ----
  /// Allocates `numel` elements (contents unspecified).
  virtual Result<Buffer> alloc(ElemType type, size_t numel) = 0;
  /// Allocates a model's weight buffers, one per entry of `sizes` (type, elements). By
  /// default one alloc() each; with host-mapped weights one page-locked allocation for all
  /// (256-byte aligned views, as device allocations are).
  virtual Result<std::vector<Buffer>> alloc_weights(
      const std::vector<std::pair<ElemType, size_t>>& sizes);
  /// The address at which the host may write `b` directly (a view of host-mapped weights),
  /// or nullptr: a loader then reads bytes that need no conversion straight into it, and
  /// goes through upload() for the rest.
  virtual void* host_address(const Buffer& b) const {
    (void)b;
    return nullptr;
  }
  /// Fills `dst` from the host: `src` holds dst.numel() elements of safetensors type
  /// `src_type` (F32, BF16 or F16), converted to dst's type; or F8_E4M3 bytes into an FP8
  /// buffer, as they are. The copy may still be running
  /// on return: write `src` again only after staging_ready(src) or synchronize() (a loader
  /// alternates two staging buffers so that a file read overlaps the other's copy).
  virtual Status upload(const Buffer& dst, const void* src, DType src_type) = 0;
  /// A host buffer of `bytes` for loading slices straight into (page-locked on CUDA, so the
  /// copy to the device runs at bus speed with no second host copy).
  virtual Result<Buffer> host_staging(size_t bytes) = 0;
  /// Size of the staging buffer a loader should use (small on the CPU, where it adds to
  /// peak memory; larger on a GPU, where each copy has a fixed cost).
  virtual size_t preferred_staging_bytes() const = 0;
  /// Waits until no upload still reads host buffer `src`.
  virtual Status staging_ready(const void* src) {
    (void)src;
    return Status::Ok();
  }
  /// True when the device's products take FP8 weight matrices as stored (ElemType::fp8_e4m3
  /// with their block scales); a loader widens them into the compute type otherwise.
  virtual bool keeps_fp8() const { return false; }
  /// True when the device's expert products take MXFP4 experts packed as stored
  /// (ElemType::mxfp4_e2m1 with their e8m0 scales); a loader widens them otherwise.
  virtual bool keeps_mxfp4() const { return false; }
  /// Element type of weight vectors (norm weights, biases) on this device.
  virtual ElemType vector_type() const { return compute_type(); }
  /// Sets `dst` to zero.
  virtual Status zero(const Buffer& dst) = 0;
  /// Fills `dst` (f32 or bf16) with values uniform in [offset - scale, offset + scale], each a
  /// hash of `seed` and its index (kernels/fill.h): the same values on every device and run.
  /// For benchmarks of shapes whose checkpoints would not fit a disk (Model::synthetic).
  virtual Status fill_random(const Buffer& dst, uint64_t seed, float scale, float offset) = 0;
  /// Copies `n` fp32 elements of `src` (fp32 or bf16 buffer) to host floats.
  virtual Status to_host(const Buffer& src, float* dst, size_t n) = 0;
  /// Copies the first `bytes` of `src` to host memory as they are (waits for the step's work).
  virtual Status copy_to_host(const Buffer& src, void* dst, size_t bytes) {
    (void)src, (void)dst, (void)bytes;
    return make_error(Errc::unsupported, "this device does not copy raw bytes back");
  }
  /// Bytes this process may still allocate on the device (CUDA: free device memory, or on
  /// unified memory MemAvailable; CPU: MemAvailable).
  virtual Result<uint64_t> available_bytes() = 0;

  // ---- one step ----
  /// Takes the step's layout (copied; the device's ops of this step read it).
  virtual Status begin_step(const StepLayout& step) = 0;
  /// x[t] = table[tokens[t]] (rows of `dim`).
  virtual Status embed(const Buffer& table, const Buffer& x, int dim) = 0;
  /// y = rmsnorm(x) * w, `rows` rows of `dim`.
  virtual Status rmsnorm(const Buffer& x, const Buffer& w, const Buffer& y, int rows, int dim,
                         float eps) = 0;
  /// x += delta (+ bias per column) when delta is not empty; then, when w is not empty,
  /// y = rmsnorm(x) * w. `rows` rows of `dim`.
  virtual Status add_rmsnorm(const Buffer& x, const Buffer& delta, const Buffer& bias,
                             const Buffer& w, const Buffer& y, int rows, int dim, float eps) = 0;
  /// y[rows][out] = x[rows][in] * W^T (+ b); W is [out][in] as Hugging Face stores it.
  virtual Status linear(const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y,
                        int rows, int in, int out) = 0;
  /// q ([tokens][heads][head_dim]) and k ([tokens][kv_heads][head_dim]): each head
  /// RMS-normalised first when q_norm/k_norm are not empty (Qwen3), then rotated by the
  /// step's positions (rotate-half layout).
  virtual Status rope_qk(const Buffer& q, const Buffer& k, int heads, int kv_heads, int head_dim,
                         const Buffer& inv_freq, const Buffer& q_norm, const Buffer& k_norm,
                         float eps) = 0;
  /// Writes the step's k/v rows ([tokens][kv_heads][head_dim]) into the cache.
  virtual Status kv_write(const KVLayerView& kv, const Buffer& k, const Buffer& v) = 0;
  /// rope_qk, then kv_write of the rotated k and of v: what a layer does before attention,
  /// in one pass where the device can fuse the two.
  virtual Status rope_kv_write(const Buffer& q, const Buffer& k, const Buffer& v, int heads,
                               int kv_heads, int head_dim, const Buffer& inv_freq,
                               const Buffer& q_norm, const Buffer& k_norm, float eps,
                               const KVLayerView& kv) {
    SPARK_TRY(rope_qk(q, k, heads, kv_heads, head_dim, inv_freq, q_norm, k_norm, eps));
    return kv_write(kv, k, v);
  }
  /// Causal attention of each chunk's q rows over its cache ([tokens][heads][head_dim]);
  /// window 0 = unlimited.
  virtual Status attention(const KVLayerView& kv, const Buffer& q, const Buffer& out, int heads,
                           float scale, int window) = 0;
  /// attention() where each head's learned sink logit (`sinks`, [heads] fp32) joins the
  /// softmax's denominator (gpt-oss). By default: attention() when `sinks` is empty, else
  /// Errc::unsupported.
  virtual Status attention_sinks(const KVLayerView& kv, const Buffer& q, const Buffer& out,
                                 int heads, float scale, int window, const Buffer& sinks) {
    if (sinks.empty()) return attention(kv, q, out, heads, scale, window);
    return make_error(Errc::unsupported,
                      "attention sinks (gpt-oss) run on the CPU device only in this build");
  }
  /// Multi-head latent attention (DeepSeek-V3) of the step's tokens over a latent cache (one
  /// pool, rows of latent + rope): kv_a ([tokens][latent + rope], kv_a_proj_with_mqa's output)
  /// gets its latent RMS-normalised by kv_norm and its k_pe rotated, in place, and is written
  /// to the cache; q ([tokens][heads][nope + rope]) gets its q_pe rotated in place; then each
  /// chunk's tokens attend causally with kv_b ([heads][nope + v_dim][latent], this rank's
  /// heads of kv_b_proj) absorbed, into out ([tokens][heads][v_dim]) (kernels/mla.h).
  struct MlaArgs {
    int heads = 0;
    int nope = 0, rope = 0, v_dim = 0, latent = 0;
    bool interleave = true;
    float rope_factor = 1.f;  // YaRN's attention factor on the rotated part's cos and sin
    float eps = 0.f;          // kv_a_layernorm's
    float scale = 0.f;        // softmax scale
  };
  virtual Status mla_attention(const KVLayerView& kv, const Buffer& q, const Buffer& kv_a,
                               const Buffer& kv_norm, const Buffer& kv_b, const Buffer& inv_freq,
                               const Buffer& out, const MlaArgs& a) {
    (void)kv, (void)q, (void)kv_a, (void)kv_norm, (void)kv_b, (void)inv_freq, (void)out, (void)a;
    return make_error(Errc::unsupported,
                      "latent attention (DeepSeek-V3) has no kernels on this device");
  }
  /// y[r][i] = silu(gu[r][i]) * gu[r][dim + i].
  virtual Status swiglu(const Buffer& gate_up, const Buffer& y, int rows, int dim) = 0;
  /// One product of a group over the same input: y = x * w^T (+ b), `out` columns.
  struct LinearPart {
    const Buffer* w = nullptr;
    const Buffer* b = nullptr;  // empty buffer: no bias
    const Buffer* y = nullptr;
    int out = 0;
  };
  /// The products of `n` parts over the same x ([rows][in]): the q, k and v projections.
  /// A device may run them as one launch; by default one linear() each.
  virtual Status linear_group(const Buffer& x, const LinearPart* parts, int n, int rows, int in) {
    for (int i = 0; i < n; ++i)
      SPARK_TRY(linear(x, *parts[i].w, *parts[i].b, *parts[i].y, rows, in, parts[i].out));
    return Status::Ok();
  }
  /// The input of a product that a norm precedes, as a layer's two norms do: x += delta
  /// (+ bias per column) when delta is not empty, then the product reads rmsnorm(x) * w
  /// ([rows][in], in = the product's input width). `normed` holds that input where the
  /// device runs the norm as its own pass (by default: add_rmsnorm() into it); a device may
  /// instead normalise inside the product and leave `normed` unwritten.
  struct PreNorm {
    const Buffer* x = nullptr;
    const Buffer* delta = nullptr;  // empty buffer: no add
    const Buffer* bias = nullptr;   // empty buffer: no bias
    const Buffer* w = nullptr;
    const Buffer* normed = nullptr;
    float eps = 0.f;
    /// w is ones: the norm's weight was folded into the weights of the products that read
    /// the normalised row (fold_norm_weight), so a product that normalises inside needs
    /// only the 1 / rms scale.
    bool folded = false;
  };
  /// Whether the model folds its layer norms' weights into the products after them (q/k/v
  /// after the input norm, gate/up after the post-attention norm), with one bf16 rounding
  /// per weight: a device whose products then normalise with the scale alone, faster.
  virtual bool folds_norm_weights() const { return false; }
  /// w ([rows][cols] bf16, in this device's memory) times norm_w ([cols]) column by column,
  /// in place (kernels::rmsnorm_fold_weight_ref).
  virtual Status fold_norm_weight(const Buffer& w, const Buffer& norm_w, int cols) {
    (void)w, (void)norm_w, (void)cols;
    return make_error(Errc::unsupported, "this device does not fold norm weights");
  }
  /// The pass a PreNorm stands for, into `normed`.
  Status pre_norm(const PreNorm& in, int rows, int dim) {
    return add_rmsnorm(*in.x, *in.delta, *in.bias, *in.w, *in.normed, rows, dim, in.eps);
  }
  /// The q, k, v products over the normalised input (parts: q, k, v), then rope_kv_write()
  /// on their outputs, what a layer does before attention. A device may normalise inside
  /// the products and rotate and write the cache in their epilogue. By default pre_norm(),
  /// linear_group(), then rope_kv_write().
  virtual Status linear_group_rope_kv_write(const PreNorm& x, const LinearPart* qkv, int rows,
                                            int in, int heads, int kv_heads, int head_dim,
                                            const Buffer& inv_freq, const Buffer& q_norm,
                                            const Buffer& k_norm, float eps,
                                            const KVLayerView& kv) {
    SPARK_TRY(pre_norm(x, rows, in));
    SPARK_TRY(linear_group(*x.normed, qkv, 3, rows, in));
    return rope_kv_write(*qkv[0].y, *qkv[1].y, *qkv[2].y, heads, kv_heads, head_dim, inv_freq,
                         q_norm, k_norm, eps, kv);
  }
  /// y = swiglu(normalised x * w^T (+ b)) for the fused [gate | up] weight w (2 * inter
  /// rows); gate_up ([rows][2 * inter]) is scratch that a device fusing the two may leave
  /// unused. By default pre_norm(), linear() into gate_up, then swiglu().
  virtual Status linear_swiglu(const PreNorm& x, const Buffer& w, const Buffer& b,
                               const Buffer& gate_up, const Buffer& y, int rows, int in,
                               int inter) {
    SPARK_TRY(pre_norm(x, rows, in));
    SPARK_TRY(linear(*x.normed, w, b, gate_up, rows, in, 2 * inter));
    return swiglu(gate_up, y, rows, inter);
  }
  /// y += x * w^T (+ b): a product added into the residual stream. `scratch` ([rows][out])
  /// holds the product where the device does not add it in the product's epilogue (by
  /// default: linear() into scratch, then add_rmsnorm() without a norm).
  virtual Status linear_add(const Buffer& x, const Buffer& w, const Buffer& b,
                            const Buffer& scratch, const Buffer& y, int rows, int in, int out) {
    SPARK_TRY(linear(x, w, Buffer(), scratch, rows, in, out));
    return add_rmsnorm(y, scratch, b, Buffer(), Buffer(), rows, out, 0.f);
  }
  // ---- mixture of experts ----
  /// How a router turns a row of logits into its experts (kernels/moe.h).
  struct MoeRoute {
    int experts = 0, top_k = 0;
    bool sigmoid = false;  // else softmax
    bool norm_topk = false;
    int n_group = 1, topk_group = 1;
    float scaling = 1.f;
  };
  /// Routes `rows` rows of router logits ([rows][experts] fp32) into ids ([rows][top_k]
  /// i32) and weights ([rows][top_k] fp32); `bias` ([experts] fp32, or empty) joins the
  /// scores for the choice only. With `margin` (host floats, [rows][2]) the choice values of
  /// the last chosen and the first unchosen expert come back (a device may leave margins
  /// unsupported: Errc::unsupported).
  virtual Status moe_route(const Buffer& logits, const Buffer& bias, const MoeRoute& r,
                           const Buffer& ids, const Buffer& weights, int rows,
                           float* margin = nullptr) = 0;
  /// The experts of one MoE layer this rank holds, and the shared experts.
  struct MoeExperts {
    const Buffer* gate_up = nullptr;  // [experts][2 * inter][hidden], per expert [gate | up]
    const Buffer* down = nullptr;     // [experts][hidden][inter]
    int expert0 = 0, experts = 0;     // held: routed ids [expert0, expert0 + experts)
    int inter = 0, hidden = 0, top_k = 0;
    const Buffer* shared_gate_up = nullptr;  // [2 * shared_inter][hidden]
    const Buffer* shared_down = nullptr;     // [hidden][shared_inter]
    int shared_inter = 0;                    // 0: no shared experts on this rank
    bool accumulate = false;                 // out += the sum (the residual stream at one rank)
    // gpt-oss's experts: biases, gate and up interleaved (row 2i gate, 2i + 1 up), and the
    // clamped activation (up + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) and up
    // clamped to [-limit, limit]. swiglu_limit 0: silu(gate) * up.
    const Buffer* gate_up_bias = nullptr;  // [experts][2 * inter] (empty: none)
    const Buffer* down_bias = nullptr;     // [experts][hidden] (empty: none, or not this rank's)
    bool interleaved = false;
    float swiglu_limit = 0.f, swiglu_alpha = 0.f;
    bool plain() const {
      return !interleaved && swiglu_limit == 0.f && (!gate_up_bias || gate_up_bias->empty()) &&
             (!down_bias || down_bias->empty());
    }
  };
  /// out[r] = sum over j of weights[r][j] * expert_{ids[r][j]}(x[r]) for the chosen experts
  /// this rank holds (a gated SiLU MLP each), plus the shared experts' MLP of x[r]; x and
  /// out are [rows][hidden] in the compute type, out overwritten (or added to, with
  /// MoeExperts::accumulate).
  virtual Status moe_experts(const Buffer& x, const Buffer& ids, const Buffer& weights,
                             const MoeExperts& e, const Buffer& out, int rows) = 0;
  /// Sizes the expert products' workspace for steps of up to `rows` rows, so that such steps
  /// allocate nothing (graphs keep their addresses).
  virtual Status reserve_moe(int rows, int top_k, int hidden, int inter, int shared_inter,
                             int experts) {
    (void)rows, (void)top_k, (void)hidden, (void)inter, (void)shared_inter, (void)experts;
    return Status::Ok();
  }
  /// x[r] (rows of `dim` on this rank, in place) RMS-normalised over the whole row of
  /// `total_dim` columns that the tensor-parallel ranks hold together (the sums of squares
  /// are all-reduced), times w ([dim], this rank's share of the norm weight): a norm over
  /// all heads of a projection (MiniMax-M2's q/k norm).
  virtual Status rmsnorm_across(Collective& comm, const Buffer& x, const Buffer& w, int rows,
                                int dim, int total_dim, float eps) = 0;

  /// y[r] = x[logit_rows[r]] (rows of `dim`).
  virtual Status gather_logit_rows(const Buffer& x, const Buffer& y, int dim) = 0;
  /// Sums `x` across the tensor-parallel ranks in place (CPU: the host collective; CUDA: the
  /// collective's device call on this device's stream, so a graph can record it).
  virtual Status all_reduce(Collective& comm, const Buffer& x) = 0;
  /// The vocab-parallel lm_head's gather: `local` holds this rank's [rows][cols] fp32 slice
  /// of the logits; every rank ends with `out` = [rows][world * cols] (rank r's columns at
  /// r * cols). `scratch` holds world * rows * cols fp32 (unused when rows == 1).
  virtual Status all_gather_columns(Collective& comm, const Buffer& local, const Buffer& scratch,
                                    const Buffer& out, int rows, int cols) = 0;
  /// Waits for the step's work and reports its errors.
  virtual Status synchronize() = 0;

  // ---- fixed-address steps and graphs (CUDA; the CPU runs every step eagerly) ----
  /// Sizes the step buffers for up to `tokens` tokens in `chunks` sequences with block
  /// tables `width` wide, and decode attention over contexts of `max_seq_len` with `heads`
  /// heads of `head_dim`, so such steps allocate nothing (a captured graph keeps its
  /// addresses).
  virtual Status reserve_step(int tokens, int chunks, int width, int max_seq_len, int heads,
                              int head_dim) {
    (void)tokens, (void)chunks, (void)width, (void)max_seq_len, (void)heads, (void)head_dim;
    return Status::Ok();
  }
  /// The same for latent attention's steps (DeepSeek-V3): its workspace for up to `tokens`
  /// tokens, decode steps of up to `seqs` sequences over contexts of `max_seq_len`.
  virtual Status reserve_mla(int tokens, int seqs, int max_seq_len, const MlaArgs& a) {
    (void)tokens, (void)seqs, (void)max_seq_len, (void)a;
    return Status::Ok();
  }
  /// The longest context a decode step of `seqs` sequences may attend to and still run the
  /// device's short-context attention (for these heads and a cache of `kv`), 0 when it has
  /// none. Graphs of decode steps whose contexts all fit are captured with this bound, apart
  /// from those captured with the step buffers' bound.
  virtual int decode_short_context(int seqs, int heads, int kv_heads, int head_dim,
                                   ElemType kv) const {
    (void)seqs, (void)heads, (void)kv_heads, (void)head_dim, (void)kv;
    return 0;
  }
  /// True when graph_begin/graph_end/graph_launch work on this device.
  virtual bool supports_graphs() const { return false; }
  /// Starts recording the ops that follow (not running them) into a graph.
  virtual Status graph_begin() { return make_error(Errc::unsupported, "no graphs on this device"); }
  /// Ends the recording and keeps it under `key` (also when it failed: then ends the capture
  /// and returns the error).
  virtual Status graph_end(uint64_t key) {
    (void)key;
    return make_error(Errc::unsupported, "no graphs on this device");
  }
  /// Replays the graph under `key` with the current step's metadata; false when there is none.
  virtual Result<bool> graph_launch(uint64_t key) {
    (void)key;
    return false;
  }
  /// Drops every graph (their buffers changed).
  virtual void graph_clear() {}

  // ---- sampling on the device (CUDA; the CPU samples on the host from the logits) ----
  /// True when sample() draws on this device.
  virtual bool samples_on_device() const { return false; }
  /// The tokens a row's penalties look at: the sequence so far, prompt first; those from
  /// out_start on are its output (they count for the presence and frequency penalties).
  /// A row's allowed ids (structured outputs) travel with it: mask, (vocab + 31) / 32 words,
  /// null for a row without a constraint.
  struct PenaltyHistory {
    const int32_t* tokens = nullptr;
    int n = 0;
    int out_start = 0;
    const uint32_t* mask = nullptr;
  };
  /// Draws one token per row of `logits` (rows of `vocab` fp32) with params[r] and copies
  /// the results back: the step's one host synchronisation. `history` is empty when no row
  /// has a penalty or a mask, else one entry per row (rows without penalties may leave theirs
  /// empty); the device builds the penalty state from it as the host sampler keeps it.
  virtual Status sample(const Buffer& logits, int vocab,
                        const std::vector<kernels::SampleParams>& params,
                        const std::vector<PenaltyHistory>& history,
                        std::vector<kernels::SampleResult>* out) {
    if (queues_steps()) {  // the draws queued, then read
      SPARK_TRY(sample_queue(logits, vocab, params, history));
      return sample_wait(out);
    }
    (void)out;
    return make_error(Errc::unsupported, "this device samples on the host");
  }
  /// Queued steps (the engine's overlapped decode): sample_queue() is sample() that returns
  /// once the draws are queued, before they are done; sample_wait() waits for the oldest
  /// queued draws and copies them out. At most two draws are queued at a time (the host
  /// buffers are double), so a step can be queued behind one whose results are unread.
  /// feed_drawn_tokens(n), right after begin_step(), makes this step's tokens [0, n) the
  /// tokens the last queued draws picked for their rows [0, n), on the device: the step
  /// runs on draws the host has not seen yet.
  virtual bool queues_steps() const { return false; }
  virtual Status sample_queue(const Buffer& logits, int vocab,
                              const std::vector<kernels::SampleParams>& params,
                              const std::vector<PenaltyHistory>& history) {
    (void)logits, (void)vocab, (void)params, (void)history;
    return make_error(Errc::unsupported, "this device does not queue steps");
  }
  virtual Status sample_wait(std::vector<kernels::SampleResult>* out) {
    (void)out;
    return make_error(Errc::unsupported, "this device does not queue steps");
  }
  virtual Status feed_drawn_tokens(int n) {
    (void)n;
    return make_error(Errc::unsupported, "this device does not queue steps");
  }
};

/// The CPU device (fp32; OpenBLAS). Process-wide, stateless apart from one step's layout,
/// so the instance returned is new each call.
std::shared_ptr<Device> make_cpu_device();
/// The CPU device that also draws the tokens itself, through the sampler's twin
/// (kernels::sample_ref, the penalty state built from each row's history) as a GPU does, and
/// queues steps: the engine's on-device sampling and overlapped decode then run on the CPU
/// (tests hold them against the host sampler). Same draws as the host sampler.
std::shared_ptr<Device> make_cpu_device_sampling();

/// How a CUDA device is opened.
struct CudaDeviceOptions {
  WeightsPlacement weights = WeightsPlacement::automatic;
  /// Root under which /proc/meminfo is read for unified memory's MemAvailable ("/" live;
  /// tests: a captured tree).
  std::string proc_root = "/";
  /// Fold the layer norms' weights into the products after them where the weights are in
  /// the device's own memory (Device::folds_norm_weights); false keeps the checkpoint's
  /// weights bit for bit (tests compare against weights read in place, which cannot be).
  bool fold_norms = true;
};

/// The CUDA device `ordinal` (Errc::unsupported naming why it cannot be used: no driver, no
/// device, an architecture this build has no kernels for, cuBLASLt missing, host-mapped
/// weights asked of a GPU that cannot map host memory).
Result<std::shared_ptr<Device>> make_cuda_device(int ordinal, const CudaDeviceOptions& opts = {});

/// DEVICE=auto|cpu|cuda: the device to serve with. auto picks CUDA when usable, else the
/// CPU, and puts why into `*fallback_reason`.
Result<std::shared_ptr<Device>> select_device(const std::string& choice, int ordinal,
                                              std::string* fallback_reason,
                                              const CudaDeviceOptions& opts = {});

/// MemAvailable of <proc_root>/proc/meminfo in bytes.
Result<uint64_t> host_mem_available(const std::string& proc_root = "/");

/// The bytes a device's allocations may still take: on unified memory (the GPU allocates
/// from the host's RAM, and the host freezes when that runs out) MemAvailable under
/// `proc_root`, else `device_free` (the GPU's own free memory).
Result<uint64_t> device_memory_available(bool unified_memory, uint64_t device_free,
                                         const std::string& proc_root);

/// The latent attention kernels' shape (both devices' kernels take it) of `a`.
inline kernels::MlaShape mla_shape(const Device::MlaArgs& a) {
  kernels::MlaShape s;
  s.heads = a.heads;
  s.nope = a.nope;
  s.rope = a.rope;
  s.v_dim = a.v_dim;
  s.latent = a.latent;
  s.interleave = a.interleave;
  s.rope_factor = a.rope_factor;
  s.scale = a.scale;
  return s;
}

}  // namespace spark::engine
