// FAULT INJECTION ONLY: a stand-in for libnccl.so.2 that fails in chosen ways, so that the
// NCCL collective's deadlines and aborts are tested: SPARK_FAULT_NCCL selects the fault,
//   init_fail            ncclCommInitRankConfig fails (ncclSystemError)
//   init_hang            init stays ncclInProgress until the communicator is aborted
//   async_error:N        after N collectives ncclCommGetAsyncError reports ncclRemoteError
//   collective_hang:N    the Nth collective (1-based) never completes: it enqueues a host
//                        function on the stream that returns only after ncclCommAbort
// (empty: no fault). With SPARK_FAULT_NCCL_REAL naming the real libnccl.so.2 everything
// else is passed through to it, so the faults strike a working one-GPU communicator;
// without it the library stands alone (a one-rank communicator whose collectives do
// nothing), which is enough for the faults that need no device.
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

using Res = int;
constexpr Res kSuccess = 0, kSystemError = 2, kInvalidUsage = 5, kRemoteError = 6, kInProgress = 7;
struct Id {
  char internal[128];
};
using Comm = void*;

enum class Mode { none, init_fail, init_hang, async_error, collective_hang };

struct State {
  Mode mode = Mode::none;
  long n = 0;
  void* real = nullptr;
  std::atomic<long> collectives{0};
  std::atomic<bool> aborted{false};
  std::string last_error;
};

void set_mode(State* st, const std::string& m) {
  auto colon = m.find(':');
  std::string name = m.substr(0, colon);
  st->mode = Mode::none;
  st->n = colon != std::string::npos ? std::strtol(m.c_str() + colon + 1, nullptr, 10) : 0;
  if (name == "init_fail") st->mode = Mode::init_fail;
  if (name == "init_hang") st->mode = Mode::init_hang;
  if (name == "async_error") st->mode = Mode::async_error;
  if (name == "collective_hang") st->mode = Mode::collective_hang;
  st->collectives = 0;
  st->aborted = false;
  st->last_error.clear();
}

State& state() {
  static State* s = [] {
    auto* st = new State();
    set_mode(st, std::getenv("SPARK_FAULT_NCCL") ? std::getenv("SPARK_FAULT_NCCL") : "");
    if (const char* r = std::getenv("SPARK_FAULT_NCCL_REAL"); r && *r)
      st->real = dlopen(r, RTLD_NOW | RTLD_LOCAL);
    return st;
  }();
  return *s;
}

template <typename F>
F real(const char* name) {
  void* h = state().real;
  return h ? reinterpret_cast<F>(dlsym(h, name)) : nullptr;
}

// The one communicator this library hands out when it stands alone, or while init hangs.
char g_fake_comm;
Comm fake() {
  return &g_fake_comm;
}

// Blocks the stream until the communicator is aborted (bounded at 10 minutes: nothing in a
// test waits forever even if the code under test never aborts).
void hold_stream(void*) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  while (!state().aborted && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

Res count_collective(void* stream) {
  State& s = state();
  long k = ++s.collectives;
  if (s.mode == Mode::collective_hang && k == s.n) {
    using LaunchHostFunc = int (*)(void*, void (*)(void*), void*);
    static void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    auto launch =
        cuda ? reinterpret_cast<LaunchHostFunc>(dlsym(cuda, "cuLaunchHostFunc")) : nullptr;
    if (!launch || launch(stream, hold_stream, nullptr) != 0) {
      s.last_error = "fault injection: cuLaunchHostFunc is not available";
      return kSystemError;
    }
  }
  return kSuccess;
}

}  // namespace

