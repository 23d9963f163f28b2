// The CUDA entry points of a build without CUDA: each says so instead of failing to link.
#if !defined(SPARK_HAVE_CUDA)

#include <utility>

#include "kernels/bias.h"
#include "kernels/cuda_runtime.h"
#include "kernels/embedding.h"
#include "kernels/fill.h"
#include "kernels/fp8.h"
#include "kernels/matmul.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/paged_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
#include "kernels/swiglu.h"

namespace spark::kernels {
namespace {
Error no_cuda(const char* what) {
  return make_error(Errc::unsupported,
                    std::string(what) +
                        ": built without CUDA (nvcc was not found at configure time; "
                        "reconfigure with CUDA installed and SPARK_CUDA=ON)");
}
}  // namespace

bool built_with_cuda() {
  return false;
}
Result<int> cuda_device_count() {
  return no_cuda("cuda_device_count");
}
std::string cuda_runtime_version() {
  return {};
}
std::string cuda_architectures() {
  return {};
}

Status cuda_synchronize() {
  return no_cuda("cuda_synchronize");
}
Result<DeviceMemory> DeviceMemory::allocate(size_t) {
  return no_cuda("DeviceMemory::allocate");
}
DeviceMemory& DeviceMemory::operator=(DeviceMemory&& o) noexcept {
  std::swap(p_, o.p_), std::swap(n_, o.n_);
  return *this;
}
DeviceMemory::~DeviceMemory() = default;
Status DeviceMemory::copy_from_host(const void*, size_t) {
  return no_cuda("DeviceMemory::copy_from_host");
}
Status DeviceMemory::copy_to_host(void*, size_t) const {
  return no_cuda("DeviceMemory::copy_to_host");
}

// Argument errors come first, as in the CUDA build, so callers see the same contract.
Status rmsnorm_cuda(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(float)));
  return no_cuda("rmsnorm_cuda");
}
Status rmsnorm_bf16_cuda(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows,
                         size_t dim, float eps) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(bf16_bits)));
  return no_cuda("rmsnorm_bf16_cuda");
}
Status rmsnorm_cuda_device(const float* x, const float* w, float* y, size_t rows, size_t dim,
                           float eps, void*) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(float)));
  return no_cuda("rmsnorm_cuda_device");
}
Status rmsnorm_bf16_cuda_device(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows,
                                size_t dim, float eps, void*) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(bf16_bits)));
  return no_cuda("rmsnorm_bf16_cuda_device");
}

Status swiglu_cuda(const float* gate_up, float* y, size_t rows, size_t dim) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(float)));
  return no_cuda("swiglu_cuda");
}
Status swiglu_bf16_cuda(const bf16_bits* gate_up, bf16_bits* y, size_t rows, size_t dim) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(bf16_bits)));
  return no_cuda("swiglu_bf16_cuda");
}
Status swiglu_cuda_device(const float* gate_up, float* y, size_t rows, size_t dim, void*) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(float)));
  return no_cuda("swiglu_cuda_device");
}
Status swiglu_bf16_cuda_device(const bf16_bits* gate_up, bf16_bits* y, size_t rows, size_t dim,
                               void*) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(bf16_bits)));
  return no_cuda("swiglu_bf16_cuda_device");
}

Result<DeviceLimits> cuda_device_limits(int) {
  return no_cuda("cuda_device_limits");
}
std::string describe_device(const DeviceLimits& d) {
  return "sm_" + std::to_string(d.cc_major * 10 + d.cc_minor) + " (" + d.name + ", device " +
         std::to_string(d.device) + ")";
}
Status cuda_select_device(int) {
  return no_cuda("cuda_select_device");
}
Status cuda_check_launch(const char* kernel, unsigned, size_t) {
  return no_cuda(kernel);
}

