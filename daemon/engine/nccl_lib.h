#pragma once
// libnccl.so.2, opened at run time with dlopen so that sparkd and sparkctl start on machines
// without NCCL (they then say why NCCL is not usable). Only the calls the engine and the
// fabric self-test need are resolved; the few NCCL types they use are declared here with
// NCCL's ABI (ncclUniqueId is 128 bytes, a communicator an opaque pointer, results and
// data types ints), so no NCCL header is needed at build time.
#include <cstddef>
#include <string>

#include "core/error.h"

namespace spark::engine::nccl {

using Result_t = int;  // ncclResult_t
constexpr Result_t kSuccess = 0;
constexpr Result_t kUnhandledCudaError = 1;
constexpr Result_t kSystemError = 2;
constexpr Result_t kInternalError = 3;
constexpr Result_t kInvalidArgument = 4;
constexpr Result_t kInvalidUsage = 5;
constexpr Result_t kRemoteError = 6;
constexpr Result_t kInProgress = 7;

using Comm = struct OpaqueComm*;  // ncclComm_t
struct UniqueId {
  char internal[128];
};
// ncclDataType_t values.
constexpr int kFloat16 = 6;
constexpr int kFloat32 = 7;
constexpr int kBfloat16 = 9;
constexpr int kSum = 0;  // ncclRedOp_t

/// The leading fields of ncclConfig_t as of NCCL 2.14 (the first release with it). NCCL reads
/// a config by its size and version, so an older, shorter one is valid on newer releases.
struct Config {
  size_t size = sizeof(Config);
  unsigned magic = 0xcafebeef;
  unsigned version = 21400;
  int blocking = kUndefInt;
  int cga_cluster_size = kUndefInt;
  int min_ctas = kUndefInt;
  int max_ctas = kUndefInt;
  const char* net_name = nullptr;  // NCCL_CONFIG_UNDEF_PTR
  static constexpr int kUndefInt = -2147483647 - 1;
};

/// The resolved entry points (NCCL's own names and signatures).
struct Lib {
  std::string path;  // the file the loader opened
  int version = 0;   // ncclGetVersion, e.g. 22809
  Result_t (*GetVersion)(int*) = nullptr;
  Result_t (*GetUniqueId)(UniqueId*) = nullptr;
  Result_t (*CommInitRank)(Comm*, int nranks, UniqueId, int rank) = nullptr;
  Result_t (*CommInitRankConfig)(Comm*, int nranks, UniqueId, int rank, Config*) = nullptr;
  Result_t (*CommGetAsyncError)(Comm, Result_t*) = nullptr;
  Result_t (*CommAbort)(Comm) = nullptr;
  Result_t (*CommDestroy)(Comm) = nullptr;
  Result_t (*CommCount)(Comm, int*) = nullptr;
  Result_t (*CommUserRank)(Comm, int*) = nullptr;
  Result_t (*AllReduce)(const void*, void*, size_t, int dtype, int op, Comm,
                        void* stream) = nullptr;
  Result_t (*AllGather)(const void*, void*, size_t, int dtype, Comm, void* stream) = nullptr;
  Result_t (*Broadcast)(const void*, void*, size_t, int dtype, int root, Comm,
                        void* stream) = nullptr;
  Result_t (*GroupStart)() = nullptr;
  Result_t (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(Result_t) = nullptr;
  const char* (*GetLastError)(Comm) = nullptr;

  /// "ncclRemoteError (remote process exited or there was a network error): <last error>".
  std::string describe(Result_t r, Comm c = nullptr) const;
};

/// The library sparkd opens: $SPARK_NCCL_LIBRARY when set (a path or a soname), otherwise
/// libnccl.so.2 through the loader's search path.
std::string default_library();

/// Opens `library` once per process and path (later calls return the same Lib) and resolves
/// every entry point. Errc::unsupported naming the library, the missing symbol or the
/// loader's message and the fix (install NCCL, LD_LIBRARY_PATH, an NCCL older than 2.14).
Result<const Lib*> load(const std::string& library = default_library());

/// NCCL's name for a result code ("ncclSuccess", "ncclRemoteError", ...).
const char* result_name(Result_t r);

}  // namespace spark::engine::nccl
