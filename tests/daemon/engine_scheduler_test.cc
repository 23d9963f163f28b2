// The engine: continuous batching gives the same tokens as one request alone, chunked
// prefill, prefix caching across requests, seeds, n > 1, stop/length, cancellation.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "core/model_plan.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/random_checkpoint.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

std::vector<int32_t> prompt_of(int n, int salt, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + salt * 101 + 11) % (vocab - 3) + 3);
  return p;
}

// Greedy decoding straight through the model: the ground truth for the scheduler.
std::vector<int32_t> direct_greedy(Model& m, std::vector<int32_t> seq, int steps) {
  const auto& c = m.config();
  KVCache cache(c.num_layers, 64, 16, m.local_kv_heads(), c.head_dim);
  std::vector<int32_t> table(64);
  for (int i = 0; i < 64; ++i) table[static_cast<size_t>(i)] = i;
  LocalCollective one;
  std::vector<float> logits;
  std::vector<int32_t> out;
  SeqChunk ch{seq.data(), static_cast<int>(seq.size()), 0, table.data(), true};
  REQUIRE(m.forward({ch}, cache, one, &logits).ok());
  for (int s = 0; s < steps; ++s) {
    int32_t t =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(t);
    seq.push_back(t);
    SeqChunk d{&seq.back(), 1, static_cast<int>(seq.size()) - 1, table.data(), true};
    REQUIRE(m.forward({d}, cache, one, &logits).ok());
  }
  return out;
}

struct Fixture {
  test::TempDir dir;
  explicit Fixture(Family family = Family::llama) {
    auto cfg = small_config(family);
    cfg.eos_token_ids = {};  // no early stop in these tests unless asked
    REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 11, 1}).ok());
  }
  std::unique_ptr<Engine> engine(EngineOptions o) {
    auto m = Model::load(dir.path(), 0, 1);
    REQUIRE(m.ok());
    auto e = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
    REQUIRE_MESSAGE(e.ok(), (e.ok() ? std::string() : e.error().message));
    return std::move(*e);
  }
  std::unique_ptr<Model> model() {
    auto m = Model::load(dir.path(), 0, 1);
    REQUIRE(m.ok());
    return std::move(*m);
  }
};

SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  return p;
}

}  // namespace

TEST_CASE(
    "engine: concurrent requests in few slots with chunked prefill equal each request alone") {
  Fixture fx;
  auto model = fx.model();
  const int V = model->config().vocab_size;
  std::vector<std::vector<int32_t>> prompts = {prompt_of(37, 1, V), prompt_of(5, 2, V),
                                               prompt_of(20, 3, V), prompt_of(50, 4, V),
                                               prompt_of(16, 5, V)};
  std::vector<std::vector<int32_t>> expect;
  for (const auto& p : prompts) expect.push_back(direct_greedy(*model, p, 24));

  EngineOptions o;
  o.slots = 2;
  o.max_batch_tokens = 8;  // forces chunked prefill mixed with decodes
  auto eng = fx.engine(o);
  std::vector<std::thread> ts;
  std::vector<Result<BlockingResult>> results(prompts.size(), Error{});
  for (size_t i = 0; i < prompts.size(); ++i)
    ts.emplace_back([&, i] { results[i] = generate_blocking(*eng, prompts[i], greedy(24)); });
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    REQUIRE_MESSAGE(results[i].ok(),
                    (results[i].ok() ? std::string() : results[i].error().message));
    CHECK(results[i]->tokens[0] == expect[i]);
    CHECK(results[i]->finish[0] == FinishReason::length);
  }
  auto st = eng->stats();
  CHECK(st.generated_tokens == 24 * prompts.size());
  CHECK(st.running == 0);
  CHECK(st.blocks_available == st.blocks_total);  // every block came back
}