Status embedding_cuda_device(DType, const void* table, size_t vocab, size_t dim, const int32_t* ids,
                             size_t n, void* out, void*) {
  SPARK_TRY(embedding_check_args(table, vocab, dim, ids, n, out));
  return no_cuda("embedding_cuda_device");
}
Status bias_add_cuda_device(DType, void*, const void*, size_t, size_t, void*) {
  return no_cuda("bias_add_cuda_device");
}
Status add_rmsnorm_cuda_device(DType dt, void* hidden, const void*, const void* w, void* out,
                               size_t rows, size_t dim, float eps, void*) {
  SPARK_TRY(rmsnorm_check_args(hidden, w, out, rows, dim, eps, dtype_size(dt)));
  return no_cuda("add_rmsnorm_cuda_device");
}
Status head_rmsnorm_cuda_device(DType, void*, size_t, size_t, int, int, const void*, float, void*) {
  return no_cuda("head_rmsnorm_cuda_device");
}
Status rmsnorm_fold_weight_cuda_device(bf16_bits*, size_t, size_t, const bf16_bits*, void*) {
  return no_cuda("rmsnorm_fold_weight_cuda_device");
}
Status rope_cuda_device(const RopeArgs& a, void*) {
  SPARK_TRY(rope_check_args(a));
  return no_cuda("rope_cuda_device");
}
Status paged_kv_write_cuda_device(const PagedKVDevice&, const int32_t*, size_t, DType, const void*,
                                  size_t, const void*, size_t, void*) {
  return no_cuda("paged_kv_write_cuda_device");
}
Status attention_prefill_cuda_device(const AttentionBatch& b, void*) {
  SPARK_TRY(attention_check_args(b, false));
  return no_cuda("attention_prefill_cuda_device");
}
Status mla_cuda_device(const MlaCudaArgs&, void*) {
  return no_cuda("mla_cuda_device");
}
Status attention_decode_cuda_device(const AttentionBatch& b, void*) {
  SPARK_TRY(attention_check_args(b, true));
  return no_cuda("attention_decode_cuda_device");
}
Status attention_decode_short_cuda_device(const AttentionBatch& b, void*) {
  SPARK_TRY(attention_check_args(b, true));
  return no_cuda("attention_decode_short_cuda_device");
}
int attention_decode_short_max(int, DType) {
  return 0;
}
int attention_decode_short_bound(int, int, int, int, DType) {
  return 0;
}
bool attention_decode_short_takes(const AttentionBatch&) {
  return false;
}
Status attention_decode_partitioned_cuda_device(const AttentionBatch& b, void*) {
  SPARK_TRY(attention_check_args(b, true,
                                 attention_decode_partitioned_workspace_bytes(
                                     b.n_seqs, b.n_heads, b.kv.head_dim, b.max_seq_len)));
  return no_cuda("attention_decode_partitioned_cuda_device");
}
Status sample_cuda_device(const SampleBatch&, void*) {
  return no_cuda("sample_cuda_device");
}
Status sample_cuda_device(const SampleBatch&, void*, const SampleLaunch&) {
  return no_cuda("sample_cuda_device");
}
Status sample_cuda_device_v1(const SampleBatch&, void*) {
  return no_cuda("sample_cuda_device_v1");
}
Status sample_state_reset_cuda_device(uint8_t*, int32_t*, int, const int32_t*, size_t, void*) {
  return no_cuda("sample_state_reset_cuda_device");
}
Status sample_state_build_cuda_device(uint8_t*, int32_t*, int, int, const int32_t*, const int32_t*,
                                      const int32_t*, void*) {
  return no_cuda("sample_state_build_cuda_device");
}
Status argmax_cuda_device(DType, const void*, size_t, size_t, int32_t*, void*) {
  return no_cuda("argmax_cuda_device");
}
Status matmul_own_cuda_device(const MatmulArgs& a, void*) {
  SPARK_TRY(matmul_check_args(a));
  return no_cuda("matmul_own_cuda_device");
}
Status matmul_own_group_cuda_device(const MatmulArgs* parts, int n_parts, void*, OwnVariant) {
  for (int i = 0; i < n_parts; ++i) SPARK_TRY(matmul_check_args(parts[i]));
  return no_cuda("matmul_own_group_cuda_device");
}
Status matmul_own_mma_cuda_device(const MatmulArgs* parts, int n_parts, void*, int, int) {
  for (int i = 0; i < n_parts; ++i) SPARK_TRY(matmul_check_args(parts[i]));
  return no_cuda("matmul_own_mma_cuda_device");
}
bool matmul_qkv_rope_head_norms(size_t, size_t) {
  return false;
}
Status matmul_qkv_rope_cuda_device(const MatmulArgs* parts, const RopeArgs& rope, void*,
                                   OwnVariant) {
  for (int i = 0; i < 3; ++i) SPARK_TRY(matmul_check_args(parts[i]));
  SPARK_TRY(rope_check_args(rope));
  return no_cuda("matmul_qkv_rope_cuda_device");
}

