// Redaction of secrets (core/redact.h): names, command-line shapes, token shapes, known values.
#include "core/redact.h"

#include <doctest/doctest.h>

#include "core/base64.h"

using namespace spark;

TEST_CASE("redact: secret names, but not paths to secrets or token counts") {
  CHECK(is_secret_name("HF_TOKEN"));
  CHECK(is_secret_name("OPENAI_API_KEY"));
  CHECK(is_secret_name("db-password"));
  CHECK(is_secret_name("AWS_SECRET_ACCESS_KEY"));
  CHECK(is_secret_name("apikey"));
  CHECK(is_secret_name("hftoken"));
  CHECK_FALSE(is_secret_name("API_KEY_FILE"));
  CHECK_FALSE(is_secret_name("CHAT_SPECIAL_TOKENS"));
  CHECK_FALSE(is_secret_name("MODEL_PATH"));
  CHECK_FALSE(is_secret_name("MAX_TOKENS"));
  CHECK_FALSE(is_secret_name("MONKEY"));
  // The cluster file's settings are not secrets, whatever words they hold.
  CHECK_FALSE(is_secret_name("METRICS_AUTH"));
  CHECK_FALSE(is_secret_name("TEMPLATE_MAX_STEPS"));
  CHECK(is_secret_name("BASIC_AUTH"));
}

TEST_CASE("redact: the secrets command lines and logs spell out") {
  std::string cmd =
      "HF_TOKEN=hf_abcdefghijklmnopqrstu vllm serve /m --api-key s3cr3t-value "
      "--hf-token=tok123456 --max-tokens 4096 && curl -H 'Authorization: Bearer "
      "bear-123456789' https://user:p4ssw0rd99@hooks.example.com/x";
  auto s = redact(cmd);
  CHECK(s.find("hf_abcdefghijklmnopqrstu") == std::string::npos);
  CHECK(s.find("s3cr3t-value") == std::string::npos);
  CHECK(s.find("tok123456") == std::string::npos);
  CHECK(s.find("bear-123456789") == std::string::npos);
  CHECK(s.find("p4ssw0rd99") == std::string::npos);
  // What is not secret stays readable.
  CHECK(s.find("--max-tokens 4096") != std::string::npos);
  CHECK(s.find("vllm serve /m") != std::string::npos);
  CHECK(s.find("hooks.example.com") != std::string::npos);
  CHECK(s.find("[REDACTED]") != std::string::npos);
  // Token shapes anywhere, and values given by name in a log line.
  auto log =
      redact("loaded sk-abcdefghijklmnop0123 and xoxb-1234567890-abc; password: hunter2hunter");
  CHECK(log.find("sk-abcdefghijklmnop0123") == std::string::npos);
  CHECK(log.find("xoxb-1234567890-abc") == std::string::npos);
  CHECK(log.find("hunter2hunter") == std::string::npos);
  // Known values (the API key read from its file) wherever they appear.
  CHECK(redact("the key is plainkeyvalue here", {"plainkeyvalue"}) == "the key is [REDACTED] here");
  // A known value too short to be a secret is not blanked everywhere.
  CHECK(redact("a b c", {"b"}) == "a b c");
}

TEST_CASE("base64: round trip of every byte value and the padding cases") {
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{256}}) {
    auto part = all.substr(0, n);
    auto dec = base64_decode(base64_encode(part));
    REQUIRE(dec);
    CHECK(*dec == part);
  }
  CHECK(base64_encode("ab") == "YWI=");
  CHECK_FALSE(base64_decode("abc"));
  CHECK_FALSE(base64_decode("@@@@"));
}
