#include "daemon/history_sampler.h"

#include <fmt/format.h>

#include <cstdlib>

#include "core/log.h"
#include "core/strings.h"
#include "env/meminfo.h"
#include "env/nvml.h"

namespace spark::daemon {

namespace {

constexpr const char* kComp = "history";

int64_t wall_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "some avg10=1.23 avg60=..." -> 1.23 for kind "some"; -1 when absent.
double psi_avg10(const std::string& text, const char* kind) {
  for (const auto& line : split_list(text, '\n')) {
    if (!starts_with(line, kind)) continue;
    auto at = line.find("avg10=");
    if (at == std::string::npos) return -1;
    return std::strtod(line.c_str() + at + 6, nullptr);
  }
  return -1;
}

}  // namespace

void sample_node(const SamplerOptions& opt, HealthSample* s) {
  std::string root = opt.proc_root == "/" ? "" : opt.proc_root;
  s->time_ms = wall_now_ms();
  s->rank = opt.rank;
  s->world_size = opt.world_size;
  s->boot_id = std::string(trim(read_file(root + "/proc/sys/kernel/random/boot_id").value_or("")));
  if (auto m = env::read_meminfo(opt.proc_root); m.ok()) {
    auto get = [&](const char* k) {
      return m->fields.count(k) ? static_cast<int64_t>(m->fields.at(k)) : int64_t{-1};
    };
    s->mem_available = get("MemAvailable");
    s->mem_free = get("MemFree");
    s->page_cache = get("Cached");
  }
  auto mem = read_file(root + "/proc/pressure/memory").value_or("");
  auto cpu = read_file(root + "/proc/pressure/cpu").value_or("");
  auto io = read_file(root + "/proc/pressure/io").value_or("");
  s->psi_mem_some = psi_avg10(mem, "some");
  s->psi_mem_full = psi_avg10(mem, "full");
  s->psi_cpu_some = psi_avg10(cpu, "some");
  s->psi_io_some = psi_avg10(io, "some");
  s->psi_io_full = psi_avg10(io, "full");
  if (opt.gpu >= 0) {
    auto rep = env::read_nvml(opt.gpu, opt.nvml_library);
    if (!rep.gpus.empty()) {
      const auto& g = rep.gpus.front();
      s->sm_clock_mhz = g.sm_clock_mhz;
      s->sm_clock_max_mhz = g.sm_clock_max_mhz;
      s->mem_clock_mhz = g.mem_clock_mhz;
      s->power_mw = g.power_mw;
      s->power_limit_mw = g.power_limit_mw;
      s->temp_c = g.temp_c;
      s->throttle_reasons = g.throttle_reasons;
      s->gpu_mem_used = g.mem_used;
      s->gpu_mem_total = g.mem_total;
    }
  }
}

HistorySampler::HistorySampler(SamplerOptions opt, std::function<DaemonSample()> source)
    : opt_(std::move(opt)), source_(std::move(source)) {}

HistorySampler::~HistorySampler() {
  stop();
}

Status HistorySampler::start() {
  if (auto st = writer_.open(opt_.path, opt_.capacity); !st.ok()) return st;
  log::info(kComp, "health history {} ({} samples, every {} ms), after sample {}", opt_.path,
            opt_.capacity, opt_.interval.count(), writer_.last_seq());
  thread_ = std::thread([this] { run(); });
  return Status::Ok();
}

void HistorySampler::poke() {
  std::lock_guard lk(mu_);
  poked_ = true;
  cv_.notify_all();
}

void HistorySampler::stop() {
  {
    std::lock_guard lk(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

uint64_t HistorySampler::samples_written() const {
  std::lock_guard lk(mu_);
  return written_;
}

void HistorySampler::run() {
  bool warned = false;
  for (;;) {
    bool last = false;
    HealthSample s;
    sample_node(opt_, &s);
    DaemonSample d = source_();
    s.state = d.state;
    s.reason = d.reason.substr(0, 80);
    s.ranks_alive = d.ranks_alive;
    s.step_age_ms = d.step_age_ms;
    auto now = std::chrono::steady_clock::now();
    if (d.generated_tokens >= 0 && last_tokens_ >= 0 && now > last_at_) {
      double secs = std::chrono::duration<double>(now - last_at_).count();
      s.tokens_per_s = std::max(0.0, d.generated_tokens - last_tokens_) / secs;
    }
    last_tokens_ = d.generated_tokens;
    last_at_ = now;
    if (auto st = writer_.append(s); !st.ok()) {
      if (!warned) log::warn(kComp, "{} (history paused until it works again)", st.error().message);
      warned = true;
    } else {
      warned = false;
      std::lock_guard lk(mu_);
      ++written_;
    }
    std::unique_lock lk(mu_);
    if (stop_) return;
    cv_.wait_for(lk, opt_.interval, [&] { return stop_ || poked_; });
    poked_ = false;
    last = stop_;
    if (last) {
      lk.unlock();
      // One last sample on the way down, so the history shows the stop.
      HealthSample fin;
      sample_node(opt_, &fin);
      DaemonSample fd = source_();
      fin.state = fd.state;
      fin.reason = fd.reason.substr(0, 80);
      fin.ranks_alive = fd.ranks_alive;
      fin.step_age_ms = fd.step_age_ms;
      (void)writer_.append(fin);
      return;
    }
  }
}

}  // namespace spark::daemon
