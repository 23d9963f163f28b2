#include "daemon/engine/nccl_lib.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

namespace spark::engine::nccl {

namespace {

std::string loaded_path(void* h) {
  link_map* lm = nullptr;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && *lm->l_name) return lm->l_name;
  return {};
}

template <typename F>
bool resolve(void* h, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(h, name));
  return *out != nullptr;
}

Result<Lib> open_lib(const std::string& library) {
  dlerror();
  void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    return make_error(Errc::unsupported,
                      fmt::format("NCCL is not usable: {} could not be loaded: {}; install NCCL "
                                  "(libnccl2, or the CUDA toolkit's copy under "
                                  "/usr/local/cuda/lib64) and add its directory to "
                                  "LD_LIBRARY_PATH, or set SPARK_NCCL_LIBRARY to the file",
                                  library, e ? e : "unknown error"));
  }
  Lib l;
  l.path = loaded_path(h);
  if (l.path.empty()) l.path = library;
  struct Sym {
    const char* name;
    void** slot;
  };
  // The order is the order of the struct; every one is required.
  const Sym syms[] = {
      {"ncclGetVersion", reinterpret_cast<void**>(&l.GetVersion)},
      {"ncclGetUniqueId", reinterpret_cast<void**>(&l.GetUniqueId)},
      {"ncclCommInitRank", reinterpret_cast<void**>(&l.CommInitRank)},
      {"ncclCommInitRankConfig", reinterpret_cast<void**>(&l.CommInitRankConfig)},
      {"ncclCommGetAsyncError", reinterpret_cast<void**>(&l.CommGetAsyncError)},
      {"ncclCommAbort", reinterpret_cast<void**>(&l.CommAbort)},
      {"ncclCommDestroy", reinterpret_cast<void**>(&l.CommDestroy)},
      {"ncclCommCount", reinterpret_cast<void**>(&l.CommCount)},
      {"ncclCommUserRank", reinterpret_cast<void**>(&l.CommUserRank)},
      {"ncclAllReduce", reinterpret_cast<void**>(&l.AllReduce)},
      {"ncclAllGather", reinterpret_cast<void**>(&l.AllGather)},
      {"ncclBroadcast", reinterpret_cast<void**>(&l.Broadcast)},
      {"ncclGroupStart", reinterpret_cast<void**>(&l.GroupStart)},
      {"ncclGroupEnd", reinterpret_cast<void**>(&l.GroupEnd)},
      {"ncclGetErrorString", reinterpret_cast<void**>(&l.GetErrorString)},
      {"ncclGetLastError", reinterpret_cast<void**>(&l.GetLastError)},
  };
  for (const auto& s : syms) {
    if (!resolve(h, s.name, s.slot)) {
      dlclose(h);
      return make_error(Errc::unsupported,
                        fmt::format("NCCL is not usable: {} has no {} (NCCL 2.14 or newer is "
                                    "needed, or this is not an NCCL library)",
                                    l.path, s.name));
    }
  }
  if (Result_t r = l.GetVersion(&l.version); r != kSuccess) {
    dlclose(h);
    return make_error(
        Errc::unsupported,
        fmt::format("NCCL is not usable: ncclGetVersion in {} failed: {}", l.path, result_name(r)));
  }
  if (l.version < 21400) {
    dlclose(h);
    return make_error(Errc::unsupported,
                      fmt::format("NCCL is not usable: {} is NCCL {}, older than 2.14 (no "
                                  "non-blocking init, so its waits cannot have deadlines); "
                                  "install a newer NCCL",
                                  l.path, l.version));
  }
  return l;  // the handle stays open for the process's lifetime (entry points point into it)
}

}  // namespace

const char* result_name(Result_t r) {
  switch (r) {
    case kSuccess:
      return "ncclSuccess";
    case kUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case kSystemError:
      return "ncclSystemError";
    case kInternalError:
      return "ncclInternalError";
    case kInvalidArgument:
      return "ncclInvalidArgument";
    case kInvalidUsage:
      return "ncclInvalidUsage";
    case kRemoteError:
      return "ncclRemoteError";
    case kInProgress:
      return "ncclInProgress";
    default:
      return "ncclResult(unknown)";
  }
}

std::string Lib::describe(Result_t r, Comm c) const {
  std::string s = result_name(r);
  if (GetErrorString)
    if (const char* e = GetErrorString(r); e && *e) s += fmt::format(" ({})", e);
  if (GetLastError)
    if (const char* e = GetLastError(c); e && *e) s += fmt::format(": {}", e);
  return s;
}

std::string default_library() {
  const char* e = std::getenv("SPARK_NCCL_LIBRARY");
  return e && *e ? e : "libnccl.so.2";
}

Result<const Lib*> load(const std::string& library) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Lib>> libs;
  std::lock_guard lk(mu);
  if (auto it = libs.find(library); it != libs.end()) return it->second.get();
  auto l = open_lib(library);
  if (!l) return l.error();
  auto& slot = libs[library];
  slot = std::make_unique<Lib>(std::move(*l));
  return slot.get();
}

}  // namespace spark::engine::nccl
