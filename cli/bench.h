#pragma once
// sparkctl bench: the standard benchmark and correctness gates for one OpenAI-compatible
// endpoint (ours, vLLM, TensorFold). Every request streams (SSE) so that the time of each
// token is seen; every request has deadlines (headers, silence, whole) and a reply that is
// not what the protocol says is an error naming the request. The result is one JSON
// document (schema "sparkctl-bench/1"); `bench compare` reads several of them.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "core/remote.h"

namespace spark::cli::bench {

using json = nlohmann::json;

/// Where and how to reach the server.
struct Endpoint {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  std::string prefix = "/v1";  // the base URL's path
  std::string api_key;         // empty: no Authorization header
  std::string base;            // the base URL as given, for messages
};

/// Parses a base URL "http://host[:port][/v1]" (a missing path means /v1).
Result<Endpoint> parse_base(const std::string& url);

/// Deadlines of every request (the fault tests make them short).
struct Deadlines {
  std::chrono::milliseconds headers{120000};  // a long prefill may delay the headers
  std::chrono::milliseconds idle{60000};
  std::chrono::milliseconds total{900000};
};

/// One streamed generation, as measured.
struct Generation {
  std::string text;       // content (reasoning excluded)
  std::string reasoning;  // reasoning_content / reasoning deltas
  std::string finish_reason;
  int tokens = 0;          // usage.completion_tokens, else the content chunks counted
  int prompt_tokens = -1;  // usage.prompt_tokens (-1: not reported)
  int cached_tokens = -1;  // usage.prompt_tokens_details.cached_tokens (-1: not reported)
  bool usage_seen = false;
  double ttft = 0;        // seconds from send to the first generated text or tool call
  double total = 0;       // seconds from send to the end
  double last_token = 0;  // seconds from send to the last content chunk
  int chunks = 0;         // chunks that carried generated text
  std::vector<double> logprobs;
  json tool_calls = json::array();  // [{"name","arguments"}] assembled from the deltas
  std::string model;                // the chunks' "model"
  /// Decode tokens/s: tokens after the first over the time after the first.
  double decode_rate() const;
};

/// Sends one streaming chat request (`body` gets stream, stream_options). Stops early when
/// `cancel` turns true (Errc::resource, "cancelled"). `what` names the request in errors.
Result<Generation> generate(const Endpoint& ep, json body, const Deadlines& dl,
                            const std::string& what, const std::atomic<bool>* cancel = nullptr);

/// GET of a path under the endpoint's host (for /v1/models, /version, /health).
Result<json> get_json(const Endpoint& ep, const std::string& target,
                      std::chrono::milliseconds timeout);

/// Everything a run is told.
struct Options {
  Endpoint ep;
  std::string model;                  // empty: the first of /v1/models
  std::string label;                  // the arm's name in compare (default: model @ base)
  std::vector<std::string> sections;  // empty: all (see section_names())
  int runs = 3;
  double temperature = 0;
  bool thinking = false;
  int decode_tokens = 256;  // max_tokens of C1/C8
  int concurrency = 8;      // the C8 section's streams
  int ttft_samples = 16;    // requests of the TTFT section
  std::vector<int> prefill_sizes = {1024, 8192, 32768};
  int prefix_tokens = 8192;   // the prefix-cache section's shared prefix
  int long_tokens = 32768;    // the prefill a short request runs beside
  std::string known_answers;  // JSONL file; empty: the shipped set
  int tool_calls = 10;
  int count_to = 200;
  int thinking_max_tokens = 2048;  // max_tokens of gates with thinking on
  int gate_max_tokens = 0;         // caps every gate request's max_tokens (0: none)
  uint64_t mem_min = 2ull << 30;   // BENCH_MEM_MIN
  std::chrono::milliseconds mem_interval{5000};
  int mem_samples = 3;  // consecutive samples under mem_min that cancel the run
  Deadlines dl;
};

/// The names of the sections and gates, in run order.
const std::vector<std::string>& section_names();

/// MemAvailable of the nodes, sampled during a run (one runner per node; none: not sampled).
struct MemorySource {
  std::vector<std::unique_ptr<Runner>> runners;
  std::string why_none;  // when there are no runners
};

/// Progress lines (a terminal shows them; null: silent).
using Progress = std::function<void(const std::string&)>;

/// Runs the sections and gates. The returned document always has "ok"; an error of one
/// section is recorded in it and the run goes on (the memory guard stops it).
json run(const Options& o, MemorySource& mem, const Progress& progress);

/// The inversion check over the prefill section's sizes (ascending): a size whose median
/// tokens/s beats the last size that kept its figure is marked "noise", its figure moved to
/// "discarded_tokens_per_s" and "tokens_per_s" set to null.
void check_inversion(json& sizes);

/// The exit status a result asks for: 0, or exit_code() of the first failure (a failed
/// gate: integrity; the memory guard: resource; a section's error: its kind).
int result_exit_code(const json& result);

/// The table of one result (lines that are not data start with '#').
std::string format_table(const json& result);

/// One arm of a comparison: a result file, or a directory holding bench.json.
Result<json> load_result(const std::string& path);
/// The side-by-side table of several results (one column per arm, the best marked '*').
std::string format_compare(const std::vector<json>& results);
/// An SVG chart (grouped bars) of the main figures of several results.
std::string compare_svg(const std::vector<json>& results);
/// The (label, metric rows) the table and the chart share: each row's name, unit, whether
/// higher is better, and one value per arm (null: none).
struct Metric {
  std::string name, unit;
  bool higher_better = true;
  bool chart = false;  // one of the main figures
  std::vector<std::optional<double>> values;
};
std::vector<Metric> compare_metrics(const std::vector<json>& results);
/// The concurrent section's name from the streams each result ran ("C8", "C4/C16" when
/// arms differ; "C8" when none says).
std::string concurrency_label(const std::vector<json>& results);

/// The shipped known-answer set beside the sparkctl at `self_exe` (PREFIX/share/sparkctl/
/// bench/known-answers.jsonl, the build tree's copy); "" when not found.
std::string shipped_known_answers(const std::string& self_exe);

}  // namespace spark::cli::bench
