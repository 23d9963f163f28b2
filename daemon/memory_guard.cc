#include "daemon/memory_guard.h"

#include "core/log.h"
#include "core/strings.h"
#include "daemon/metrics.h"
#include "env/meminfo.h"

namespace spark::daemon {

namespace {
constexpr std::string_view kComp = "memguard";
}

MemGuardConfig mem_guard_config(const RingConfig& cfg) {
  MemGuardConfig c;
  if (!cfg.get("MEM_GUARD_WAIT").empty()) c.wait_floor = cfg.get_size("MEM_GUARD_WAIT");
  if (!cfg.get("MEM_GUARD_CANCEL").empty()) c.cancel_floor = cfg.get_size("MEM_GUARD_CANCEL");
  if (!cfg.get("MEM_GUARD_MAX_WAIT").empty())
    c.max_wait = std::chrono::milliseconds(cfg.get_duration_ms("MEM_GUARD_MAX_WAIT"));
  return c;
}

MemoryGuard::MemoryGuard(MemGuardConfig cfg, Metrics* metrics)
    : cfg_(std::move(cfg)), metrics_(metrics) {}

void MemoryGuard::set_cancel_hook(std::function<bool(const std::string&)> hook) {
  std::lock_guard lk(mu_);
  cancel_hook_ = std::move(hook);
}

bool MemoryGuard::under_wait_floor() const {
  return cfg_.wait_floor > 0 && sampled_.load() && available_.load() < cfg_.wait_floor;
}

void MemoryGuard::sample() {
  auto mi = env::read_meminfo(cfg_.root);
  if (!mi.ok()) return;
  uint64_t avail = mi->get("MemAvailable");
  available_ = avail;
  sampled_ = true;
  if (metrics_) metrics_->set("sparkd_mem_available_bytes", static_cast<double>(avail));
  std::function<bool(const std::string&)> hook;
  {
    std::lock_guard lk(mu_);
    hook = cancel_hook_;
  }
  if (!under_wait_floor()) cv_.notify_all();
  if (cfg_.cancel_floor > 0 && avail < cfg_.cancel_floor && hook) {
    std::string why = "cancelled by the memory guard: MemAvailable " + format_size(avail) +
                      " is under MEM_GUARD_CANCEL " + format_size(cfg_.cancel_floor) +
                      " on this node; retry later or shorten the request";
    if (hook(why)) {
      log::warn(kComp, "{}", why);
      if (metrics_) metrics_->inc("sparkd_mem_guard_cancels_total");
    }
  }
}

Status MemoryGuard::admit() {
  if (!under_wait_floor()) return Status::Ok();
  if (metrics_) metrics_->inc("sparkd_mem_guard_waits_total");
  log::warn(kComp, "holding a request: MemAvailable {} under MEM_GUARD_WAIT {}",
            format_size(available_.load()), format_size(cfg_.wait_floor));
  std::unique_lock lk(mu_);
  bool ok = cv_.wait_for(lk, cfg_.max_wait, [&] { return !under_wait_floor(); });
  if (ok) return Status::Ok();
  return make_error(Errc::resource,
                    "MemAvailable " + format_size(available_.load()) +
                        " stayed under MEM_GUARD_WAIT " + format_size(cfg_.wait_floor) + " for " +
                        std::to_string(cfg_.max_wait.count() / 1000) +
                        " s; the node is short of memory (page cache? another process?)");
}

}  // namespace spark::daemon
