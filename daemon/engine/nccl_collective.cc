#include "daemon/engine/nccl_collective.h"

#include <fmt/format.h>

#include <thread>

#include "core/log.h"
#include "kernels/device_copy.h"

namespace spark::engine {

namespace {
constexpr const char* kComp = "nccl";
constexpr const char* kIdKey = "engine.nccl_id";
constexpr auto kPoll = std::chrono::microseconds(200);

Result<int> nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return nccl::kFloat32;
    case DType::bf16:
      return nccl::kBfloat16;
    case DType::f16:
      return nccl::kFloat16;
    default:
      return make_error(Errc::unsupported,
                        fmt::format("NCCL collective: dtype {} is not reduced or gathered (f32, "
                                    "bf16 and f16 are)",
                                    dtype_name(t)));
  }
}

std::string seconds(std::chrono::milliseconds d) {
  return fmt::format("{:.1f} s", static_cast<double>(d.count()) / 1000.0);
}
}  // namespace

std::string nccl_id_to_hex(const nccl::UniqueId& id) {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  s.reserve(sizeof(id.internal) * 2);
  for (char c : id.internal) {
    auto b = static_cast<unsigned char>(c);
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

Result<nccl::UniqueId> nccl_id_from_hex(const std::string& hex) {
  nccl::UniqueId id{};
  if (hex.size() != sizeof(id.internal) * 2)
    return make_error(Errc::integrity,
                      fmt::format("NCCL unique id from the rendezvous has {} characters, not {}",
                                  hex.size(), sizeof(id.internal) * 2));
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return make_error(
          Errc::integrity,
          fmt::format("NCCL unique id from the rendezvous is not hex at offset {}", 2 * i));
    id.internal[i] = static_cast<char>(hi << 4 | lo);
  }
  return id;
}

Result<nccl::UniqueId> NcclCollective::new_unique_id(const std::string& library) {
  auto lib = nccl::load(library);
  if (!lib) return lib.error();
  nccl::UniqueId id{};
  if (nccl::Result_t r = (*lib)->GetUniqueId(&id); r != nccl::kSuccess)
    return make_error(Errc::network, "ncclGetUniqueId failed: " + (*lib)->describe(r) +
                                         " (check NCCL_SOCKET_IFNAME names an interface that "
                                         "holds this node's fabric address)");
  return id;
}

std::string NcclCollective::where() const {
  return fmt::format("rank {} of {}", opts_.rank, opts_.world);
}

Result<std::shared_ptr<NcclCollective>> NcclCollective::connect(const NcclOptions& opts,
                                                                const nccl::UniqueId& id,
                                                                std::shared_ptr<Collective> host) {
  if (!host) host = std::make_shared<LocalCollective>();
  if (host->rank() != opts.rank || host->world_size() != opts.world)
    return make_error(Errc::internal,
                      fmt::format("NCCL collective: rank {} of {}, but the host collective is "
                                  "rank {} of {}",
                                  opts.rank, opts.world, host->rank(), host->world_size()));
  auto lib = nccl::load(opts.library);
  if (!lib) return lib.error();
  std::shared_ptr<NcclCollective> c(new NcclCollective());
  c->opts_ = opts;
  c->lib_ = *lib;
  c->host_ = std::move(host);
  nccl::Config cfg;
  cfg.blocking = 0;  // init and enqueue return at once; every wait below has a deadline
  const auto t0 = std::chrono::steady_clock::now();
  nccl::Result_t r = c->lib_->CommInitRankConfig(&c->comm_, opts.world, id, opts.rank, &cfg);
  if (r != nccl::kSuccess && r != nccl::kInProgress) {
    std::string msg = fmt::format("ncclCommInitRankConfig failed on {} ({}): {}", c->where(),
                                  c->lib_->path, c->lib_->describe(r, c->comm_));
    if (c->comm_) c->lib_->CommAbort(c->comm_), c->comm_ = nullptr;
    return make_error(Errc::network, msg + " — the rank's log shows the NCCL_* it was given");
  }
  if (auto st = c->wait_in_progress("ncclCommInitRank", opts.init_timeout); !st.ok())
    return st.error();
  log::info(kComp, "{}: communicator up in {:.2f} s (NCCL {} from {})", c->where(),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            c->lib_->version, c->lib_->path);
  return c;
}

Result<std::shared_ptr<NcclCollective>> NcclCollective::connect_via(
    const NcclOptions& opts, const ShareFn& share, std::shared_ptr<Collective> host) {
  std::string mine;
  if (opts.rank == 0) {
    auto id = new_unique_id(opts.library);
    if (!id) return id.error();
    mine = nccl_id_to_hex(*id);
  }
  // A one-rank ring may pass no share function; a larger one must meet through one.
  if (!share && opts.world > 1)
    return make_error(Errc::internal, "NCCL collective: world > 1 without a rendezvous");
  std::string hex = mine;
  if (share) {
    auto got = share(kIdKey, mine);
    if (!got) return got.error();
    hex = *got;
  }
  auto id = nccl_id_from_hex(hex);
  if (!id) return id.error();
  return connect(opts, *id, std::move(host));
}

NcclCollective::~NcclCollective() {
  // Aborted, never destroyed: ncclCommDestroy can wait for peers that are gone, and at
  // teardown every rank leaves anyway.
  std::lock_guard lk(mu_);
  if (!aborted_.exchange(true) && comm_) lib_->CommAbort(comm_);
}

std::string NcclCollective::failure() const {
  std::lock_guard lk(mu_);
  return failure_;
}

void NcclCollective::abort(const std::string& why) {
  std::lock_guard lk(mu_);
  if (failure_.empty()) failure_ = why;
  if (!aborted_.exchange(true) && comm_) {
    log::warn(kComp, "{}: aborting the communicator: {}", where(), why);
    lib_->CommAbort(comm_);
  }
}

Error NcclCollective::aborted_error() const {
  return make_error(Errc::network,
                    fmt::format("NCCL communicator of {} was aborted: {}", where(), failure_));
}

Status NcclCollective::check_usable() const {
  std::lock_guard lk(mu_);
  if (!failure_.empty()) return aborted_error();
  return Status::Ok();
}

Result<nccl::Result_t> NcclCollective::poll_async_error() {
  std::lock_guard lk(mu_);
  if (!failure_.empty()) return aborted_error();
  nccl::Result_t a = nccl::kSuccess;
  nccl::Result_t r = lib_->CommGetAsyncError(comm_, &a);
  return r != nccl::kSuccess ? r : a;
}

std::string NcclCollective::describe(nccl::Result_t r) {
  std::lock_guard lk(mu_);
  return lib_->describe(r, aborted_ ? nullptr : comm_);
}

Status NcclCollective::fail(Errc code, const std::string& what) {
  std::string msg = fmt::format("{} on {}", what, where());
  if (opts_.missing_ranks)
    if (std::string m = opts_.missing_ranks(); !m.empty()) msg += "; " + m;
  abort(msg);
  return make_error(code, msg);
}

Status NcclCollective::wait_in_progress(const std::string& what,
                                        std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto a = poll_async_error();
    if (!a) return a.error();
    if (*a == nccl::kSuccess) return Status::Ok();
    if (*a != nccl::kInProgress)
      return fail(Errc::network, fmt::format("{} failed: {}", what, describe(*a)));
    if (std::chrono::steady_clock::now() >= deadline)
      return fail(Errc::timeout,
                  fmt::format("{} did not finish within {} (the communicator was aborted; a "
                              "rank that never joins, or NCCL_SOCKET_IFNAME/NCCL_IB_HCA pins "
                              "that do not reach the other nodes, look like this)",
                              what, seconds(timeout)));
    std::this_thread::sleep_for(kPoll);
  }
}

