#pragma once
// How a checkpoint stores its weight matrices: plain (F32/BF16/F16, as torch_dtype says) or
// FP8 with block scales, as DeepSeek-V3, Qwen3-*-FP8, GLM-4.5-FP8 and MiniMax-M2 publish
// them. config.json's `quantization_config` says which: `quant_method: fp8`, `fmt: e4m3`,
// `weight_block_size: [128, 128]`, `activation_scheme: dynamic`, optionally `scale_fmt`
// (`ue8m0`: the scales are powers of two) and `modules_to_not_convert` / `ignored_layers`
// (modules left in the plain type). Each FP8 matrix `X.weight` ([N][K], F8_E4M3) comes with
// `X.weight_scale_inv` ([ceil(N/128)][ceil(K/128)], F32 or BF16): element (n, k) is
// fp8(n, k) x scale_inv[n / 128][k / 128]. Anything else the engine does not run (another
// method, block size or element format, per-tensor scales, static activation scales) is
// refused at load naming the field and its value.
//
// The loader reads each FP8 slice as stored together with the scale blocks it covers, and
// either keeps it so (a device that keeps FP8: Device::keeps_fp8, kernels/fp8.h) or widens
// it on the host, chunk by chunk through the staging buffer, into the device's compute type:
// exact, with no full-size float copy of a tensor at any point of the load.
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json_text.h"

namespace spark::engine {

struct WeightFormat {
  /// mxfp4: gpt-oss's experts as OpenAI publishes them (`X_blocks`: two e2m1 values a byte,
  /// low nibble first, 32 values a block; `X_scales`: one e8m0 byte a block, 2^(s - 127)).
  enum class Kind : uint8_t { plain, fp8_block, mxfp4 };
  Kind kind = Kind::plain;
  int block_n = 0, block_k = 0;            // FP8: the scale block (rows, columns of [N][K])
  bool ue8m0_scales = false;               // scale_fmt "ue8m0": every scale a power of two
  std::vector<std::string> not_converted;  // modules kept plain (names or name patterns)
  bool fp8() const { return kind == Kind::fp8_block; }
  bool mxfp4() const { return kind == Kind::mxfp4; }
  /// "bf16" style plain name is the caller's; this says "fp8 e4m3, 128x128 block scales".
  std::string describe() const;
  /// True when module `tensor` (a weight's full name) is listed as not converted: an entry
  /// matches the tensor's module path or a prefix of it at a dot; `*` matches one name part.
  bool is_not_converted(const std::string& tensor) const;
};

/// Reads `quantization_config` of config.json (`raw`: the whole file; a missing or null
/// field means plain weights). `where` names the file.
Result<WeightFormat> parse_weight_format(const nlohmann::json& raw, const std::string& where);

/// The e4m3 (OCP "fn": no infinities, 0x7f/0xff NaN, largest 448) value of `v`.
float fp8_e4m3_to_float(uint8_t v);
/// Round-to-nearest-even float to e4m3, saturating at +-448 (NaN stays NaN); for writing
/// test checkpoints.
uint8_t float_to_fp8_e4m3(float f);

/// The value of e2m1 code `c` (0..15).
float e2m1_to_float(uint8_t c);
/// Widens `rows` MXFP4 rows: row r's blocks start at blocks + r * row_bytes and its scales at
/// scales + r * row_scales; value columns [col0, col0 + cols) go to out + r * cols. False
/// when a scale the columns use is 0xff (e8m0's NaN).
bool widen_mxfp4(const uint8_t* blocks, int64_t row_bytes, const uint8_t* scales,
                 int64_t row_scales, int64_t rows, int64_t col0, int64_t cols, float* out);

/// The scale tensor's name for an FP8 weight ("X.weight" -> "X.weight_scale_inv").
std::string fp8_scale_name(const std::string& weight);

/// Widens `rows` x `cols` e4m3 values `q` (row-major), the slice of a [N][K] weight that
/// starts at (row0, col0), into `out` (floats): out = fp8 x scales[(row0 + r) / block_n -
/// scale_row0][(col0 + c) / block_k], where `scales` holds the scale rows from scale_row0 on,
/// `scale_cols` wide.
void widen_fp8_block(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                     const float* scales, int64_t scale_row0, int64_t scale_cols, int block_n,
                     int block_k, float* out);

}  // namespace spark::engine