TEST_CASE("engine: chunked prefill computes the logits of whole prefill") {
  // Every family (Mistral's sliding window included): the prompt fed in uneven chunks over
  // several steps through the KV cache against the same prompt in one step.
  for (Family f : {Family::llama, Family::qwen2, Family::qwen3, Family::mistral}) {
    CAPTURE(static_cast<int>(f));
    test::TempDir dir;
    auto cfg = small_config(f);
    if (f == Family::mistral) cfg.sliding_window = 8;  // shorter than the chunks and prompt
    REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 5, 1}).ok());
    auto m = Model::load(dir.path(), 0, 1);
    REQUIRE(m.ok());
    Model& model = **m;
    const auto& c = model.config();
    const size_t V = static_cast<size_t>(c.vocab_size);
    const auto prompt = prompt_of(45, 9, c.vocab_size);
    LocalCollective one;
    std::vector<int32_t> table(8);
    for (int i = 0; i < 8; ++i) table[static_cast<size_t>(i)] = 7 - i;
    KVCache whole_cache(c.num_layers, 8, 16, model.local_kv_heads(), c.head_dim);
    std::vector<float> whole;
    SeqChunk all{prompt.data(), static_cast<int>(prompt.size()), 0, table.data(), true};
    REQUIRE(model.forward({all}, whole_cache, one, &whole, true).ok());
    REQUIRE(whole.size() == prompt.size() * V);

    KVCache cache(c.num_layers, 8, 16, model.local_kv_heads(), c.head_dim);
    std::vector<float> chunked, part;
    int at = 0;
    for (int n : {5, 1, 16, 7, 3, 13}) {
      SeqChunk ch{prompt.data() + at, n, at, table.data(), true};
      REQUIRE(model.forward({ch}, cache, one, &part, true).ok());
      chunked.insert(chunked.end(), part.begin(), part.end());
      at += n;
    }
    REQUIRE(at == static_cast<int>(prompt.size()));
    REQUIRE(chunked.size() == whole.size());
    // Float rounding only: the products see other row counts, so the sums may round
    // differently (a chunking bug, a wrong position or block, is off by whole units).
    double worst = 0, scale = 1;
    for (size_t i = 0; i < whole.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(whole[i]) - chunked[i]));
      scale = std::max(scale, std::abs(static_cast<double>(whole[i])));
    }
    MESSAGE("max |logit(chunked) - logit(whole)| = " << worst << " (max |logit| " << scale << ")");
    CHECK(worst <= 1e-5 * scale);
  }
}

