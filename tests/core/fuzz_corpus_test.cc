// Replays the fuzz seed corpus of the config parser in the unit tier (and so under ASan in
// CI): an input that once crashed fuzz_config goes into tests/fuzz/corpus/fuzz_config/ and
// stays a regression test here, without needing the clang fuzz build.
#include <doctest/doctest.h>

#include <filesystem>

#include "core/config.h"
#include "core/strings.h"

using namespace spark;

TEST_CASE("fuzz corpus: every fuzz_config seed loads or fails with a config error") {
  int n = 0;
  for (const auto& e :
       std::filesystem::directory_iterator(SPARK_SOURCE_DIR "/tests/fuzz/corpus/fuzz_config")) {
    auto data = read_file(e.path().string());
    REQUIRE(data.has_value());
    std::string_view text(*data);
    Environment env;
    if (auto nul = text.find('\0'); nul != std::string_view::npos) {
      for (const auto& line : split_list(text.substr(nul + 1), '\n'))
        if (auto eq = line.find('='); eq != std::string::npos)
          env.vars[line.substr(0, eq)] = line.substr(eq + 1);
      text = text.substr(0, nul);
    }
    INFO(e.path().filename().string());
    std::vector<Diagnostic> d;
    auto cfg = load_config_text(text, "corpus.env", env, &d);
    if (!cfg.ok()) CHECK(cfg.error().code == Errc::config);
    ++n;
  }
  CHECK(n >= 5);
}

TEST_CASE("fuzz corpus: the seeds cover success and failure") {
  std::vector<Diagnostic> d;
  auto ok = load_config(SPARK_SOURCE_DIR "/tests/fuzz/corpus/fuzz_config/twins-crlf.env",
                        Environment{}, &d);
  CHECK(ok.ok());
  auto bad =
      load_config(SPARK_SOURCE_DIR "/tests/fuzz/corpus/fuzz_config/errors.env", Environment{}, &d);
  CHECK_FALSE(bad.ok());
}