extern "C" {

/// Selects the fault as SPARK_FAULT_NCCL does and starts counting afresh (for a test process
/// that tries several faults one after another).
void spark_fault_nccl_set(const char* mode) {
  set_mode(&state(), mode ? mode : "");
}

Res ncclGetVersion(int* v) {
  if (auto f = real<Res (*)(int*)>("ncclGetVersion")) return f(v);
  *v = 22809;
  return kSuccess;
}

Res ncclGetUniqueId(Id* id) {
  if (auto f = real<Res (*)(Id*)>("ncclGetUniqueId")) return f(id);
  std::memset(id->internal, 0x5a, sizeof(id->internal));
  return kSuccess;
}

Res ncclCommInitRank(Comm* comm, int nranks, Id id, int rank) {
  if (auto f = real<Res (*)(Comm*, int, Id, int)>("ncclCommInitRank"))
    return f(comm, nranks, id, rank);
  *comm = fake();
  return kSuccess;
}

Res ncclCommInitRankConfig(Comm* comm, int nranks, Id id, int rank, void* config) {
  State& s = state();
  if (s.mode == Mode::init_fail) {
    s.last_error = "fault injection: ncclCommInitRankConfig fails";
    *comm = nullptr;
    return kSystemError;
  }
  if (s.mode == Mode::init_hang) {
    *comm = fake();
    return kInProgress;
  }
  if (auto f = real<Res (*)(Comm*, int, Id, int, void*)>("ncclCommInitRankConfig"))
    return f(comm, nranks, id, rank, config);
  if (nranks != 1) {
    s.last_error = "fault injection: standing alone, only a one-rank communicator";
    return kInvalidUsage;
  }
  *comm = fake();
  return kSuccess;
}

Res ncclCommGetAsyncError(Comm comm, Res* out) {
  State& s = state();
  if (s.aborted) {
    *out = kSystemError;
    return kSuccess;
  }
  if (s.mode == Mode::init_hang) {
    *out = kInProgress;
    return kSuccess;
  }
  if (s.mode == Mode::async_error && s.collectives >= s.n) {
    s.last_error = "fault injection: remote process exited";
    *out = kRemoteError;
    return kSuccess;
  }
  if (comm != fake())
    if (auto f = real<Res (*)(Comm, Res*)>("ncclCommGetAsyncError")) return f(comm, out);
  *out = kSuccess;
  return kSuccess;
}

Res ncclCommAbort(Comm comm) {
  state().aborted = true;
  if (comm != fake())
    if (auto f = real<Res (*)(Comm)>("ncclCommAbort")) return f(comm);
  return kSuccess;
}

Res ncclCommDestroy(Comm comm) {
  if (comm != fake())
    if (auto f = real<Res (*)(Comm)>("ncclCommDestroy")) return f(comm);
  return kSuccess;
}

Res ncclCommCount(Comm comm, int* n) {
  if (comm != fake())
    if (auto f = real<Res (*)(Comm, int*)>("ncclCommCount")) return f(comm, n);
  *n = 1;
  return kSuccess;
}

Res ncclCommUserRank(Comm comm, int* r) {
  if (comm != fake())
    if (auto f = real<Res (*)(Comm, int*)>("ncclCommUserRank")) return f(comm, r);
  *r = 0;
  return kSuccess;
}

Res ncclAllReduce(const void* in, void* out, size_t n, int t, int op, Comm comm, void* stream) {
  if (comm != fake())
    if (auto f = real<Res (*)(const void*, void*, size_t, int, int, Comm, void*)>("ncclAllReduce"))
      if (Res r = f(in, out, n, t, op, comm, stream); r != kSuccess) return r;
  return count_collective(stream);
}

Res ncclAllGather(const void* in, void* out, size_t n, int t, Comm comm, void* stream) {
  if (comm != fake())
    if (auto f = real<Res (*)(const void*, void*, size_t, int, Comm, void*)>("ncclAllGather"))
      if (Res r = f(in, out, n, t, comm, stream); r != kSuccess) return r;
  return count_collective(stream);
}

Res ncclBroadcast(const void* in, void* out, size_t n, int t, int root, Comm comm, void* stream) {
  if (comm != fake())
    if (auto f = real<Res (*)(const void*, void*, size_t, int, int, Comm, void*)>("ncclBroadcast"))
      if (Res r = f(in, out, n, t, root, comm, stream); r != kSuccess) return r;
  return count_collective(stream);
}

Res ncclGroupStart() {
  if (auto f = real<Res (*)()>("ncclGroupStart")) return f();
  return kSuccess;
}

Res ncclGroupEnd() {
  if (auto f = real<Res (*)()>("ncclGroupEnd")) return f();
  return kSuccess;
}

const char* ncclGetErrorString(Res r) {
  if (auto f = real<const char* (*)(Res)>("ncclGetErrorString")) return f(r);
  return r == kSuccess ? "no error" : "fault injection error";
}

const char* ncclGetLastError(Comm comm) {
  if (!state().last_error.empty()) return state().last_error.c_str();
  if (auto f = real<const char* (*)(Comm)>("ncclGetLastError")) return f(comm);
  return "";
}

}  // extern "C"