TEST_CASE("engine: a long prefill does not hold a short request's first token") {
  // By cause, not by timing: on_step holds the engine after chosen steps, so a decoding
  // request, a long prompt and a short prompt arrive at known points; the trace says what
  // each step computed.
  Fixture fx;
  auto model = fx.model();
  const int V = model->config().vocab_size;
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t hold_at = 1;
    bool held = false;
    std::vector<StepTrace> steps;
    std::map<RequestId, std::vector<int32_t>> tokens;
    std::map<RequestId, uint64_t> first_token_step;
    int done = 0;
  };
  auto sh = std::make_shared<Shared>();
  constexpr int kBudget = 16;
  EngineOptions o;
  o.slots = 3;
  o.max_batch_tokens = kBudget;
  o.prefix_caching = false;
  o.on_step = [sh](const StepTrace& t) {
    std::unique_lock<std::mutex> lk(sh->mu);
    sh->steps.push_back(t);
    if (t.step != sh->hold_at) return;
    sh->held = true;
    sh->cv.notify_all();
    sh->cv.wait(lk, [&] { return !sh->held; });
  };
  auto eng = fx.engine(o);
  auto submit = [&](const std::vector<int32_t>& prompt, int max_tokens) {
    auto id = eng->submit({prompt, greedy(max_tokens), [sh](const TokenEvent& e) {
                             std::lock_guard<std::mutex> lk(sh->mu);
                             if (e.token >= 0) {
                               sh->tokens[e.request].push_back(e.token);
                               sh->first_token_step.emplace(e.request, sh->steps.size() + 1);
                             }
                             if (e.request_done) {
                               ++sh->done;
                               sh->cv.notify_all();
                             }
                           }});
    REQUIRE(id.ok());
    return *id;
  };
  auto wait_held = [&] {
    std::unique_lock<std::mutex> lk(sh->mu);
    REQUIRE(sh->cv.wait_for(lk, std::chrono::seconds(60), [&] { return sh->held; }));
  };
  auto release = [&](uint64_t next_hold) {
    std::lock_guard<std::mutex> lk(sh->mu);
    sh->hold_at = next_hold;
    sh->held = false;
    sh->cv.notify_all();
  };
  const auto decoding_prompt = prompt_of(3, 21, V), long_prompt = prompt_of(200, 22, V),
             short_prompt = prompt_of(12, 23, V);
  const RequestId decoding = submit(decoding_prompt, 40);
  wait_held();  // step 1: the decoding request prefilled and drew its first token
  const RequestId long_id = submit(long_prompt, 4);
  release(2);
  wait_held();  // step 2: the long prompt's first chunk is in, beside the decode
  const RequestId short_id = submit(short_prompt, 4);
  release(0);
  std::unique_lock<std::mutex> lk(sh->mu);
  REQUIRE(sh->cv.wait_for(lk, std::chrono::seconds(120), [&] { return sh->done == 3; }));

  // The short prompt shares what the decode leaves of the budget with the long one: at
  // least floor((16 - 1) / 2) = 7 of its 12 tokens a step, so its first token comes within
  // ceil(12 / 7) = 2 steps of its arrival (after step 2), while the long one still prefills.
  REQUIRE(sh->steps.size() >= 2);
  const uint64_t share = (kBudget - 1) / 2;
  const uint64_t bound = (short_prompt.size() + share - 1) / share;
  const uint64_t waited = sh->first_token_step.at(short_id) - 2;
  MESSAGE("short request's first token " << waited << " steps after it arrived (bound " << bound
                                         << "); the long prompt's came at step "
                                         << sh->first_token_step.at(long_id));
  CHECK(waited <= bound);
  int long_left_then = -1;
  for (const auto& c : sh->steps[sh->first_token_step.at(short_id) - 1].chunks)
    if (c.request == long_id) long_left_then = c.prompt_left;
  CHECK(long_left_then > 0);  // the long prompt was still prefilling

  // While the long prompt prefills: the decoding request gets its token every step, the
  // long prompt is never starved, and no step exceeds the budget.
  for (size_t k = 1; k < sh->steps.size(); ++k) {
    const auto& st = sh->steps[k];
    CAPTURE(st.step);
    int total = 0, decode = 0, long_tokens = 0, long_left = 1;
    for (const auto& c : st.chunks) {
      total += c.tokens;
      if (c.request == long_id) long_tokens = c.tokens, long_left = c.prompt_left;
      if (c.request == decoding) decode = c.tokens;
    }
    CHECK(total <= kBudget);
    CHECK(decode == 1);
    CHECK(long_tokens > 0);
    if (long_left == 0) break;
  }
  // Interleaving changed the order of work, not the results.
  CHECK(sh->tokens[decoding] == direct_greedy(*model, decoding_prompt, 40));
  CHECK(sh->tokens[long_id] == direct_greedy(*model, long_prompt, 4));
  CHECK(sh->tokens[short_id] == direct_greedy(*model, short_prompt, 4));
}

