#include "daemon/engine/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace spark::engine {

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::f32:
    case ElemType::i32:
      return 4;
    case ElemType::bf16:
      return 2;
  }
  return 4;
}

const char* elem_name(ElemType t) {
  switch (t) {
    case ElemType::f32:
      return "fp32";
    case ElemType::bf16:
      return "bf16";
    case ElemType::i32:
      return "i32";
  }
  return "?";
}

Buffer Buffer::view(size_t offset, size_t n) const {
  offset = std::min(offset, numel_);
  n = std::min(n, numel_ - offset);
  return Buffer(owner_, static_cast<char*>(data_) + offset * elem_size(type_), n, type_);
}

Result<uint64_t> host_mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream ss(line.substr(13));
    uint64_t kb = 0;
    if (ss >> kb) return kb * 1024;
  }
  return make_error(Errc::io, "/proc/meminfo: no MemAvailable line");
}

}  // namespace spark::engine
