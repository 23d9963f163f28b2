// spark-engine gpubench: the engine on a GPU against the machine's own ceilings, measured
// in the same run (see gpu_bench.h).
#include "bench/engine/gpu_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <tuple>
#include <vector>

#include "core/strings.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_cache.h"
#include "kernels/cuda_stream.h"
#include "kernels/matmul.h"

namespace spark::engine {

namespace {

using Clock = std::chrono::steady_clock;
double secs_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Device-memory read bandwidth: a 16-byte-load read kernel over a buffer far larger than L2.
Result<double> measure_read_gbps() {
  const size_t bytes = size_t{4} << 30;
  auto buf = kernels::cuda_malloc(bytes);
  if (!buf) return buf.error();
  auto sink = kernels::cuda_malloc(4 * 4096);
  if (!sink) return sink.error();
  auto s = kernels::cuda_stream_create();
  if (!s) return s.error();
  SPARK_TRY(kernels::cuda_memset_async(*buf, 0x5a, bytes, *s));  // non-zero data
  auto e0 = kernels::cuda_event_create();
  auto e1 = kernels::cuda_event_create();
  if (!e0 || !e1) return make_error(Errc::internal, "cudaEventCreate failed");
  std::vector<double> gbps;
  for (int i = 0; i < 12; ++i) {
    SPARK_TRY(kernels::cuda_event_record(*e0, *s));
    SPARK_TRY(kernels::cuda_read_bandwidth_kernel(*buf, bytes, *sink, *s));
    SPARK_TRY(kernels::cuda_event_record(*e1, *s));
    auto ms = kernels::cuda_event_elapsed_ms(*e0, *e1);
    if (!ms) return ms.error();
    if (i >= 2) gbps.push_back(static_cast<double>(bytes) / (*ms * 1e-3) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  kernels::cuda_event_destroy(*e0);
  kernels::cuda_event_destroy(*e1);
  kernels::cuda_stream_destroy(*s);
  kernels::cuda_free(*buf);
  kernels::cuda_free(*sink);
  return gbps[gbps.size() / 2];
}

// The median rate of 8 timed runs of `run`, an n^3 product on `stream`.
Result<double> median_tflops(size_t n, void* stream, const std::function<Status()>& run) {
  auto e0 = kernels::cuda_event_create();
  auto e1 = kernels::cuda_event_create();
  if (!e0 || !e1) {
    if (e0) kernels::cuda_event_destroy(*e0);
    if (e1) kernels::cuda_event_destroy(*e1);
    return make_error(Errc::internal, "cudaEventCreate failed");
  }
  std::vector<double> tf;
  Status failed = Status::Ok();
  for (int i = 0; i < 8 && failed.ok(); ++i) {
    if (!(failed = kernels::cuda_event_record(*e0, stream)).ok() || !(failed = run()).ok() ||
        !(failed = kernels::cuda_event_record(*e1, stream)).ok())
      break;
    auto ms = kernels::cuda_event_elapsed_ms(*e0, *e1);
    if (!ms)
      failed = ms.error();
    else
      tf.push_back(2.0 * n * n * n / (*ms * 1e-3) / 1e12);
  }
  kernels::cuda_event_destroy(*e0);
  kernels::cuda_event_destroy(*e1);
  if (!failed.ok()) return failed.error();
  std::sort(tf.begin(), tf.end());
  return tf[tf.size() / 2];
}

// BF16 matrix-product peak through the same cuBLASLt the engine uses (8192^3, random data).
Result<double> measure_bf16_tflops() {
  const size_t n = 8192;
  auto mm = kernels::Matmul::create();
  if (!mm) return mm.error();
  auto s = kernels::cuda_stream_create();
  if (!s) return s.error();
  std::vector<void*> bufs;
  for (int i = 0; i < 3; ++i) {
    auto f = kernels::cuda_malloc(n * n * 4);
    if (!f) return f.error();
    auto b = kernels::cuda_malloc(n * n * 2);
    if (!b) return b.error();
    std::vector<float> host(n * n);
    uint32_t x = 12345u + static_cast<uint32_t>(i);
    for (auto& v : host) {
      x = x * 1664525u + 1013904223u;
      v = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
    }
    SPARK_TRY(kernels::cuda_memcpy_async(*f, host.data(), n * n * 4, *s));
    SPARK_TRY(kernels::cuda_f32_to_bf16(static_cast<const float*>(*f), *b, n * n, *s));
    SPARK_TRY(kernels::cuda_stream_synchronize(*s));
    kernels::cuda_free(*f);
    bufs.push_back(*b);
  }
  kernels::MatmulArgs m;
  m.a = bufs[0];
  m.lda = n;
  m.w = bufs[1];
  m.ldw = n;
  m.out = bufs[2];
  m.ldo = n;
  m.m = m.n = m.k = n;
  m.backend = kernels::MatmulBackend::cublaslt;
  SPARK_TRY((*mm)->run(m, *s));
  auto tf = median_tflops(n, *s, [&] { return (*mm)->run(m, *s); });
  for (void* b : bufs) kernels::cuda_free(b);
  kernels::cuda_stream_destroy(*s);
  return tf;
}

// FP8 matrix-product peak through the product the engine's FP8 prefill runs (cuBLASLt's
// block-scaled FP8 on rows quantized per 128 columns, 8192^3, random data); 0 where this GPU
// has none (cuBLASLt's block-scaled FP8 is Hopper's).
Result<double> measure_fp8_tflops() {
  const size_t n = 8192, blocks = n / kernels::kFp8BlockK;
  auto mm = kernels::Matmul::create();
  if (!mm) return mm.error();
  auto s = kernels::cuda_stream_create();
  if (!s) return s.error();
  std::vector<void*> bufs;
  auto get = [&](size_t bytes) -> Result<void*> {
    auto b = kernels::cuda_malloc(bytes);
    if (b) bufs.push_back(*b);
    return b;
  };
  auto release = [&] {
    for (void* b : bufs) kernels::cuda_free(b);
    kernels::cuda_stream_destroy(*s);
  };
  // Codes of both operands from one host pattern (never the NaN codes), scales near 1/448.
  std::vector<uint8_t> codes(n * n);
  uint32_t x = 777u;
  for (auto& c : codes) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<uint8_t>(x >> 24);
    if ((c & 0x7f) == 0x7f) c ^= 1;
  }
  std::vector<float> scales(n * blocks, 1.f / 448);
  auto q = get(n * n), wq = get(n * n), qs = get(n * blocks * 4), ws = get(n * blocks * 4),
       out = get(n * n * 2);
  if (!q || !wq || !qs || !ws || !out) {
    release();
    return make_error(Errc::resource, "gpubench: no device memory for the FP8 peak's operands");
  }
  SPARK_TRY(kernels::cuda_memcpy_async(*q, codes.data(), n * n, *s));
  SPARK_TRY(kernels::cuda_memcpy_async(*wq, codes.data(), n * n, *s));
  SPARK_TRY(kernels::cuda_memcpy_async(*qs, scales.data(), n * blocks * 4, *s));
  SPARK_TRY(kernels::cuda_memcpy_async(*ws, scales.data(), n * blocks * 4, *s));
  SPARK_TRY(kernels::cuda_stream_synchronize(*s));
  kernels::Fp8TcArgs a;
  a.a = static_cast<const uint8_t*>(*q), a.lda = n, a.a_scales = static_cast<const float*>(*qs);
  a.w.q = static_cast<const uint8_t*>(*wq), a.w.ldq = n;
  a.w.scales = static_cast<const float*>(*ws), a.w.scale_ld = kernels::fp8_tc_scale_ld(n);
  a.out = *out, a.ldo = n, a.m = a.n = a.k = n;
  if (Status st = (*mm)->run_fp8(a, *s); !st.ok()) {
    release();
    if (st.error().code == Errc::unsupported) return 0.0;
    return st.error();
  }
  auto tf = median_tflops(n, *s, [&] { return (*mm)->run_fp8(a, *s); });
  release();
  return tf;
}

// Sequential read rate of the checkpoint's files from a cold page cache (the loader's own
// access pattern is sequential per tensor), then the cache dropped again.
Result<double> measure_disk_gbps(const std::vector<std::string>& files) {
  std::vector<char> buf(size_t{64} << 20);
  uint64_t total = 0;
  const auto t0 = Clock::now();
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return make_error(Errc::io, "cannot open " + f);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ssize_t r;
    while ((r = ::read(fd, buf.data(), buf.size())) > 0) total += static_cast<uint64_t>(r);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  return static_cast<double>(total) / secs_since(t0) / 1e9;
}

void drop_cache(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

struct StreamRun {
  double decode_tok_s = 0;  // generated tokens after each stream's first, per second
  double seconds = 0;
  double ttft_ms = 0;
  int wrong = 0;
};

// `streams` greedy requests at once; decode rate = tokens after the first token of each
// request over the time from the last first token to the end.
StreamRun run_streams(Engine& eng, int streams, int prompt, int max_tokens) {
  struct Sh {
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    std::vector<int> count;
    std::vector<Clock::time_point> first;
  } sh;
  sh.count.assign(static_cast<size_t>(streams), 0);
  sh.first.resize(static_cast<size_t>(streams));
  const int V = eng.config().vocab_size;
  const auto t0 = Clock::now();
  for (int i = 0; i < streams; ++i) {
    std::vector<int32_t> p;
    for (int k = 0; k < prompt; ++k) p.push_back((k * 131 + i * 977 + 7) % (V - 3) + 3);
    SamplingParams sp;
    sp.temperature = 0;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    auto id = eng.submit({p, sp, [&sh, i](const TokenEvent& e) {
                            std::lock_guard<std::mutex> lk(sh.mu);
                            if (e.token >= 0) {
                              if (sh.count[static_cast<size_t>(i)]++ == 0)
                                sh.first[static_cast<size_t>(i)] = Clock::now();
                            }
                            if (e.request_done) {
                              ++sh.done;
                              sh.cv.notify_all();
                            }
                          }});
    if (!id) return {0, 0, 0, streams};
  }
  std::unique_lock<std::mutex> lk(sh.mu);
  sh.cv.wait(lk, [&] { return sh.done == streams; });
  StreamRun r;
  r.seconds = secs_since(t0);
  Clock::time_point last_first = t0;
  double after_first = 0;
  for (int i = 0; i < streams; ++i) {
    last_first = std::max(last_first, sh.first[static_cast<size_t>(i)]);
    r.ttft_ms +=
        std::chrono::duration<double, std::milli>(sh.first[static_cast<size_t>(i)] - t0).count() /
        streams;
    if (sh.count[static_cast<size_t>(i)] != max_tokens) ++r.wrong;
    after_first += sh.count[static_cast<size_t>(i)] - 1;
  }
  // All streams decode together after the last one's first token; before that the steps
  // mix prefill. Count only the steady part: tokens after last_first.
  const double steady = std::chrono::duration<double>(Clock::now() - last_first).count();
  r.decode_tok_s = steady > 0 ? after_first / std::max(steady, 1e-9) : 0;
  return r;
}

}  // namespace

Result<int> run_gpu_bench(const std::map<std::string, std::string>& opt) {
  auto get = [&](const std::string& k, const std::string& def) {
    auto it = opt.find(k);
    return it == opt.end() ? def : it->second;
  };
  const std::string dir = get("model", "");
  if (dir.empty()) return make_error(Errc::usage, "gpubench needs --model DIR");
  // Every number first, before any GPU work: a bad one is a usage error naming the option.
  std::map<std::string, int> num;
  for (auto [key, def, lo, hi] :
       {std::tuple<const char*, const char*, int, int>{"context", "33792", 2, 1 << 24},
        {"max-batch-tokens", "8192", 1, 1 << 24},
        {"prompt-tokens", "128", 1, 1 << 20},
        {"max-tokens", "256", 2, 1 << 20},
        {"b1-runs", "3", 1, 100},
        {"decode-only", "0", 0, 1},
        {"graphs", "1", 0, 1},
        {"synthetic", "0", 0, 1},
        {"slots", "32", 1, 256}}) {
    const std::string v = get(key, def);
    auto n = parse_i64(v);
    if (!n || *n < lo || *n > hi)
      return make_error(
          Errc::usage,
          fmt::format("gpubench --{} {}: must be an integer from {} to {}", key, v, lo, hi));
    num[key] = static_cast<int>(*n);
  }
  // --streams LIST: the aggregate rows' stream counts (default 8,32; none with
  // --decode-only 1 unless given), each from 1 to the engine's 32 slots.
  std::vector<int> stream_counts;
  {
    const bool given = opt.count("streams") > 0;
    const std::string v = get("streams", num["decode-only"] == 1 ? "" : "8,32");
    size_t p = 0;
    while (!v.empty() && p <= v.size()) {
      const size_t e = std::min(v.find(',', p), v.size());
      auto n = parse_i64(v.substr(p, e - p));
      if (!n || *n < 1 || *n > 32)
        return make_error(Errc::usage,
                          fmt::format("gpubench --streams {}: a comma-separated list of stream "
                                      "counts from 1 to 32",
                                      v));
      stream_counts.push_back(static_cast<int>(*n));
      p = e + 1;
    }
    if (given && stream_counts.empty())
      return make_error(Errc::usage, "gpubench --streams: an empty list (leave it out for none)");
  }
  // --kv-dtype: the KV cache types the engine keeps on a GPU.
  const std::string kv_dtype = get("kv-dtype", "auto");
  if (kv_dtype != "auto" && kv_dtype != "bf16" && kv_dtype != "fp8" && kv_dtype != "fp32")
    return make_error(Errc::usage,
                      fmt::format("gpubench --kv-dtype {}: auto, bf16, fp8 or fp32", kv_dtype));
  nlohmann::json j;
  j["model"] = dir;
  const bool synthetic = num["synthetic"] == 1;
  j["synthetic_weights"] = synthetic;
  auto bw = measure_read_gbps();
  if (!bw) return bw.error();
  auto peak = measure_bf16_tflops();
  if (!peak) return peak.error();
  auto fp8_peak = measure_fp8_tflops();
  if (!fp8_peak) return fp8_peak.error();
  j["hbm_read_gbps"] = *bw;
  j["bf16_matmul_tflops"] = *peak;
  if (*fp8_peak > 0) j["fp8_matmul_tflops"] = *fp8_peak;
  // --synthetic 1: DIR holds config.json only; the weights are random on the device
  // (Model::synthetic), for shapes whose checkpoint would not fit the disk. Then there is no
  // load from disk to time.
  std::vector<std::string> files;
  double disk_gbps = 0;
  uint64_t file_bytes = 0;
  if (!synthetic) {
    auto ck = Checkpoint::open(dir);
    if (!ck) return ck.error();
    files = ck->files();
    drop_cache(files);
    auto disk = measure_disk_gbps(files);
    if (!disk) return disk.error();
    disk_gbps = *disk;
    j["disk_read_gbps"] = disk_gbps;
    for (const auto& f : files) file_bytes += std::filesystem::file_size(f);
    j["checkpoint_bytes"] = file_bytes;
    drop_cache(files);
  }

  // Time to READY from a cold page cache: device, weights, KV cache, one real completion.
  const auto t_ready = Clock::now();
  // --weights device|host-mapped|auto (WEIGHTS_PLACEMENT): on a GB10 both placements are
  // worth a run, the decode rate says which reads the weights faster there.
  CudaDeviceOptions co;
  auto placement = parse_weights_placement(get("weights", "auto"));
  if (!placement) return placement.error();
  co.weights = *placement;
  auto dev = make_cuda_device(0, co);
  if (!dev) return dev.error();
  j["weights_placement"] = weights_placement_name((*dev)->info().weights);
  LoadReport load;
  Result<std::unique_ptr<Model>> model = make_error(Errc::internal, "no model");
  if (synthetic) {
    // DIR, or a config.json of its own (bench/engine/shapes/).
    const std::string cfg_path = std::filesystem::is_regular_file(dir) ? dir : dir + "/config.json";
    auto text = read_file(cfg_path);
    if (!text) return make_error(Errc::not_found, "gpubench: cannot read " + cfg_path);
    auto mc = parse_model_config(*text, cfg_path);
    if (!mc) return mc.error();
    model = Model::synthetic(*mc, 0, 1, *dev, 1234, &load);
  } else {
    model = Model::load(dir, 0, 1, *dev, &load);
  }
  if (!model) return model.error();
  const ModelConfig cfg = (*model)->config();
  const ShardPlan splan = (*model)->shard_plan();
  j["model_info"] = (*model)->describe();
  const int ctx = num["context"];
  EngineOptions o;
  o.slots = num["slots"];
  o.max_context = ctx;
  o.max_batch_tokens = num["max-batch-tokens"];
  o.prefix_caching = false;
  o.kv_from_free_memory = true;
  o.mem_reserve = 2ull << 30;
  o.cuda_graphs = num["graphs"] == 1;
  o.kv_dtype = kv_dtype;
  auto eng = Engine::start(std::move(*model), std::make_shared<LocalCollective>(), o);
  if (!eng) return eng.error();
  j["kv_dtype"] = (*eng)->stats().kv_dtype;
  {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = 1;
    p.ignore_eos = true;
    auto w = generate_blocking(**eng, {1}, p, 600000);
    if (!w) return w.error();
  }
  const double ready_s = secs_since(t_ready);
  j["device"] = load.device;
  j["weight_bytes"] = load.weight_bytes;
  j["load_seconds"] = load.seconds;
  if (!synthetic) {
    j["ready_seconds"] = ready_s;
    j["ready_disk_bound_seconds"] = static_cast<double>(file_bytes) / (disk_gbps * 1e9);
    j["ready_vs_disk"] = j["ready_disk_bound_seconds"].get<double>() / ready_s;
  }

  // Bytes one decode token reads: every weight once (the lm_head included; a tied
  // embedding counts once) except that of an MoE layer's routed experts only the chosen
  // ones count, plus the KV of the context so far. The embedding reads one row a token.
  const int prompt = num["prompt-tokens"];
  const int gen = num["max-tokens"];
  // The cache reads per position, in the cache's type (bf16, fp8 or fp32): K and V of every
  // KV head, or latent attention's one row of the normalised latent and the RoPE key per
  // layer.
  const KVShape kvs = kv_shape(cfg, cfg.num_kv_heads);
  const std::string kvt = (*eng)->stats().kv_dtype;
  const double kv_elem = kvt == "fp8" ? 1.0 : kvt == "fp32" ? 4.0 : 2.0;
  const double kv_per_pos = kv_elem * cfg.num_layers * kvs.pools * kvs.n_kv_heads * kvs.head_dim;
  const double avg_ctx = prompt + gen / 2.0;
  // One expert's bytes as held: bf16, FP8 (a byte a weight) plus its block scales, or MXFP4
  // (half a byte) plus its e8m0 scales.
  const bool fp8 = (*dev)->keeps_fp8(), mx4 = (*dev)->keeps_mxfp4();
  double expert_bytes = 3.0 * cfg.hidden_size * splan.expert_inter * 2;
  for (const auto& d : splan.dests)
    if (((d.fp8 && fp8) || (d.mxfp4 && mx4)) && d.role == WeightRole::experts_gate_up &&
        splan.experts > 0) {
      expert_bytes = 0;
      for (const auto& e : splan.dests)
        if (e.layer == d.layer &&
            (e.role == WeightRole::experts_gate_up || e.role == WeightRole::experts_down))
          expert_bytes += static_cast<double>(e.packed_bytes()) / splan.experts;
      break;
    }
  const int moe_layers = cfg.moe.moe_layers();
  const double all_experts = static_cast<double>(moe_layers) * splan.experts * expert_bytes;
  const double embed_bytes =
      cfg.tie_word_embeddings ? 0.0 : static_cast<double>(cfg.vocab_size) * cfg.hidden_size * 2;
  const double dense_bytes =
      static_cast<double>(load.weight_bytes) - all_experts - embed_bytes + cfg.hidden_size * 2;
  const double chosen = static_cast<double>(moe_layers) * cfg.moe.top_k * expert_bytes;
  const double bytes_tok = dense_bytes + chosen + kv_per_pos * avg_ctx;
  const double roofline = *bw * 1e9 / bytes_tok;
  j["bytes_per_token"] = bytes_tok;
  if (cfg.is_moe())
    j["bytes_per_token_parts"] = {{"dense", dense_bytes},
                                  {"chosen_experts", chosen},
                                  {"kv", kv_per_pos * avg_ctx},
                                  {"one_expert", expert_bytes}};
  j["roofline_tok_s"] = roofline;
  run_streams(**eng, 1, prompt, 16);  // warm-up: graphs of bucket 1 captured
  // Batch 1: the median of `b1-runs` runs (each of `gen` tokens), every run in the JSON.
  const int b1_runs = num["b1-runs"];
  std::vector<StreamRun> b1s;
  nlohmann::json b1_all = nlohmann::json::array();
  for (int i = 0; i < b1_runs; ++i) {
    b1s.push_back(run_streams(**eng, 1, prompt, gen));
    b1_all.push_back(b1s.back().decode_tok_s);
  }
  std::sort(b1s.begin(), b1s.end(),
            [](const StreamRun& a, const StreamRun& b) { return a.decode_tok_s < b.decode_tok_s; });
  StreamRun b1 = b1s[b1s.size() / 2];
  b1.wrong = 0;
  for (const auto& r : b1s) b1.wrong += r.wrong;
  j["decode_b1_tok_s"] = b1.decode_tok_s;
  j["decode_b1_runs_tok_s"] = b1_all;
  j["decode_b1_vs_roofline"] = b1.decode_tok_s / roofline;
  const bool decode_only = num["decode-only"] == 1;
  nlohmann::json agg = nlohmann::json::array();
  for (int s : stream_counts) {
    run_streams(**eng, s, prompt, 8);
    auto r = run_streams(**eng, s, prompt, gen);
    nlohmann::json row = {{"streams", s},
                          {"tok_s", r.decode_tok_s},
                          {"vs_b1", r.decode_tok_s / std::max(b1.decode_tok_s, 1e-9)},
                          {"wrong", r.wrong}};
    if (cfg.is_moe()) {
      // The roofline of these streams: a step reads each distinct chosen expert once. The
      // distinct experts per MoE layer of the decode steps, counted in a short eager run.
      double distinct = 0;
      int counted = 0;
      (*eng)->model().set_route_recorder([&](int, const int32_t* ids, int rows, int k) {
        if (rows != s) return;  // decode steps of all streams only
        std::vector<int32_t> v(ids, ids + static_cast<size_t>(rows) * static_cast<size_t>(k));
        std::sort(v.begin(), v.end());
        distinct += static_cast<double>(std::unique(v.begin(), v.end()) - v.begin());
        ++counted;
      });
      run_streams(**eng, s, prompt, 12);
      (*eng)->model().set_route_recorder(nullptr);
      const double per_layer = counted ? distinct / counted : 0;
      const double step_bytes = dense_bytes +
                                static_cast<double>(moe_layers) * per_layer * expert_bytes +
                                s * kv_per_pos * avg_ctx;
      const double roof = *bw * 1e9 / step_bytes * s;
      row["distinct_experts_per_layer"] = per_layer;
      row["roofline_tok_s"] = roof;
      row["vs_roofline"] = r.decode_tok_s / roof;
    }
    agg.push_back(row);
  }
  j["aggregate_decode"] = agg;
  // Prefill: one prompt, one token out; FLOPs = 2 x params x tokens + causal attention, the
  // parameters a token multiplies (an MoE layer's chosen and shared experts; no embedding).
  const double params = static_cast<double>(count_params(cfg).active) -
                        static_cast<double>(cfg.vocab_size) * cfg.hidden_size;
  // Causal attention's products per layer and head: n^2 / 2 query-key pairs, each a dot
  // product over the key width and a sum over the value width (2 FLOPs a multiply-add).
  const double attn_width =
      cfg.is_mla() ? cfg.mla.qk_head_dim() + cfg.mla.v_head_dim : 2.0 * cfg.head_dim;
  nlohmann::json pf = nlohmann::json::array();
  for (int n : {1024, 8192, 32768}) {
    if (decode_only || n + 1 >= ctx) continue;
    auto r = run_streams(**eng, 1, n, 1);
    const double s = r.ttft_ms / 1e3;
    const double flops =
        2.0 * params * n + cfg.num_layers * cfg.num_heads * attn_width * static_cast<double>(n) * n;
    pf.push_back({{"tokens", n},
                  {"seconds", s},
                  {"tok_s", n / s},
                  {"tflops", flops / s / 1e12},
                  {"vs_peak", flops / s / 1e12 / *peak}});
    // An FP8 checkpoint's prefill also against the FP8 peak (its products' own ceiling).
    if (cfg.weights.fp8() && *fp8_peak > 0) pf.back()["vs_fp8_peak"] = flops / s / 1e12 / *fp8_peak;
  }
  j["prefill"] = pf;
  (*eng)->stop();
  j["ok"] = b1.wrong == 0;
  if (opt.count("json-out")) {
    std::string why;
    if (!write_file_atomic(get("json-out", ""), j.dump(2) + "\n", &why))
      return make_error(Errc::io, get("json-out", "") + ": " + why);
  }
  std::printf("# gpubench %s on %s\n", dir.c_str(), load.device.c_str());
  std::printf("  %-34s %12.1f GB/s\n", "HBM read (read kernel)", *bw);
  std::printf("  %-34s %12.1f TFLOP/s\n", "bf16 matmul peak (cuBLASLt 8192^3)", *peak);
  if (*fp8_peak > 0)
    std::printf("  %-34s %12.1f TFLOP/s\n", "FP8 matmul peak (cuBLASLt 8192^3)", *fp8_peak);
  if (!synthetic) {
    std::printf("  %-34s %12.2f GB/s\n", "disk read (cold cache)", disk_gbps);
    std::printf("  %-34s %12.2f s (disk bound %.2f s, %.0f%%)\n", "time to READY", ready_s,
                j["ready_disk_bound_seconds"].get<double>(),
                100 * j["ready_vs_disk"].get<double>());
  } else {
    std::printf("  %-34s %12s\n", "weights", "random on the device (--synthetic 1)");
  }
  std::printf("  %-34s %12s (decode at %d to %d positions)\n", "KV cache", kvt.c_str(), prompt,
              prompt + gen);
  std::printf("  %-34s %12.1f tok/s (roofline %.1f, %.1f%%)\n", "decode batch 1", b1.decode_tok_s,
              roofline, 100 * b1.decode_tok_s / roofline);
  if (b1s.size() > 1)
    std::printf("  %-34s %12.1f .. %.1f tok/s (%.1f%% .. %.1f%%), median above\n",
                fmt::format("  {} runs", b1s.size()).c_str(), b1s.front().decode_tok_s,
                b1s.back().decode_tok_s, 100 * b1s.front().decode_tok_s / roofline,
                100 * b1s.back().decode_tok_s / roofline);
  for (const auto& r : agg) {
    std::printf("  decode %2d streams %23.1f tok/s (%.1fx batch 1)", r["streams"].get<int>(),
                r["tok_s"].get<double>(), r["vs_b1"].get<double>());
    if (r.contains("vs_roofline"))
      std::printf(", %.1f%% of the roofline of its %.1f distinct experts a layer",
                  100 * r["vs_roofline"].get<double>(),
                  r["distinct_experts_per_layer"].get<double>());
    std::printf("\n");
  }
  for (const auto& r : pf) {
    std::printf("  prefill %6d tokens %19.0f tok/s (%.0f TFLOP/s, %.0f%% of peak",
                r["tokens"].get<int>(), r["tok_s"].get<double>(), r["tflops"].get<double>(),
                100 * r["vs_peak"].get<double>());
    if (r.contains("vs_fp8_peak"))
      std::printf(", %.0f%% of the FP8 peak", 100 * r["vs_fp8_peak"].get<double>());
    std::printf(")\n");
  }
  std::printf("%s\n", j.dump().c_str());
  return j["ok"].get<bool>() ? 0 : 1;
}

}  // namespace spark::engine
