#pragma once
// Redaction of secrets from text that leaves a node (diagnostics bundles): API keys, tokens,
// passwords, bearer credentials, URL passwords, and values of settings named like a secret.
// A redacted secret reads "[REDACTED]" so a reader sees that something was there.
#include <string>
#include <string_view>
#include <vector>

namespace spark {

/// What a redacted secret is replaced with.
inline constexpr std::string_view kRedacted = "[REDACTED]";

/// True for a setting or variable name that holds a secret: one of its '_'/'-' separated
/// words is KEY, APIKEY, TOKEN, SECRET, PASSWORD, PASSWD, PASS, PASSPHRASE, CREDENTIAL(S),
/// AUTH or BEARER (case-insensitive), unless the last word says it names a file or
/// directory (API_KEY_FILE holds a path, not the key) or it is a key of the cluster file
/// that takes a choice, a number, a size or a duration (METRICS_AUTH is a mode).
bool is_secret_name(std::string_view name);

/// The secrets that `text` (a command line, a cluster file value) spells out: values of
/// NAME=VALUE with a secret name, of --api-key/--token/--password style options, of
/// "Authorization: Bearer X" / "Bearer X", passwords in URLs (scheme://user:PASS@host), and
/// well-known token shapes (hf_..., sk-..., ghp_..., xox?-...). Each at least 6 characters.
std::vector<std::string> find_secrets(std::string_view text);

/// `text` with every secret find_secrets sees and every one of `known` (at least 4
/// characters; shorter ones would blank ordinary words) replaced by kRedacted.
std::string redact(std::string_view text, const std::vector<std::string>& known = {});

}  // namespace spark
