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
/// model's embedding) are left out. With `harmony`, gpt-oss's structural markers
/// (<|start|>, <|end|>, <|message|>, <|channel|>, <|constrain|>) are in it as
/// harmony_marker() spells them.
std::shared_ptr<const grammar::TokenTrie> make_token_trie(const tok::Tokenizer& tok,
                                                          const std::vector<int32_t>& end_ids,
                                                          size_t vocab_limit,
                                                          bool call_markers = false,
                                                          bool harmony = false);
/// A harmony marker's bytes in a harmony trie: ESC before its text. No JSON value holds a
/// control byte, so a grammar's JSON never takes a marker token, and typed text that looks
/// like a marker is not one.
std::string harmony_marker(const std::string& text);

/// The constraint a chat request asks for, or null when it asks for none (text output,
/// tool_choice none or auto). An unsupported schema keyword, a tool-call syntax this
/// server does not know, or a tokenizer whose tokens are not bytes: a 400 naming it.
/// `trie` serves response_format, `tool_trie` (with the call markers) forced tool calls.
/// gpt-oss's harmony format (both tries made with `harmony`; `trie` ending at <|return|>,
/// `tool_trie` at <|call|>): a response format applies from the final channel's header on,
/// the analysis before it free (Constraint::gate); a forced call, on the commentary channel
/// to functions.NAME with its JSON arguments, comes first or after an analysis message
/// (Constraint::opening).
/// `stop_ids`: the ids that end generation (none of them is drawn before a gate).
ApiResult<std::shared_ptr<const grammar::Constraint>> output_constraint(
    const ChatRequest& req, const tok::ChatFormat& fmt,
    const std::shared_ptr<const grammar::TokenTrie>& trie,
    const std::shared_ptr<const grammar::TokenTrie>& tool_trie,
    const std::vector<int32_t>& stop_ids = {});

}  // namespace spark::openai
