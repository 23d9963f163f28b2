#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "kernels/embedding.h"

namespace spark::kernels {

void embedding_ref(const float* table, size_t vocab, size_t dim, const int32_t* ids, size_t n,
                   float* out) {
  for (size_t t = 0; t < n; ++t) {
    float* o = out + t * dim;
    if (ids[t] < 0 || static_cast<size_t>(ids[t]) >= vocab) {
      std::fill(o, o + dim, 0.f);
      continue;
    }
    const float* row = table + static_cast<size_t>(ids[t]) * dim;
    std::copy(row, row + dim, o);
  }
}

Status embedding_check_args(const void* table, size_t vocab, size_t dim, const int32_t* ids,
                            size_t n, const void* out) {
  if (dim == 0) return make_error(Errc::usage, "embedding: dim must be > 0");
  if (vocab == 0) return make_error(Errc::usage, "embedding: vocab must be > 0");
  if (n > 0 && (!table || !ids || !out))
    return make_error(Errc::usage, fmt::format("embedding: null {} pointer", !table ? "table"
                                                                             : !ids ? "ids"
                                                                                    : "output"));
  if (n > std::numeric_limits<size_t>::max() / 4 / dim)
    return make_error(Errc::resource,
                      fmt::format("embedding: {} rows x {} overflow the address space", n, dim));
  return Status::Ok();
}

}  // namespace spark::kernels