TEST_CASE("engine: block-aligned prefix caching is shared across requests") {
  Fixture fx;
  EngineOptions o;
  o.block_size = 16;
  auto eng = fx.engine(o);
  const int V = eng->config().vocab_size;
  auto p = prompt_of(40, 7, V);
  auto first = generate_blocking(*eng, p, greedy(8));
  REQUIRE(first.ok());
  CHECK(first->cached_prompt_tokens == 0);
  auto second = generate_blocking(*eng, p, greedy(8));
  REQUIRE(second.ok());
  CHECK(second->cached_prompt_tokens == 32);  // two full blocks of 16 reused
  CHECK(second->tokens == first->tokens);
  // Same first block, different second block: only the first is reused.
  auto q = p;
  q[20] = (q[20] + 1) % V;
  auto third = generate_blocking(*eng, q, greedy(8));
  REQUIRE(third.ok());
  CHECK(third->cached_prompt_tokens == 16);
  auto model = fx.model();
  CHECK(third->tokens[0] == direct_greedy(*model, q, 8));
  CHECK(eng->stats().cached_tokens == 32 + 16);
  // vLLM's prefix-cache queries: every admitted prompt token was looked up.
  CHECK(eng->stats().prefix_queries == 3 * 40);
  CHECK(eng->stats().prompt_tokens + eng->stats().cached_tokens == 3 * 40);
  // Without prefix caching nothing is reused.
  EngineOptions off = o;
  off.prefix_caching = false;
  auto eng2 = fx.engine(off);
  REQUIRE(generate_blocking(*eng2, p, greedy(4)).ok());
  auto again = generate_blocking(*eng2, p, greedy(4));
  REQUIRE(again.ok());
  CHECK(again->cached_prompt_tokens == 0);
  CHECK(eng2->stats().prefix_queries == 0);  // no cache, no lookups
}

TEST_CASE("engine: events carry when the request was submitted and when its choice got a slot") {
  Fixture fx;
  EngineOptions o;
  o.slots = 1;
  auto eng = fx.engine(o);
  const int V = eng->config().vocab_size;
  using Clock = std::chrono::steady_clock;
  struct Seen {
    std::mutex mu;
    std::condition_variable cv;
    Clock::time_point submitted{}, scheduled{}, finished{};
    bool done = false;
  };
  // The first request holds the only slot; the second waits for it, so its queue time
  // covers the first's whole run.
  auto run = [&](Seen& seen, int max_tokens) {
    auto before = Clock::now();
    auto id = eng->submit({prompt_of(20, 3, V), greedy(max_tokens), [&seen](const TokenEvent& e) {
                             std::lock_guard lk(seen.mu);
                             if (e.scheduled != Clock::time_point{}) {
                               seen.submitted = e.submitted;
                               seen.scheduled = e.scheduled;
                             }
                             if (e.request_done) {
                               seen.finished = Clock::now();
                               seen.done = true;
                               seen.cv.notify_all();
                             }
                           }});
    REQUIRE(id.ok());
    CHECK(Clock::now() >= before);
    return before;
  };
  Seen a, b;
  auto t_a = run(a, 16);
  auto t_b = run(b, 2);
  for (Seen* s : {&a, &b}) {
    std::unique_lock lk(s->mu);
    REQUIRE(s->cv.wait_for(lk, std::chrono::seconds(60), [&] { return s->done; }));
  }
  CHECK(a.submitted >= t_a);
  CHECK(a.scheduled >= a.submitted);
  CHECK(b.submitted >= t_b);
  CHECK(b.scheduled >= a.finished);  // only once a freed the one slot
  CHECK(b.scheduled - b.submitted > std::chrono::milliseconds(0));
}

// The scheduler's behaviours on a dense model and on a mixture of experts (GLM-4.5's
// structure: groups, a correction bias, a shared expert, a dense first layer).
const Family kSchedulerFamilies[] = {Family::llama, Family::glm4_moe};