struct Matmul::Impl {
  std::string path;
};
Matmul::Matmul(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Matmul::~Matmul() = default;
Result<std::unique_ptr<Matmul>> Matmul::create(size_t) {
  return no_cuda("Matmul::create");
}
Status Matmul::run(const MatmulArgs& a, void*) {
  SPARK_TRY(matmul_check_args(a));
  return no_cuda("Matmul::run");
}
Status Matmul::run_fp8(const Fp8TcArgs& a, void*) {
  SPARK_TRY(fp8_tc_check(a));
  return no_cuda("Matmul::run_fp8");
}
const std::string& Matmul::library_path() const {
  return impl_->path;
}

Status moe_route_cuda_device(const float*, const float*, const MoeRouteArgs&, size_t, int32_t*,
                             float*, void*) {
  return no_cuda("moe_route_cuda_device");
}
Status moe_experts_cuda_device(const MoeExpertsArgs&, void*) {
  return no_cuda("moe_experts_cuda_device");
}
int moe_mma_pass_rows(const MoeExpertsArgs&) {
  return 0;
}
int moe_experts_kernels(const MoeExpertsArgs&) {
  return 0;
}

Status row_sumsq_cuda_device(const void*, size_t, size_t, float*, void*) {
  return no_cuda("row_sumsq_cuda_device");
}
Status rows_rms_scale_cuda_device(void*, const void*, const float*, size_t, size_t, float, float,
                                  void*) {
  return no_cuda("rows_rms_scale_cuda_device");
}

Status fp8_gemv_cuda_device(const Fp8MatmulArgs& a, void*) {
  SPARK_TRY(fp8_matmul_check(a));
  return no_cuda("fp8_gemv_cuda_device");
}
Status fp8_gemv_group_cuda_device(const Fp8MatmulArgs* parts, int n, void*) {
  for (int i = 0; i < n; ++i) SPARK_TRY(fp8_matmul_check(parts[i]));
  return no_cuda("fp8_gemv_group_cuda_device");
}
Status fp8_qkv_rope_cuda_device(const Fp8MatmulArgs* parts, const RopeArgs& rope, void*) {
  for (int i = 0; i < 3; ++i) SPARK_TRY(fp8_matmul_check(parts[i]));
  SPARK_TRY(rope_check_args(rope));
  return no_cuda("fp8_qkv_rope_cuda_device");
}
Status fp8_quantize_rows_cuda_device(const void* a, size_t lda, size_t m, size_t k,
                                     const Fp8Rows& out, void*) {
  SPARK_TRY(fp8_quantize_rows_check(a, lda, m, k, out));
  return no_cuda("fp8_quantize_rows_cuda_device");
}
Status fp8_dequantize_cuda_device(const Fp8Weight& w, size_t row0, size_t rows, size_t k, void* out,
                                  size_t ldo, void*) {
  SPARK_TRY(fp8_dequantize_check(w, row0, rows, k, out, ldo));
  return no_cuda("fp8_dequantize_cuda_device");
}

Status fill_random_cuda_device(void*, DType, size_t, uint64_t, float, float, void*) {
  return no_cuda("fill_random_cuda_device");
}

}  // namespace spark::kernels

#endif
