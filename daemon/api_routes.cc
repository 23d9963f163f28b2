#include "daemon/api_routes.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <ctime>
#include <utility>

#include "core/json_text.h"
#include "core/log.h"
#include "daemon/http_server.h"
#include "daemon/metrics.h"
#include "daemon/openai/errors.h"
#include "daemon/openai/responses.h"
#include "daemon/openai/session.h"
#include "daemon/openai/structured.h"

namespace spark::daemon {

namespace {
constexpr const char* kComp = "api";
using openai::ApiError;

Response api_error(const ApiError& e) {
  Response r;
  r.status = e.status;
  r.body = dump_json(openai::error_body(e));
  return r;
}

ApiError not_loaded() {
  ApiError e;
  e.status = 503;
  e.type = "server_error";
  e.message = "the model is not loaded yet; retry when GET /health says ready";
  return e;
}

ApiError client_gone() {
  ApiError e;
  e.status = 499;
  e.type = "client_closed_request";
  e.message = "the client closed the connection";
  return e;
}

engine::SamplingParams to_engine(const openai::Sampling& s, int max_tokens,
                                 const std::set<int32_t>& stop_ids) {
  engine::SamplingParams p;
  p.temperature = static_cast<float>(s.temperature);
  p.top_k = s.top_k > 0 ? s.top_k : 0;
  p.top_p = static_cast<float>(s.top_p);
  p.min_p = static_cast<float>(s.min_p);
  p.repetition_penalty = static_cast<float>(s.repetition_penalty);
  p.presence_penalty = static_cast<float>(s.presence_penalty);
  p.frequency_penalty = static_cast<float>(s.frequency_penalty);
  p.seed = s.seed;
  p.max_tokens = max_tokens;
  p.n = s.n;
  p.logprobs = s.logprobs;
  p.top_logprobs = s.top_logprobs;
  p.prompt_logprobs = s.prompt_logprobs;
  p.stop_token_ids.assign(stop_ids.begin(), stop_ids.end());
  for (auto id : s.stop_token_ids) p.stop_token_ids.push_back(id);
  p.ignore_eos = s.ignore_eos;
  return p;
}

// One request between the engine (events on its thread) and the connection.
struct Pending {
  std::mutex mu;
  std::shared_ptr<const ApiModel> model;
  std::unique_ptr<openai::CompletionWriter> resp;
  Responder http;
  bool streaming = false;
  int n = 1;
  std::optional<int> max_tokens;  // as the client set it, for /metrics
  bool logprobs = false;          // asked for: a token of probability 1 has logprob 0 and counts
  std::vector<int32_t> prompt;    // echo with logprobs: the prompt ids its scores are for
  engine::RequestId id = 0;
  bool engine_done = false;  // the engine sent request_done
  bool replied = false;      // the response is complete (or abandoned)
  bool cancel_sent = false;
  std::string what;  // "chat completion" / "completion", for logs
  using Clock = std::chrono::steady_clock;
  Clock::time_point t0 = Clock::now(), first{}, last{};
  std::string finish0;  // choice 0's finish reason, for the metrics label
  // Per choice, for the per-sequence histograms: engine times, first/last token, recorded.
  struct ChoiceTimes {
    Clock::time_point submitted{}, scheduled{}, first{}, last{};
    int prompt = 0, generated = 0;
    bool recorded = false;
  };
  std::vector<ChoiceTimes> choices;
  std::shared_ptr<ApiState> state;
  uint64_t token = 0;  // in state's registry while in flight

  explicit Pending(Responder h) : http(std::move(h)) {}

  static double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  // Latencies of a completed request into /metrics.
  void record(const std::string& outcome) {
    Metrics* m = model->metrics;
    if (!m) return;
    auto now = Clock::now();
    m->inc("sparkd_request_success_total", 1, {{"finished_reason", outcome}});
    m->observe("sparkd_e2e_request_latency_seconds", secs(now - t0));
    // The request's parameters, as vLLM records a finished request's.
    m->observe("sparkd_request_params_n", n);
    if (max_tokens) m->observe("sparkd_request_params_max_tokens", *max_tokens);
  }
  void on_token() {
    auto now = Clock::now();
    if (Metrics* m = model->metrics) {
      if (first == Clock::time_point{})
        m->observe("sparkd_time_to_first_token_seconds", secs(now - t0));
      else
        m->observe("sparkd_time_per_output_token_seconds", secs(now - last));
    }
    if (first == Clock::time_point{}) first = now;
    last = now;
  }

