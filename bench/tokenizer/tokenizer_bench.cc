// Tokenizer throughput, ours against Hugging Face `tokenizers` in the same run.
//   spark_tokenizer_bench [--tokenizer FILE] [--mb N] [--reps N] [--json] [--no-hf]
//                         [--hf node|python]
// Documents: tools/tokenizer/corpus (many scripts, code, emoji) repeated to --mb MB and cut
// into ~4 KiB documents, encoded one call each on one thread, then decoded. The HF side
// runs bench/tokenizer/bench_hf.js under node (needs `npm ci` in tools/tokenizer) on the
// same documents (--hf python: bench/tokenizer/bench_hf.py with the Python library, on
// machines that have it); both sides must produce the same ids (FNV-1a hash) or the run
// fails. Build with -DCMAKE_BUILD_TYPE=Release for meaningful numbers.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/strings.h"
#include "daemon/tokenizer/tokenizer.h"

using namespace spark;
using nlohmann::json;

namespace {
struct Row {
  std::string name;
  double encode_s = 0, decode_s = 0;
  uint64_t tokens = 0;
  std::string hash;
};

std::vector<std::string> make_docs(const std::string& src, double mb) {
  std::string train = read_file(src + "/tools/tokenizer/corpus/train.txt").value_or("");
  json extra =
      json::parse(read_file(src + "/tools/tokenizer/corpus/test_corpus.json").value_or("[]"));
  std::string base = train;
  for (const auto& s : extra) base += s.get<std::string>() + "\n";
  std::vector<std::string> docs;
  size_t target = static_cast<size_t>(mb * 1024 * 1024), total = 0;
  std::string cur;
  size_t pos = 0;
  while (total < target && !base.empty()) {
    size_t nl = base.find('\n', pos);
    std::string line = base.substr(pos, nl == std::string::npos ? std::string::npos : nl + 1 - pos);
    pos = nl == std::string::npos ? 0 : nl + 1;
    if (pos >= base.size()) pos = 0;
    cur += line;
    if (cur.size() >= 4096) {
      total += cur.size();
      docs.push_back(std::move(cur));
      cur.clear();
    }
  }
  return docs;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  std::string src = SPARK_SOURCE_DIR;
  std::string file = src + "/tests/fixtures/tokenizer/tokenizer.json";
  double mb = 4;
  int reps = 3;
  bool as_json = false, hf = true;
  std::string hf_kind = "node";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc)
      file = argv[++i];
    else if (a == "--mb" && i + 1 < argc)
      mb = std::atof(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--json")
      as_json = true;
    else if (a == "--no-hf")
      hf = false;
    else if (a == "--hf" && i + 1 < argc)
      hf_kind = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: %s [--tokenizer FILE] [--mb N] [--reps N] [--json] [--no-hf] [--hf "
                   "node|python]\n",
                   argv[0]);
      return 2;
    }
  }
  file = std::filesystem::absolute(file).string();  // the HF side runs in another directory
  auto tok = tok::Tokenizer::from_file(file);
  if (!tok) {
    std::fprintf(stderr, "error: %s\n", tok.error().message.c_str());
    return 1;
  }
  auto docs = make_docs(src, mb);
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();

  Row ours{"sparkctl (C++, PCRE2)", 0, 0, 0, ""};
  std::vector<std::vector<tok::TokenId>> ids(docs.size());
  std::vector<double> enc, dec;
  for (int r = 0; r <= reps; ++r) {  // round 0 warms up (caches), like the HF side
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < docs.size(); ++i) ids[i] = tok->encode(docs[i], false);
    auto t1 = std::chrono::steady_clock::now();
    size_t sink = 0;
    for (const auto& x : ids) sink += tok->decode(x, false).size();
    auto t2 = std::chrono::steady_clock::now();
    // NFC normalization may change a few bytes (the corpus has NFD text); a large
    // difference means decoding is broken.
    if (sink + 64 < bytes || sink > bytes + 64) {
      std::fprintf(stderr, "error: decode(encode(docs)) has %zu bytes, docs have %zu\n", sink,
                   bytes);
      return 1;
    }
    if (r == 0) continue;
    enc.push_back(std::chrono::duration<double>(t1 - t0).count());
    dec.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  ours.encode_s = median(enc);
  ours.decode_s = median(dec);
  uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& x : ids)
    for (auto id : x) {
      ++ours.tokens;
      h ^= static_cast<uint64_t>(id);
      h *= 0x100000001b3ull;
    }
  ours.hash = fmt::format("{:x}", h);

  std::vector<Row> rows{ours};
  std::string hf_note;
  if (hf) {
    std::string runner = hf_kind == "python" ? "python3 '" + src + "/bench/tokenizer/bench_hf.py'"
                                             : "node '" + src + "/bench/tokenizer/bench_hf.js'";
    std::string docs_file = fmt::format("/tmp/spark-tokbench-{}.json", getpid());
    std::string why;
    if (!write_file_atomic(docs_file, json(docs).dump(), &why)) {
      std::fprintf(stderr, "error: %s\n", why.c_str());
      return 1;
    }
    // The npm package is installed once, in tools/tokenizer (beside the fixture generator).
    std::string cmd = fmt::format(
        "cd '{0}/tools/tokenizer' && NODE_PATH='{0}/tools/tokenizer/node_modules' timeout 600 {1} "
        "'{2}' '{3}' {4} 2>&1",
        src, runner, file, docs_file, reps);
    std::string out;
    if (FILE* p = popen(cmd.c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
      int rc = pclose(p);
      if (rc != 0) hf_note = "HF side failed (run `npm ci` in tools/tokenizer): " + out;
    }
    unlink(docs_file.c_str());
    if (hf_note.empty()) {
      try {
        json j = json::parse(out.substr(out.rfind('{')));
        rows.push_back({j["library"], j["encode_s"], j["decode_s"], j["tokens"], j["ids_fnv1a"]});
      } catch (const std::exception& e) {
        hf_note = std::string("HF side printed no result: ") + out;
      }
    }
  }
  bool agree = rows.size() < 2 || rows[1].hash == rows[0].hash;
  double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
  if (as_json) {
    json j;
    j["tokenizer"] = file;
    j["documents"] = docs.size();
    j["bytes"] = bytes;
    j["reps"] = reps;
    j["ids_agree"] = agree;
    if (!hf_note.empty()) j["hf_note"] = hf_note;
    for (const auto& r : rows)
      j["results"].push_back({{"name", r.name},
                              {"encode_mib_s", mib / r.encode_s},
                              {"encode_tokens_s", r.tokens / r.encode_s},
                              {"decode_mib_s", mib / r.decode_s},
                              {"decode_tokens_s", r.tokens / r.decode_s},
                              {"tokens", r.tokens},
                              {"ids_fnv1a", r.hash}});
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("# tokenizer %s\n# %zu documents, %.2f MiB, median of %d runs, one thread\n",
                file.c_str(), docs.size(), mib, reps);
    std::printf("# %-32s %12s %14s %12s %14s %10s\n", "implementation", "enc MiB/s", "enc tokens/s",
                "dec MiB/s", "dec tokens/s", "tokens");
    for (const auto& r : rows)
      std::printf("  %-32s %12.2f %14.0f %12.2f %14.0f %10llu\n", r.name.c_str(), mib / r.encode_s,
                  r.tokens / r.encode_s, mib / r.decode_s, r.tokens / r.decode_s,
                  static_cast<unsigned long long>(r.tokens));
    for (const auto& line : split_list(hf_note, '\n')) std::printf("# %s\n", line.c_str());
    std::printf("# ids agree with HF: %s\n", rows.size() < 2 ? "n/a" : agree ? "yes" : "NO");
  }
  return agree ? 0 : 1;
}