Status NcclCollective::all_reduce_sum(float* data, size_t n) {
  SPARK_TRY(check_usable());
  return host_->all_reduce_sum(data, n);
}
Status NcclCollective::broadcast(void* data, size_t bytes, int root) {
  SPARK_TRY(check_usable());
  return host_->broadcast(data, bytes, root);
}
Status NcclCollective::all_gather(const void* in, void* out, size_t bytes_per_rank) {
  SPARK_TRY(check_usable());
  return host_->all_gather(in, out, bytes_per_rank);
}
Status NcclCollective::barrier() {
  SPARK_TRY(check_usable());
  return host_->barrier();
}

Status NcclCollective::all_reduce_sum_device(void* data, size_t count, DType dtype, void* stream) {
  SPARK_TRY(check_usable());
  auto t = nccl_type(dtype);
  if (!t) return t.error();
  nccl::Result_t r = nccl::kSuccess;
  {
    std::lock_guard lk(mu_);
    if (!failure_.empty()) return aborted_error();
    r = lib_->AllReduce(data, data, count, *t, nccl::kSum, comm_, stream);
  }
  if (r == nccl::kInProgress) return wait_in_progress("ncclAllReduce (enqueue)", opts_.op_timeout);
  if (r != nccl::kSuccess) return fail(Errc::network, "ncclAllReduce failed: " + describe(r));
  return Status::Ok();
}

Status NcclCollective::all_gather_device(const void* in, void* out, size_t count_per_rank,
                                         DType dtype, void* stream) {
  SPARK_TRY(check_usable());
  auto t = nccl_type(dtype);
  if (!t) return t.error();
  nccl::Result_t r = nccl::kSuccess;
  {
    std::lock_guard lk(mu_);
    if (!failure_.empty()) return aborted_error();
    r = lib_->AllGather(in, out, count_per_rank, *t, comm_, stream);
  }
  if (r == nccl::kInProgress) return wait_in_progress("ncclAllGather (enqueue)", opts_.op_timeout);
  if (r != nccl::kSuccess) return fail(Errc::network, "ncclAllGather failed: " + describe(r));
  return Status::Ok();
}

Status NcclCollective::broadcast_device(void* data, size_t count, DType dtype, int root,
                                        void* stream) {
  SPARK_TRY(check_usable());
  auto t = nccl_type(dtype);
  if (!t) return t.error();
  nccl::Result_t r = nccl::kSuccess;
  {
    std::lock_guard lk(mu_);
    if (!failure_.empty()) return aborted_error();
    r = lib_->Broadcast(data, data, count, *t, root, comm_, stream);
  }
  if (r == nccl::kInProgress) return wait_in_progress("ncclBroadcast (enqueue)", opts_.op_timeout);
  if (r != nccl::kSuccess) return fail(Errc::network, "ncclBroadcast failed: " + describe(r));
  return Status::Ok();
}

Status NcclCollective::synchronize(void* stream, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) timeout = opts_.op_timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto a = poll_async_error();
    if (!a) return a.error();
    if (*a != nccl::kSuccess && *a != nccl::kInProgress)
      return fail(Errc::network, "NCCL reported an error while the step ran: " + describe(*a));
    auto done = kernels::stream_done(stream);
    if (!done) return fail(done.error().code, done.error().message);
    if (*done && *a == nccl::kSuccess) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline)
      return fail(Errc::timeout,
                  fmt::format("a collective did not complete within {} (the communicator was "
                              "aborted)",
                              seconds(timeout)));
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace spark::engine
