#pragma once
// One rank's engine, ready for sparkd's `native` backend: loads this rank's slices of the
// model, joins the tensor-parallel mesh (Gloo over TCP through the ring's store, sparkd's
// rendezvous; without one rank 0 serves a TCP store and publishes its address through the
// `share` function), optionally connects NCCL for the data plane (the unique id through the
// same store) and runs the fabric self-test, then rank 0 runs the
// Engine (the HTTP layer submits to engine()) and the other ranks run the TP worker loop
// on a thread of their own. Each rank loads its weights first and then joins the mesh, so a
// slow loader delays the join (bounded by rendezvous_timeout_ms) instead of timing out a
// collective. status() is cheap and thread-safe.
//
// The backend adapter is then a few lines:
//   start(ctx): RuntimeOptions o{model_dir, rank, world, fabric_ip, ...};
//               o.share = ctx.share; o.progress = ctx.progress; rt = Runtime::start(o);
//   status():   auto s = rt->status(); -> BackendStatus{s.ready, s.fatal, s.reason, ...}
//   stop():     rt->stop();
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "daemon/engine/engine.h"
#include "daemon/engine/fabric_test.h"
#include "daemon/engine/nccl_collective.h"
#include "daemon/engine/rendezvous_store.h"
#include "daemon/engine/tcp_store.h"