TEST_CASE("engine: seeds, n > 1, stop tokens and max_tokens") {
  for (Family family : kSchedulerFamilies) {
    CAPTURE(architecture_name(family));
    Fixture fx(family);
    auto eng = fx.engine({});
    const int V = eng->config().vocab_size;
    auto p = prompt_of(12, 9, V);
    SamplingParams s;
    s.temperature = 1.0f;
    s.seed = 42;
    s.max_tokens = 20;
    s.n = 3;
    auto a = generate_blocking(*eng, p, s);
    auto b = generate_blocking(*eng, p, s);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK(a->tokens == b->tokens);  // same seed and prompt: same tokens, every choice
    REQUIRE(a->tokens.size() == 3);
    CHECK(a->tokens[0] != a->tokens[1]);  // choices have their own streams
    s.seed = 43;
    auto c = generate_blocking(*eng, p, s);
    REQUIRE(c.ok());
    CHECK(c->tokens != a->tokens);

    // A stop token ends the choice with "stop" and includes the token.
    auto g = generate_blocking(*eng, p, greedy(10));
    REQUIRE(g.ok());
    auto stop = greedy(10);
    stop.stop_token_ids = {g->tokens[0][3]};
    auto st = generate_blocking(*eng, p, stop);
    REQUIRE(st.ok());
    CHECK(st->finish[0] == FinishReason::stop);
    const auto first_stop =
        std::find(g->tokens[0].begin(), g->tokens[0].end(), g->tokens[0][3]) - g->tokens[0].begin();
    CHECK(st->tokens[0].size() == static_cast<size_t>(first_stop + 1));
    CHECK(g->finish[0] == FinishReason::length);
    CHECK(g->tokens[0].size() == 10);
    // logprobs come back per token.
    auto lp = greedy(5);
    lp.logprobs = true;
    auto l = generate_blocking(*eng, p, lp);
    REQUIRE(l.ok());
    REQUIRE(l->logprobs[0].size() == 5);
    for (float v : l->logprobs[0]) CHECK(v <= 0.0f);
  }
}