  // A choice the client got whole (finish reason sent): its phases into /metrics, as vLLM
  // records a finished request (each of n choices is one there).
  void record_choice(ChoiceTimes& t) {
    Metrics* m = model->metrics;
    if (!m || t.recorded || t.scheduled == Clock::time_point{}) return;
    t.recorded = true;
    m->observe("sparkd_request_prompt_tokens", t.prompt);
    m->observe("sparkd_request_generation_tokens", t.generated);
    if (t.submitted != Clock::time_point{})
      m->observe("sparkd_request_queue_time_seconds", secs(t.scheduled - t.submitted));
    if (t.first == Clock::time_point{}) return;
    m->observe("sparkd_request_prefill_time_seconds", secs(t.first - t.scheduled));
    m->observe("sparkd_request_decode_time_seconds", secs(t.last - t.first));
    m->observe("sparkd_request_inference_time_seconds", secs(t.last - t.scheduled));
    if (t.generated > 1)
      m->observe("sparkd_request_time_per_output_token_seconds",
                 secs(t.last - t.first) / (t.generated - 1));
  }

  void cancel_locked() {
    if (cancel_sent || engine_done || id == 0) return;
    cancel_sent = true;
    model->engine->cancel(id);
  }

  // Marks the response complete and leaves the registry.
  void complete() {
    replied = true;
    if (token) state->remove_request(token);
    token = 0;
  }

  // The memory guard's cancel: answer 503 now and free the slot.
  bool cancel_for(const std::string& reason) {
    std::lock_guard lk(mu);
    if (replied) return false;
    ApiError e;
    e.status = 503;
    e.type = "server_error";
    e.code = "memory_pressure";
    e.message = reason;
    complete();
    cancel_locked();
    record("abort");
    if (streaming) {
      http.write(openai::sse_event(openai::error_body(e)));
      http.end_stream();
    } else {
      http.send(api_error(e));
    }
    return true;
  }

