// spark_chat_render MODEL_DIR [CHAT_FORMAT] < jobs.json: loads a checkpoint's tokenizer and
// chat format as sparkd does and answers each job through the real request parser:
//   {"request": {chat request body}}            -> {"text", "ids"} or {"error"}
//   {"request": {...}, "output": "model text"}  -> {"response": chat completion body}: the
//       output is encoded and fed token by token to a CompletionWriter (tool-call parsing included)
// Prints {"family", "source", "object_arguments", "null_content", "stop_tokens", "results"}.
// Used by the chat template reference tier (tests/scripts/chat_template_reference_test.sh).
#include <cstdio>
#include <iostream>
#include <iterator>

#include "daemon/openai/session.h"

using namespace spark;
using namespace spark::openai;

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [CHAT_FORMAT] < jobs.json\n", argv[0]);
    return 2;
  }
  std::string dir = argv[1];
  auto tok = tok::Tokenizer::from_file(dir + "/tokenizer.json");
  if (!tok) {
    std::fprintf(stderr, "%s\n", tok.error().message.c_str());
    return 1;
  }
  auto cfg = tok::load_tokenizer_config(dir);
  if (!cfg) {
    std::fprintf(stderr, "%s\n", cfg.error().message.c_str());
    return 1;
  }
  auto fmt = tok::choose_chat_format(argc > 2 ? argv[2] : "", *cfg, "", &*tok);
  if (!fmt) {
    std::fprintf(stderr, "%s\n", fmt.error().message.c_str());
    return 1;
  }
  std::string in((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  Json jobs = Json::parse(in, nullptr, false);
  if (jobs.is_discarded() || !jobs.is_array()) {
    std::fprintf(stderr, "stdin: expected a JSON array of jobs\n");
    return 2;
  }
  std::set<int32_t> stops;
  for (const auto& s : fmt->stop_tokens())
    if (auto id = tok->token_to_id(s)) stops.insert(*id);
  Limits limits;
  const int context = 1 << 20;
  Json results = Json::array();
  for (const auto& job : jobs) {
    Json r = Json::object();
    auto req = parse_chat_request(job["request"].dump(), limits);
    if (!req.ok()) {
      r["error"] = req.error.message;
      results.push_back(r);
      continue;
    }
    auto p = prepare_chat(*req.value, *tok, *fmt, context);
    if (!p.ok()) {
      r["error"] = p.error.message;
      results.push_back(r);
      continue;
    }
    if (job.contains("output")) {
      CompletionWriter resp(*req.value, *tok, *fmt, "m", static_cast<int>(p.value->ids.size()), stops);
      for (int32_t id : tok->encode(job["output"].get<std::string>(), false)) resp.token(0, id);
      r["response"] = Json::parse(resp.done());
    } else {
      r["text"] = p.value->text;
      r["ids"] = p.value->ids;
    }
    results.push_back(r);
  }
  Json out = Json::object();
  out["family"] = std::string(tok::chat_family_name(fmt->family));
  out["source"] = fmt->source;
  out["object_arguments"] = fmt->chat_template ? fmt->chat_template->object_arguments : true;
  out["null_content"] = fmt->chat_template ? fmt->chat_template->null_content : true;
  out["stop_tokens"] = fmt->stop_tokens();
  out["results"] = results;
  std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
  return 0;
}