namespace spark::engine {

struct RuntimeOptions {
  std::string model_dir;
  int rank = 0;
  int world = 1;
  std::string bind_host = "127.0.0.1";  // this rank's address for Gloo traffic (fabric IP)
  std::string store_host;               // rank 0's address for the store; default bind_host
  int store_port = 0;                   // 0: rank 0 picks a free port and shares it
  /// Exchanges a value through the ring's rendezvous (rank 0 publishes value_if_rank0, the
  /// others receive it). Needed when world > 1 and store_port is 0.
  std::function<Result<std::string>(const std::string& key, const std::string& value_if_rank0)>
      share;
  /// The ring's one store (sparkd: its rendezvous). When set, Gloo's mesh and the NCCL
  /// unique id meet through it and rank 0 starts no TCP store of its own.
  std::shared_ptr<RendezvousStore> store;
  /// Names the ranks the daemon's heartbeats find missing, for the message of a collective
  /// that failed or timed out (Gloo and NCCL); optional.
  std::function<std::string()> missing_ranks;
  /// Data plane over NCCL (the device calls, the fabric self-test) with the control plane on
  /// Gloo (LocalCollective for one rank); false: Gloo alone (CUDA ranks then stage their
  /// device collectives through page-locked host memory, HostStagedCollective: eager decode
  /// steps, and several ranks may share one GPU).
  bool nccl = false;
  NcclOptions nccl_options;  // rank/world are filled from rank/world
  /// The fabric self-test (NCCL only) runs after the connect and before the engine starts;
  /// a failed test fails start() with its reasons.
  bool fabric_test = true;
  FabricOptions fabric;
  FabricExpect fabric_expect;   // rank/world are filled from rank/world
  std::string nccl_debug_file;  // NCCL_DEBUG_FILE, parsed for the transports; "" none
  std::function<void(const std::string&)> progress;  // "loading weights", ...
  /// When set and true, a load in progress stops at the next tensor.
  const std::atomic<bool>* cancel = nullptr;
  EngineOptions engine;
  std::string device = "cpu";              // DEVICE: auto | cpu | cuda
  std::string weights_placement = "auto";  // WEIGHTS_PLACEMENT: auto | device | host-mapped
  std::string expert_parallel = "auto";    // EXPERT_PARALLEL: auto | tp | ep
  std::string proc_root = "/";             // /proc/meminfo is read under it (tests: a fixture)
  int device_ordinal = 0;  // which CUDA device (of those CUDA_VISIBLE_DEVICES shows)
  bool warmup =
      true;  // rank 0 runs one real 1-token completion through every rank before start() returns
  int timeout_ms = 30000;              // each collective operation
  int rendezvous_timeout_ms = 600000;  // waiting for the other ranks to load and join
};

struct RuntimeStatus {
  bool ready = false;
  bool fatal = false;
  std::string reason;           // why not ready / why fatal
  EngineStats stats;            // rank 0
  std::string device;           // what serves this rank (DeviceInfo::name)
  std::string device_kind;      // "cpu" / "cuda"
  std::string device_fallback;  // DEVICE=auto chose the CPU: why
  /// What the rank serves, for /health and `sparkctl status`: architecture, layers, weight
  /// format, experts (count, per token, active parameters, how they are split and why).
  nlohmann::json model;
};

/// What one rank's KV cache comes out of: `pool` names the memory (a discrete GPU: its host
/// and GPU; unified memory and the CPU: its host), `available` what that memory has free.
struct RankMemory {
  std::string pool;
  uint64_t available = 0;
};

/// The KV sizing of a ring: ranks whose pools are the same split what is free there, and
/// every rank holds the same number of blocks, so the ring sizes from its tightest rank.
struct KvMemoryPlan {
  uint64_t available = 0;  // what the tightest rank's pool has free
  int share = 1;           // ranks whose KV comes out of that pool
  int rank = 0;            // the tightest rank
  std::string pool;
};

/// The plan for `ranks` (index = rank) with `reserve` kept free per pool: the rank whose
/// (available - reserve) / share is smallest.
KvMemoryPlan plan_kv_memory(const std::vector<RankMemory>& ranks, uint64_t reserve);

/// The pool name of `info` on this machine ("boot:<kernel boot id>", plus "/<GPU uuid>" for
/// a discrete GPU's own memory).
std::string memory_pool_of(const DeviceInfo& info);

/// Publishes this rank's fabric self-test report under "engine.fabric.rank<R>" in the
/// ring's store; rank 0 then collects every rank's (waiting up to `timeout` for each) and
/// returns them in rank order, leaving out (with a warning) one that did not arrive or does
/// not parse. Other ranks get an empty list.
std::vector<FabricReport> exchange_fabric_reports(RendezvousStore& store, const FabricReport& mine,
                                                  int rank, int world,
                                                  std::chrono::milliseconds timeout);

class Runtime {
 public:
  /// Blocks until this rank is loaded and connected (or fails with the reason).
  static Result<std::unique_ptr<Runtime>> start(RuntimeOptions opts);
  ~Runtime();
  /// Rank 0's engine (nullptr on other ranks).
  Engine* engine() { return engine_.get(); }
  RuntimeStatus status() const;
  /// Rank 0 stops the engine (which releases the workers); workers wait for that.
  void stop();
  const LoadReport& load_report() const { return load_; }
  /// How the ring sized its KV caches (world > 1: exchanged at start; else this rank alone).
  const KvMemoryPlan& kv_memory_plan() const { return kv_plan_; }
  /// The fabric self-test's report (nullptr when it did not run).
  const FabricReport* fabric_report() const { return fabric_ ? &*fabric_ : nullptr; }
  /// Rank 0: every rank's self-test report, in rank order (each rank publishes its own
  /// through the ring's store right after the test); empty when the test did not run or the
  /// ring has no store. A rank whose report did not arrive is missing from the list.
  const std::vector<FabricReport>& fabric_reports() const { return fabric_all_; }
  /// Aborts the NCCL communicator (when there is one): a collective in flight fails at once
  /// with `why`. Thread-safe; for the daemon when its heartbeats find a rank gone.
  void abort_collectives(const std::string& why);

 private:
  Runtime() = default;
  Status connect_nccl(const RuntimeOptions& o,
                      const std::function<void(const std::string&)>& progress);
  RuntimeOptions opts_;
  LoadReport load_;
  KvMemoryPlan kv_plan_;
  std::shared_ptr<TcpStoreServer> store_;  // rank 0, when it picked the port
  std::shared_ptr<Collective> comm_;
  std::shared_ptr<NcclCollective> nccl_;
  std::optional<FabricReport> fabric_;
  std::vector<FabricReport> fabric_all_;
  std::string device_, device_kind_, device_fallback_;
  nlohmann::json model_info_;
  std::unique_ptr<Model> worker_model_;
  std::unique_ptr<Engine> engine_;
  std::thread worker_;
  mutable std::mutex mu_;
  std::string worker_error_;
  std::atomic<bool> worker_done_{false};
};

}  // namespace spark::engine
