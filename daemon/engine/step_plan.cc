#include "daemon/engine/step_plan.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>

namespace spark::engine {

static_assert(std::endian::native == std::endian::little,
              "the step plan is written in the host's byte order, little-endian on every "
              "supported host");

namespace {

constexpr uint32_t kMagic = 0x4e4c5053;  // "SPLN"
constexpr uint32_t kVersion =
    4;  // 2: prompt_logprobs in the parameters; 3: rank0_draws; 4: ring, write_from
// Bounds a damaged plan cannot exceed (a prompt is at most the context, which is far less).
constexpr uint32_t kMaxItems = 1u << 24;

class Writer {
 public:
  template <class T>
  void put(T v) {
    const size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
  }
  void ints(const std::vector<int32_t>& v) {
    put(static_cast<uint32_t>(v.size()));
    const size_t at = out.size();
    out.resize(at + v.size() * sizeof(int32_t));
    if (!v.empty()) std::memcpy(out.data() + at, v.data(), v.size() * sizeof(int32_t));
  }
  std::string out;
};

class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  template <class T>
  Status get(T* v, const char* what) {
    if (b_.size() - at_ < sizeof(T)) return short_of(what);
    std::memcpy(v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::Ok();
  }
  Status count(uint32_t* n, const char* what) {
    SPARK_TRY(get(n, what));
    if (*n > kMaxItems)
      return make_error(Errc::integrity, fmt::format("step plan: {} count {} at offset {} is "
                                                     "beyond the limit {}",
                                                     what, *n, at_ - 4, kMaxItems));
    return Status::Ok();
  }
  Status ints(std::vector<int32_t>* v, const char* what) {
    uint32_t n = 0;
    SPARK_TRY(count(&n, what));
    if ((b_.size() - at_) / sizeof(int32_t) < n) return short_of(what);
    v->resize(n);
    if (n) std::memcpy(v->data(), b_.data() + at_, n * sizeof(int32_t));
    at_ += n * sizeof(int32_t);
    return Status::Ok();
  }
  size_t at() const { return at_; }
  size_t size() const { return b_.size(); }

 private:
  Status short_of(const char* what) const {
    return make_error(Errc::integrity,
                      fmt::format("step plan: truncated at offset {} of {} bytes (reading {})", at_,
                                  b_.size(), what));
  }
  std::string_view b_;
  size_t at_ = 0;
};

void put_params(Writer& w, const SamplingParams& p) {
  w.put(p.temperature);
  w.put(static_cast<int32_t>(p.top_k));
  w.put(p.top_p);
  w.put(p.min_p);
  w.put(p.repetition_penalty);
  w.put(p.presence_penalty);
  w.put(p.frequency_penalty);
  w.put(p.seed.value_or(0));
  w.put(static_cast<int32_t>(p.max_tokens));
  w.put(static_cast<int32_t>(p.n));
  w.put(static_cast<uint8_t>(p.logprobs));
  w.put(static_cast<uint8_t>(p.ignore_eos));
  w.put(static_cast<int32_t>(p.top_logprobs));
  w.put(static_cast<int32_t>(p.prompt_logprobs));
  w.ints(p.stop_token_ids);
}

Status get_params(Reader& r, SamplingParams* p) {
  int32_t top_k = 0, max_tokens = 0, n = 0, top_logprobs = 0, prompt_logprobs = -1;
  uint64_t seed = 0;
  uint8_t logprobs = 0, ignore_eos = 0;
  SPARK_TRY(r.get(&p->temperature, "temperature"));
  SPARK_TRY(r.get(&top_k, "top_k"));
  SPARK_TRY(r.get(&p->top_p, "top_p"));
  SPARK_TRY(r.get(&p->min_p, "min_p"));
  SPARK_TRY(r.get(&p->repetition_penalty, "repetition_penalty"));
  SPARK_TRY(r.get(&p->presence_penalty, "presence_penalty"));
  SPARK_TRY(r.get(&p->frequency_penalty, "frequency_penalty"));
  SPARK_TRY(r.get(&seed, "seed"));
  SPARK_TRY(r.get(&max_tokens, "max_tokens"));
  SPARK_TRY(r.get(&n, "n"));
  SPARK_TRY(r.get(&logprobs, "logprobs"));
  SPARK_TRY(r.get(&ignore_eos, "ignore_eos"));
  SPARK_TRY(r.get(&top_logprobs, "top_logprobs"));
  SPARK_TRY(r.get(&prompt_logprobs, "prompt_logprobs"));
  SPARK_TRY(r.ints(&p->stop_token_ids, "stop_token_ids"));
  p->top_k = top_k;
  p->seed = seed;
  p->max_tokens = max_tokens;
  p->n = n;
  p->logprobs = logprobs != 0;
  p->ignore_eos = ignore_eos != 0;
  p->top_logprobs = top_logprobs;
  p->prompt_logprobs = prompt_logprobs;
  return Status::Ok();
}

}  // namespace

std::string encode_plan(const StepPlan& plan) {
  Writer w;
  w.out.reserve(kPlanHeaderBytes);
  w.put(kMagic);
  w.put(kVersion);
  w.put(static_cast<uint32_t>(plan.kind));
  w.put(static_cast<uint32_t>(plan.ahead ? 1 : 0));
  w.put(plan.serial);
  w.put(plan.digest_step);
  w.put(plan.digest);
  w.put(static_cast<uint32_t>(plan.cancels.size()));
  w.put(static_cast<uint32_t>(plan.admits.size()));
  for (uint64_t id : plan.cancels) w.put(id);
  for (const auto& a : plan.admits) {
    w.put(a.seq);
    w.put(a.stream);
    w.put(a.max_total);
    w.put(a.computed);
    w.ints(a.prompt);
    w.ints(a.blocks);
    w.ints(a.ring);
    w.put(a.write_from);
    put_params(w, a.params);
    w.put(static_cast<uint8_t>(a.rank0_draws ? 1 : 0));
  }
  return std::move(w.out);
}

Result<StepPlan> decode_plan(std::string_view bytes) {
  Reader r(bytes);
  uint32_t magic = 0, version = 0, kind = 0, ahead = 0, ncancel = 0, nadmit = 0;
  SPARK_TRY(r.get(&magic, "magic"));
  if (magic != kMagic)
    return make_error(Errc::integrity,
                      fmt::format("step plan: bad magic {:#010x} (expected {:#010x}): the "
                                  "control channel is out of step or not sparkd's",
                                  magic, kMagic));
  SPARK_TRY(r.get(&version, "version"));
  if (version != kVersion)
    return make_error(Errc::integrity,
                      fmt::format("step plan version {} from rank 0, this rank speaks {}: run "
                                  "the same sparkd build on every node",
                                  version, kVersion));
  StepPlan p;
  SPARK_TRY(r.get(&kind, "kind"));
  if (kind < 1 || kind > 3)
    return make_error(Errc::integrity, fmt::format("step plan: unknown kind {}", kind));
  p.kind = static_cast<PlanKind>(kind);
  SPARK_TRY(r.get(&ahead, "ahead"));
  p.ahead = ahead != 0;
  SPARK_TRY(r.get(&p.serial, "serial"));
  SPARK_TRY(r.get(&p.digest_step, "digest step"));
  SPARK_TRY(r.get(&p.digest, "digest"));
  SPARK_TRY(r.count(&ncancel, "cancel"));
  SPARK_TRY(r.count(&nadmit, "admission"));
  if ((r.size() - r.at()) / sizeof(uint64_t) < ncancel)
    return make_error(
        Errc::integrity,
        fmt::format("step plan: {} cancels do not fit in its {} bytes", ncancel, bytes.size()));
  p.cancels.resize(ncancel);
  for (auto& id : p.cancels) SPARK_TRY(r.get(&id, "cancel"));
  for (uint32_t i = 0; i < nadmit; ++i) {
    PlanAdmit a;
    SPARK_TRY(r.get(&a.seq, "admission seq"));
    SPARK_TRY(r.get(&a.stream, "admission stream"));
    SPARK_TRY(r.get(&a.max_total, "admission max_total"));
    SPARK_TRY(r.get(&a.computed, "admission computed"));
    SPARK_TRY(r.ints(&a.prompt, "admission prompt"));
    SPARK_TRY(r.ints(&a.blocks, "admission blocks"));
    SPARK_TRY(r.ints(&a.ring, "admission ring"));
    SPARK_TRY(r.get(&a.write_from, "admission write_from"));
    SPARK_TRY(get_params(r, &a.params));
    uint8_t rank0_draws = 0;
    SPARK_TRY(r.get(&rank0_draws, "admission rank0_draws"));
    if (rank0_draws > 1)
      return make_error(Errc::integrity,
                        fmt::format("step plan: admission of sequence {} has rank0_draws {} "
                                    "(0 or 1)",
                                    a.seq, rank0_draws));
    a.rank0_draws = rank0_draws != 0;
    if (a.prompt.empty() || a.computed < 0 || a.computed >= static_cast<int32_t>(a.prompt.size()) ||
        a.max_total <= static_cast<int32_t>(a.prompt.size()) - 1 || a.write_from < 0 ||
        a.write_from >= static_cast<int32_t>(a.prompt.size()))
      return make_error(Errc::integrity,
                        fmt::format("step plan: admission of sequence {} is inconsistent "
                                    "(prompt {}, computed {}, max_total {}, write_from {})",
                                    a.seq, a.prompt.size(), a.computed, a.max_total, a.write_from));
    p.admits.push_back(std::move(a));
  }
  if (r.at() != r.size())
    return make_error(Errc::integrity, fmt::format("step plan: {} bytes left over after {}",
                                                   r.size() - r.at(), r.at()));
  return p;
}

uint64_t fold_token_digest(uint64_t digest, uint64_t seq, int32_t token) {
  uint64_t z = digest ^ (seq * 0x9e3779b97f4a7c15ull + static_cast<uint32_t>(token));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace spark::engine
