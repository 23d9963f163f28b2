// libFuzzer target: the safetensors header parser (daemon/engine/safetensors.h). The input
// is a whole file's first bytes; the file size is the input size plus a fuzzed tail length
// so offsets past the end are exercised without allocating the tail.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "daemon/engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint64_t tail = data[0] * 1024ull;  // pretend the file continues this far
  std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  auto h = spark::engine::parse_safetensors_header(bytes, bytes.size() + tail, "fuzz");
  if (h.ok()) {
    // Invariants the reader relies on.
    uint64_t prev_end = 0;
    for (const auto& t : h->tensors) {
      if (t.begin < h->data_start || t.end < t.begin || t.end > bytes.size() + tail)
        __builtin_trap();
      if (t.begin < prev_end) __builtin_trap();
      if (t.end - t.begin != static_cast<uint64_t>(t.numel()) * spark::engine::dtype_size(t.dtype))
        __builtin_trap();
      prev_end = t.end;
    }
  }
  return 0;
}