TEST_CASE("engine: cancel frees the slot at once for a waiting request") {
  for (Family family : kSchedulerFamilies) {
    CAPTURE(architecture_name(family));
    Fixture fx(family);
    EngineOptions o;
    o.slots = 1;
    auto eng = fx.engine(o);
    const int V = eng->config().vocab_size;
    std::atomic<int> first_tokens{0};
    std::atomic<bool> first_done{false};
    std::atomic<int> first_reason{0};
    GenerateRequest long_req{prompt_of(10, 1, V), greedy(400), [&](const TokenEvent& e) {
                               if (e.token >= 0) ++first_tokens;
                               if (e.request_done) {
                                 first_reason = static_cast<int>(e.finish);
                                 first_done = true;
                               }
                             }};
    auto id = eng->submit(std::move(long_req));
    REQUIRE(id.ok());
    for (int i = 0; i < 2000 && first_tokens < 3; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    REQUIRE(first_tokens >= 3);
    std::thread waiter_thread;
    Result<BlockingResult> second = Error{};
    waiter_thread = std::thread(
        [&] { second = generate_blocking(*eng, prompt_of(8, 2, V), greedy(4), 20000); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    eng->cancel(*id);
    waiter_thread.join();
    REQUIRE(second.ok());
    CHECK(second->tokens[0].size() == 4);
    CHECK(first_done);
    CHECK(first_reason == static_cast<int>(FinishReason::cancelled));
    CHECK(first_tokens < 400);
    auto st = eng->stats();
    CHECK(st.blocks_available == st.blocks_total);
  }
}

TEST_CASE("engine: requests that cannot fit are refused with a reason") {
  Fixture fx;
  EngineOptions o;
  o.max_context = 64;
  auto eng = fx.engine(o);
  const int V = eng->config().vocab_size;
  auto r = eng->submit({prompt_of(64, 1, V), greedy(4), [](const TokenEvent&) {}});
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.find("context_length_exceeded") != std::string::npos);
  auto bad = eng->submit({{static_cast<int32_t>(V)}, greedy(4), [](const TokenEvent&) {}});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::usage);
  // max_tokens near INT_MAX is capped by the context, not overflowed.
  auto huge = greedy(2147483647);
  auto h = generate_blocking(*eng, prompt_of(60, 2, V), huge);
  REQUIRE_MESSAGE(h.ok(), (h.ok() ? std::string() : h.error().message));
  CHECK(h->tokens[0].size() == 4);
  // A long completion is capped by the context: finish "length" at 64 tokens total.
  auto capped = generate_blocking(*eng, prompt_of(60, 1, V), greedy(100));
  REQUIRE(capped.ok());
  CHECK(capped->tokens[0].size() == 4);
  CHECK(capped->finish[0] == FinishReason::length);
}

namespace {
// Fault injection (a test double): the CPU device, whose begin_step() fails from call N on
// (a device that broke mid-run) or first sleeps `ms` (a slow step). Every other call goes
// to the CPU device unchanged.
class DeviceFaultsForTest final : public Device {
 public:
  DeviceFaultsForTest(int fail_from, int ms) : fail_from_(fail_from), ms_(ms) {}
  const DeviceInfo& info() const override { return cpu_->info(); }
  ElemType compute_type() const override { return cpu_->compute_type(); }
  Result<Buffer> alloc(ElemType type, size_t numel) override { return cpu_->alloc(type, numel); }
  Status upload(const Buffer& dst, const void* src, DType src_type) override {
    return cpu_->upload(dst, src, src_type);
  }
  Result<Buffer> host_staging(size_t bytes) override { return cpu_->host_staging(bytes); }
  size_t preferred_staging_bytes() const override { return cpu_->preferred_staging_bytes(); }
  Status zero(const Buffer& dst) override { return cpu_->zero(dst); }
  Status fill_random(const Buffer& dst, uint64_t seed, float scale, float offset) override {
    return cpu_->fill_random(dst, seed, scale, offset);
  }
  Status to_host(const Buffer& src, float* dst, size_t n) override {
    return cpu_->to_host(src, dst, n);
  }
  Result<uint64_t> available_bytes() override { return cpu_->available_bytes(); }
  Status begin_step(const StepLayout& step) override {
    if (fail_from_ > 0 && ++steps_ >= fail_from_)
      return make_error(Errc::internal,
                        "injected: the device failed at step " + std::to_string(steps_));
    if (ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    return cpu_->begin_step(step);
  }
  Status embed(const Buffer& table, const Buffer& x, int dim) override {
    return cpu_->embed(table, x, dim);
  }
  Status rmsnorm(const Buffer& x, const Buffer& w, const Buffer& y, int rows, int dim,
                 float eps) override {
    return cpu_->rmsnorm(x, w, y, rows, dim, eps);
  }
  Status add_rmsnorm(const Buffer& x, const Buffer& delta, const Buffer& bias, const Buffer& w,
                     const Buffer& y, int rows, int dim, float eps) override {
    return cpu_->add_rmsnorm(x, delta, bias, w, y, rows, dim, eps);
  }
  Status linear(const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y, int rows,
                int in, int out) override {
    return cpu_->linear(x, w, b, y, rows, in, out);
  }
  Status rope_qk(const Buffer& q, const Buffer& k, int heads, int kv_heads, int head_dim,
                 const Buffer& inv_freq, const Buffer& q_norm, const Buffer& k_norm,
                 float eps) override {
    return cpu_->rope_qk(q, k, heads, kv_heads, head_dim, inv_freq, q_norm, k_norm, eps);
  }
  Status kv_write(const KVLayerView& kv, const Buffer& k, const Buffer& v) override {
    return cpu_->kv_write(kv, k, v);
  }
  Status attention(const KVLayerView& kv, const Buffer& q, const Buffer& out, int heads,
                   float scale, int window) override {
    return cpu_->attention(kv, q, out, heads, scale, window);
  }
  Status swiglu(const Buffer& gate_up, const Buffer& y, int rows, int dim) override {
    return cpu_->swiglu(gate_up, y, rows, dim);
  }
  Status gather_logit_rows(const Buffer& x, const Buffer& y, int dim) override {
    return cpu_->gather_logit_rows(x, y, dim);
  }
  Status moe_route(const Buffer& logits, const Buffer& bias, const MoeRoute& r, const Buffer& ids,
                   const Buffer& weights, int rows, float* margin) override {
    return cpu_->moe_route(logits, bias, r, ids, weights, rows, margin);
  }
  Status moe_experts(const Buffer& x, const Buffer& ids, const Buffer& weights, const MoeExperts& e,
                     const Buffer& out, int rows) override {
    return cpu_->moe_experts(x, ids, weights, e, out, rows);
  }
  Status rmsnorm_across(Collective& comm, const Buffer& x, const Buffer& w, int rows, int dim,
                        int total_dim, float eps) override {
    return cpu_->rmsnorm_across(comm, x, w, rows, dim, total_dim, eps);
  }

  Status all_reduce(Collective& comm, const Buffer& x) override {
    return cpu_->all_reduce(comm, x);
  }
  Status all_gather_columns(Collective& comm, const Buffer& local, const Buffer& scratch,
                            const Buffer& out, int rows, int cols) override {
    return cpu_->all_gather_columns(comm, local, scratch, out, rows, cols);
  }
  Status synchronize() override { return cpu_->synchronize(); }

 private:
  std::shared_ptr<Device> cpu_ = make_cpu_device();
  int fail_from_, ms_;
  int steps_ = 0;
};

std::unique_ptr<Model> model_on(const std::string& dir, std::shared_ptr<Device> dev) {
  auto m = Model::load(dir, 0, 1, std::move(dev));
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  return std::move(*m);
}
}  // namespace

TEST_CASE("engine: a failing step ends in-flight requests with an error and refuses new ones") {
  Fixture fx;
  auto m = model_on(fx.dir.path(), std::make_shared<DeviceFaultsForTest>(20, 0));
  const int V = m->config().vocab_size;
  auto eng = Engine::start(std::move(m), std::make_shared<LocalCollective>(), {});
  REQUIRE(eng.ok());
  auto r = generate_blocking(**eng, prompt_of(8, 1, V), greedy(100), 20000);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.find("injected: the device failed at step 20") != std::string::npos);
  auto st = (*eng)->stats();
  CHECK(st.failed);
  auto again = (*eng)->submit({prompt_of(8, 1, V), greedy(4), [](const TokenEvent&) {}});
  REQUIRE_FALSE(again.ok());
  CHECK(again.error().message.find("engine failed") != std::string::npos);
}

TEST_CASE("engine: stats show how long the running step has taken (stall detection)") {
  Fixture fx;
  auto m = model_on(fx.dir.path(), std::make_shared<DeviceFaultsForTest>(0, 80));
  const int V = m->config().vocab_size;
  auto eng = Engine::start(std::move(m), std::make_shared<LocalCollective>(), {});
  REQUIRE(eng.ok());
  CHECK((*eng)->stats().step_running_ms == 0);
  std::atomic<bool> done{false};
  std::thread t([&] {
    (void)generate_blocking(**eng, prompt_of(4, 1, V), greedy(2), 20000);
    done = true;
  });
  int64_t seen = 0;
  for (int i = 0; i < 2000 && !done; ++i) {
    seen = std::max(seen, (*eng)->stats().step_running_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  t.join();
  CHECK(seen >= 50);  // each step's begin_step sleeps 80 ms
  // The result is handed over from inside the last step, which then ends on the engine
  // thread: back to 0 once it has (a slow machine or qemu widens that gap to 200 ms), and
  // never if the age were not reset.
  bool idle = false;
  for (int i = 0; i < 500 && !idle; ++i) {
    idle = (*eng)->stats().step_running_ms == 0;
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(idle);
}

TEST_CASE("engine: a KV budget holds as many blocks as the plan's bytes per token allow") {
  Fixture fx;
  auto model = fx.model();
  const auto& c = model->config();
  // The plan (core/model_plan.h) for this model on one rank, fp32 K and V.
  const uint64_t per_token = plan::kv_bytes_per_token_per_rank(
      plan::dense_attention_shape(c.num_layers, c.num_kv_heads, c.head_dim),
      {plan::KvLayout::native, "fp32"}, {1, 1});
  EngineOptions o;
  o.slots = 64;
  o.max_context = c.max_position;
  o.block_size = 16;
  o.kv_cache_bytes = per_token * 16 * 7 + per_token * 15;  // 7 whole blocks and a bit
  auto e = Engine::start(std::move(model), std::make_shared<LocalCollective>(), o);
  REQUIRE_MESSAGE(e.ok(), (e.ok() ? std::string() : e.error().message));
  CHECK((*e)->stats().blocks_total == 7);
  (*e)->stop();
}
