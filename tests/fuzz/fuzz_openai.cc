// libFuzzer target for the OpenAI layer's untrusted inputs: request bodies (chat,
// completions, tokenize, detokenize), chat rendering of what parsed, and tool-call parsing
// of arbitrary model output (harmony's channels too), whole and streamed. Invariants: parse
// errors carry a message and a 4xx status; streamed output parsing equals whole-text parsing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "daemon/openai/requests.h"
#include "daemon/tokenizer/chat.h"
#include "daemon/tokenizer/harmony.h"
#include "daemon/tokenizer/tool_calls.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}

std::string ids() {
  return "call_x";
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace spark;
  std::string_view body(reinterpret_cast<const char*>(data), size);
  openai::Limits limits;
  auto chat = openai::parse_chat_request(body, limits);
  if (chat.ok()) {
    for (auto fam : {tok::ChatFamily::llama3, tok::ChatFamily::chatml, tok::ChatFamily::mistral}) {
      auto fmt = tok::choose_chat_format(std::string(tok::chat_family_name(fam)),
                                         tok::Json::object(), "", nullptr);
      require(fmt.ok());
      auto r = tok::render_chat(*fmt, chat.value->messages, chat.value->tools, true);
      require(r.ok() || !r.error().message.empty());
    }
  } else {
    require(!chat.error.message.empty() && chat.error.status >= 400 && chat.error.status < 500);
  }
  auto comp = openai::parse_completion_request(body, limits);
  require(comp.ok() || (comp.error.status >= 400 && comp.error.status < 500));
  (void)openai::parse_tokenize_request(body, limits);
  (void)openai::parse_detokenize_request(body, limits);

  for (auto fam : {tok::ChatFamily::llama3, tok::ChatFamily::chatml, tok::ChatFamily::mistral,
                   tok::ChatFamily::deepseek}) {
    auto whole = tok::ToolCallParser::parse(fam, body, ids);
    tok::ToolCallParser p(fam, ids);
    std::string content;
    size_t calls = 0;
    for (size_t i = 0; i < body.size(); i += 3) {
      auto d = p.push(body.substr(i, 3));
      content += d.content;
      calls += d.calls.size();
    }
    auto f = p.finish();
    content += f.content;
    calls += f.calls.size();
    require(content == whole.content && calls == whole.calls.size());
  }

  auto whole = tok::HarmonyParser::parse(body, ids);
  tok::HarmonyParser h(ids);
  tok::ToolParseDelta all;
  auto merge = [&](tok::ToolParseDelta d) {
    all.content += d.content;
    all.reasoning += d.reasoning;
    for (auto& c : d.calls) {
      if (!c.fragment) {
        all.calls.push_back(std::move(c));
        continue;
      }
      require(!all.calls.empty() && all.calls.back().index == c.index);
      all.calls.back().arguments += c.arguments;
    }
  };
  for (size_t i = 0; i < body.size(); i += 3) merge(h.push(body.substr(i, 3)));
  merge(h.finish());
  require(all.content == whole.content && all.reasoning == whole.reasoning &&
          all.calls.size() == whole.calls.size());
  for (size_t i = 0; i < all.calls.size(); ++i)
    require(all.calls[i].name == whole.calls[i].name &&
            all.calls[i].arguments == whole.calls[i].arguments);
  return 0;
}