  void on_event(const engine::TokenEvent& ev) {
    std::lock_guard lk(mu);
    if (ev.request_done) engine_done = true;
    if (replied) return;
    if (http.closed()) {
      // The client went away (a failed write while streaming; for a plain response, when the
      // HTTP layer notices the closed connection): free the slot now.
      log::info(kComp, "{} {}: client disconnected; cancelling", what, ev.request);
      complete();
      cancel_locked();
      record("abort");
      // Let the HTTP session finish the request (the write fails on the closed socket).
      if (streaming)
        http.end_stream();
      else
        http.send(api_error(client_gone()));
      return;
    }
    if (ev.finish == engine::FinishReason::error || ev.finish == engine::FinishReason::cancelled) {
      ApiError e;
      e.status = ev.finish == engine::FinishReason::error ? 500 : 503;
      e.type = "server_error";
      e.message = ev.finish == engine::FinishReason::error
                      ? "generation failed: " + ev.error
                      : "the request was cancelled (the engine is stopping)";
      complete();
      cancel_locked();
      record(ev.finish == engine::FinishReason::error ? "error" : "abort");
      if (streaming) {
        http.write(openai::sse_event(openai::error_body(e)));
        http.end_stream();
      } else {
        http.send(api_error(e));
      }
      return;
    }
    std::string out;
    const int c = ev.choice;
    if (c >= 0 && static_cast<size_t>(c) >= choices.size())
      choices.resize(static_cast<size_t>(c) + 1);
    ChoiceTimes& ct = choices.at(static_cast<size_t>(c));
    if (ev.scheduled != Clock::time_point{}) {
      ct.submitted = ev.submitted;
      ct.scheduled = ev.scheduled;
    }
    ct.prompt = ev.prompt_tokens;
    if (c == 0) resp->cached_tokens(ev.cached_prompt_tokens);
    if (ev.has_prompt_logprobs) {
      std::vector<openai::TokenLogprobs> scored;
      for (const auto& smp : ev.prompt_logprobs) {
        openai::TokenLogprobs t{smp.token, smp.logprob, {}};
        for (const auto& a : smp.top) t.top.emplace_back(a.token, a.logprob);
        scored.push_back(std::move(t));
      }
      out += resp->prompt_logprobs(c, prompt, scored);
    }
    if (ev.token >= 0 && !resp->finished(c)) {
      if (c == 0) on_token();
      const auto now = Clock::now();
      if (ct.first == Clock::time_point{}) ct.first = now;
      ct.last = now;
      ct.generated = ev.completion_tokens;
      std::optional<openai::TokenLogprobs> lp;
      if (logprobs || ev.top_logprobs.size()) {
        openai::TokenLogprobs t{ev.token, ev.logprob, {}};
        for (const auto& a : ev.top_logprobs) t.top.emplace_back(a.token, a.logprob);
        lp = std::move(t);
      }
      out += resp->token(c, ev.token, lp);
    }
    if (ev.finish != engine::FinishReason::none && !resp->finished(c))
      out += resp->finish(c, engine::finish_reason_name(ev.finish));
    if (resp->finished(c)) record_choice(ct);
    bool all = true;
    for (int i = 0; i < n; ++i) all = all && resp->finished(i);
    if (ev.finish != engine::FinishReason::none && c == 0 && finish0.empty())
      finish0 = engine::finish_reason_name(ev.finish);
    if (all) {
      out += resp->done();
      complete();
      cancel_locked();  // a stop string ended it before the engine did
      record(finish0.empty() ? "stop" : finish0);
    }
    if (streaming) {
      if (!out.empty()) http.write(std::move(out));
      if (all) http.end_stream();
    } else if (all) {
      Response r;
      r.body = std::move(out);
      http.send(std::move(r));
    }
  }
};

template <typename Req>
void run_generation(const std::shared_ptr<ApiState>& state,
                    const std::shared_ptr<const ApiModel>& m, const Req& req,
                    const openai::PreparedPrompt& p, std::unique_ptr<openai::CompletionWriter> resp,
                    Responder http, const char* what,
                    std::shared_ptr<const grammar::Constraint> constraint = nullptr) {
  if (m->admit) {
    Status st = m->admit();
    if (!st.ok()) {
      ApiError e = openai::from_error(st.error());
      e.status = 503;
      return http.send(api_error(e));
    }
  }
  auto pend = std::make_shared<Pending>(http);
  pend->model = m;
  pend->state = state;
  pend->streaming = resp->streaming();
  pend->n = req.sampling.n;
  pend->max_tokens = req.sampling.max_tokens;
  pend->logprobs = req.sampling.logprobs;
  pend->what = what;
  pend->resp = std::move(resp);
  engine::GenerateRequest g;
  g.prompt = p.ids;
  g.params = to_engine(req.sampling, p.max_tokens, m->stop_token_ids);
  if (g.params.prompt_logprobs >= 0) pend->prompt = p.ids;
  g.params.constraint = std::move(constraint);
  g.on_event = [pend](const engine::TokenEvent& ev) { pend->on_event(ev); };
  std::lock_guard lk(pend->mu);  // events wait until the id is known
  auto id = m->engine->submit(std::move(g));
  if (!id) {
    pend->replied = true;  // never registered
    http.send(api_error(openai::from_error(id.error())));
    return;
  }
  pend->id = *id;
  pend->token = state->add_request([w = std::weak_ptr<Pending>(pend)](const std::string& why) {
    auto pending = w.lock();
    return pending && pending->cancel_for(why);
  });
  if (pend->streaming) {
    http.begin_stream(200, pend->resp->content_type());
    std::string first = pend->resp->start();
    if (!first.empty()) http.write(std::move(first));
  }
}

ApiError context_exceeded(int max_context, int64_t counted, size_t bytes, const char* param) {
  return openai::context_exceeded(max_context, counted, bytes, param, param);
}

void chat(const std::shared_ptr<ApiState>& state, const std::shared_ptr<const ApiModel>& m,
          const std::string& body, Responder http) {
  auto r = openai::parse_chat_request(body, m->limits);
  if (!r.ok()) return http.send(api_error(r.error));
  openai::ChatRequest& req = *r.value;
  if (auto e = openai::check_model(req.model, m->model)) return http.send(api_error(*e));
  {
    std::vector<std::string_view> texts;
    size_t bytes = 0;
    for (const auto& msg : req.messages) {
      texts.push_back(msg.content);
      bytes += msg.content.size();
    }
    int64_t counted = 0;
    if (exceeds_context(m->tokenizer, texts, m->max_context, &counted))
      return http.send(api_error(context_exceeded(m->max_context, counted, bytes, "messages")));
  }
  if (m->escape_special) tok::escape_special_tokens(req.messages, m->tokenizer);
  // The render stops when its client has gone (a closed connection, also what shutdown does
  // to requests past the grace).
  auto p = openai::prepare_chat(req, m->tokenizer, m->chat_format, m->max_context,
                                [http] { return http.closed(); });
  if (!p.ok()) return http.send(api_error(p.error));
  auto constraint = openai::output_constraint(
      req, m->chat_format, m->token_trie, m->tool_token_trie,
      std::vector<int32_t>(m->stop_token_ids.begin(), m->stop_token_ids.end()));
  if (!constraint.ok()) return http.send(api_error(constraint.error));
  auto resp = std::make_unique<openai::CompletionWriter>(
      req, m->tokenizer, m->chat_format, m->model, static_cast<int>(p.value->ids.size()),
      m->stop_token_ids);
  run_generation(state, m, req, *p.value, std::move(resp), std::move(http), "chat completion",
                 *constraint.value);
}

void completion(const std::shared_ptr<ApiState>& state, const std::shared_ptr<const ApiModel>& m,
                const std::string& body, Responder http) {
  auto r = openai::parse_completion_request(body, m->limits);
  if (!r.ok()) return http.send(api_error(r.error));
  const openai::CompletionRequest& req = *r.value;
  if (auto e = openai::check_model(req.model, m->model)) return http.send(api_error(*e));
  if (const auto* text = std::get_if<std::string>(&req.prompt)) {
    int64_t counted = 0;
    if (exceeds_context(m->tokenizer, {*text}, m->max_context, &counted))
      return http.send(
          api_error(context_exceeded(m->max_context, counted, text->size(), "prompt")));
  }
  auto p = openai::prepare_completion(req, m->tokenizer, m->max_context);
  if (!p.ok()) return http.send(api_error(p.error));
  auto resp = std::make_unique<openai::CompletionWriter>(req, m->tokenizer, m->model,
                                                         static_cast<int>(p.value->ids.size()),
                                                         m->stop_token_ids, p.value->text);
  run_generation(state, m, req, *p.value, std::move(resp), std::move(http), "completion");
}

Response tokenize(const ApiModel& m, const std::string& body, const Responder& http) {
  auto r = openai::parse_tokenize_request(body, m.limits);
  if (!r.ok()) return api_error(r.error);
  if (auto e = openai::check_model(r.value->model, m.model)) return api_error(*e);
  std::vector<int32_t> ids;
  // As on the generation routes: text that cannot fit the context is refused after counting
  // about the context's worth of it, never tokenized whole.
  auto too_long = [&](const std::string& text, const char* param,
                      const char* what) -> std::optional<ApiError> {
    int64_t counted = 0;
    if (exceeds_context(m.tokenizer, {text}, m.max_context, &counted))
      return openai::context_exceeded(m.max_context, counted, text.size(), param, what);
    return std::nullopt;
  };
  if (r.value->prompt) {
    if (auto e = too_long(*r.value->prompt, "prompt", "prompt")) return api_error(*e);
    ids = m.tokenizer.encode(*r.value->prompt, r.value->add_special_tokens);
  } else {
    // What the model would see: message content escaped as a chat completion escapes it.
    auto messages = r.value->messages;
    if (m.escape_special) tok::escape_special_tokens(messages, m.tokenizer);
    auto text = tok::render_chat(m.chat_format, messages, tok::Json::array(),
                                 r.value->add_generation_prompt, r.value->chat_template_kwargs,
                                 [http] { return http.closed(); });
    if (!text) return api_error(openai::from_error(text.error(), "messages"));
    if (auto e = too_long(*text, "messages", "rendered chat template")) return api_error(*e);
    ids = m.tokenizer.encode(*text, false);
  }
  Response out;
  out.body = openai::tokenize_response(ids, m.max_context, r.value->return_token_strs, m.tokenizer)
                 .dump(-1, ' ', false, tok::Json::error_handler_t::replace);
  return out;
}

Response detokenize(const ApiModel& m, const std::string& body) {
  auto r = openai::parse_detokenize_request(body, m.limits);
  if (!r.ok()) return api_error(r.error);
  if (auto e = openai::check_model(r.value->model, m.model)) return api_error(*e);
  for (auto id : r.value->tokens)
    if (id < 0 || static_cast<size_t>(id) >= m.tokenizer.vocab_size())
      return api_error(openai::invalid_request(
          "'tokens' holds id " + std::to_string(id) + ", outside the vocabulary of " +
              std::to_string(m.tokenizer.vocab_size()) + " tokens.",
          "tokens"));
  Response out;
  out.body = openai::detokenize_response(m.tokenizer.decode(r.value->tokens, true))
                 .dump(-1, ' ', false, tok::Json::error_handler_t::replace);
  return out;
}
}  // namespace

bool exceeds_context(const tok::Tokenizer& tok, const std::vector<std::string_view>& texts,
                     int max_context, int64_t* counted) {
  return openai::exceeds_context(tok, texts, max_context, counted);
}

void ApiState::set(std::shared_ptr<const ApiModel> m) {
  std::lock_guard lk(mu_);
  model_ = std::move(m);
}
std::shared_ptr<const ApiModel> ApiState::get() const {
  std::lock_guard lk(mu_);
  return model_;
}
uint64_t ApiState::add_request(Canceller c) {
  std::lock_guard lk(mu_);
  requests_[next_token_] = std::move(c);
  return next_token_++;
}
void ApiState::remove_request(uint64_t token) {
  std::lock_guard lk(mu_);
  requests_.erase(token);
}
bool ApiState::cancel_newest(const std::string& reason) {
  for (;;) {
    Canceller c;
    {
      std::lock_guard lk(mu_);
      if (requests_.empty()) return false;
      auto it = std::prev(requests_.end());
      c = std::move(it->second);
      requests_.erase(it);
    }
    if (c && c(reason)) return true;  // else it had just finished: try the next newest
  }
}

void add_api_routes(HttpServer& server, std::shared_ptr<ApiState> state) {
  // Parsing, chat rendering and tokenizing run here, off the reactor; long bodies on a
  // worker of their own so that they queue behind each other, not in front of short ones.
  // Chat completions, whose checkpoint's template is untrusted work, render on lanes of
  // their own: a slow render (bounded by its budget, stopped when its client goes) can
  // hold up other chats, never completions, /tokenize or /detokenize.
  using Pool = boost::asio::thread_pool;
  auto pool = std::make_shared<Pool>(2);
  auto long_pool = std::make_shared<Pool>(1);
  auto chat_pool = std::make_shared<Pool>(2);
  auto chat_long_pool = std::make_shared<Pool>(1);
  auto lanes = [state](std::shared_ptr<Pool> short_lane, std::shared_ptr<Pool> long_lane, auto fn) {
    return [state, short_lane, long_lane, fn](const Request& req, Responder http) {
      auto& lane = req.body.size() > kLongBody ? *long_lane : *short_lane;
      boost::asio::post(lane, [state, fn, body = req.body, http]() mutable {
        auto m = state->get();
        if (!m || !m->engine) return http.send(api_error(not_loaded()));
        try {
          fn(state, m, body, http);
        } catch (const std::bad_alloc&) {
          log::error(kComp, "out of memory while preparing a request");
          ApiError err = openai::invalid_request(
              "the request needs more memory than sparkd can give it; make it smaller", "");
          http.send(api_error(err));
        } catch (const std::exception& e) {
          log::error(kComp, "unhandled exception: {}", e.what());
          ApiError err;
          err.status = 500;
          err.type = "server_error";
          err.message = std::string("internal error: ") + e.what();
          http.send(api_error(err));
        }
      });
    };
  };
  auto offload = [lanes, pool, long_pool](auto fn) { return lanes(pool, long_pool, fn); };
  server.route("GET", "/v1/models", [state](const Request&) {
    auto m = state->get();
    if (!m) return api_error(not_loaded());
    Response r;
    r.body = dump_json(openai::models_list(m->model, m->created, m->max_context));
    return r;
  });
  server.route("GET", "/v1/models/*", [state](const Request& req) {
    auto m = state->get();
    if (!m) return api_error(not_loaded());
    const std::string id = req.path.substr(std::string_view("/v1/models/").size());
    if (id != m->model) {
      ApiError e;
      e.status = 404;
      e.type = "NotFoundError";
      e.param = "model";
      e.message = "The model `" + id + "` does not exist.";
      return api_error(e);
    }
    Response r;
    r.body = dump_json(openai::models_list(m->model, m->created, m->max_context)["data"][0]);
    return r;
  });
  server.route_async(
      "POST", "/v1/chat/completions",
      lanes(chat_pool, chat_long_pool,
            [](const std::shared_ptr<ApiState>& st, const std::shared_ptr<const ApiModel>& m,
               const std::string& b, Responder h) { chat(st, m, b, std::move(h)); }));
  server.route_async(
      "POST", "/v1/completions",
      offload([](const std::shared_ptr<ApiState>& st, const std::shared_ptr<const ApiModel>& m,
                 const std::string& b, Responder h) { completion(st, m, b, std::move(h)); }));
  server.route_async(
      "POST", "/tokenize",
      offload([](const std::shared_ptr<ApiState>&, const std::shared_ptr<const ApiModel>& m,
                 const std::string& b, Responder h) { h.send(tokenize(*m, b, h)); }));
  server.route_async(
      "POST", "/detokenize",
      offload([](const std::shared_ptr<ApiState>&, const std::shared_ptr<const ApiModel>& m,
                 const std::string& b, Responder h) { h.send(detokenize(*m, b)); }));
}

}  // namespace spark::daemon
