#pragma once
// Structured outputs for chat completions: response_format json_object / json_schema and a
// forced tool_choice ("required" or a named function) turned into the grammar the engine's
// sampler masks every draw with (daemon/grammar). The tool-call grammar writes the call in
// the chat format's own syntax (the one daemon/tokenizer/tool_calls parses back).
#include <memory>
#include <string>
#include <vector>

#include "daemon/grammar/json_grammar.h"
#include "daemon/openai/requests.h"
#include "daemon/tokenizer/chat.h"
#include "daemon/tokenizer/tokenizer.h"

namespace spark::openai {

/// The vocabulary trie of a tokenizer for output constraints: every id's bytes, special ids
/// left out (with `call_markers`, but for the tool-call markers the chat formats write as
/// special tokens: a tool-call grammar needs their text), and `end_ids` (the ids that end a
/// turn) as the grammar's end; ids from `vocab_limit` on (a tokenizer larger than the
/// model's embedding) are left out.
std::shared_ptr<const grammar::TokenTrie> make_token_trie(const tok::Tokenizer& tok,
                                                          const std::vector<int32_t>& end_ids,
                                                          size_t vocab_limit,
                                                          bool call_markers = false);

/// The constraint a chat request asks for, or null when it asks for none (text output,
/// tool_choice none or auto). An unsupported schema keyword, a tool-call syntax this
/// server does not know, or a tokenizer whose tokens are not bytes: a 400 naming it.
/// `trie` serves response_format, `tool_trie` (with the call markers) forced tool calls.
ApiResult<std::shared_ptr<const grammar::Constraint>> output_constraint(
    const ChatRequest& req, const tok::ChatFormat& fmt,
    const std::shared_ptr<const grammar::TokenTrie>& trie,
    const std::shared_ptr<const grammar::TokenTrie>& tool_trie);

}  // namespace spark::openai
