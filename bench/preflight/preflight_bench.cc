// Benchmark: a 4-node preflight (no ping, no bandwidth) against four network-namespace nodes
// running sshd on this machine must finish in under 2 s of wall time. Prints a
// table (non-data lines start with '#') and one JSON line; exits 1 when the median is over
// the limit or a node did not report.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "support/ring.h"

using namespace spark;
using namespace spark::test;

int main(int argc, char** argv) {
  int nodes = 4, runs = 5;
  double limit_s = 2.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--nodes") nodes = std::clamp(std::atoi(argv[i + 1]), 2, 8);
    if (a == "--runs") runs = std::clamp(std::atoi(argv[i + 1]), 1, 50);
  }
  if (auto why = ring_unavailable_reason(); !why.empty()) {
    std::cout << "# SKIP: " << why << "\n";
    return 0;
  }
  auto t_setup = std::chrono::steady_clock::now();
  auto ring =
      TestRing::create({.nodes = nodes, .links = 2, .mtu = 9000, .sparkctl_bin = SPARKCTL_BIN});
  if (!ring) {
    std::cerr << "setup failed: " << ring.error().message << "\n";
    return 2;
  }
  double setup_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_setup).count();
  std::cout << fmt::format(
      "# sparkctl preflight --skip net.path: {} namespace nodes (sshd), 2 twins each, "
      "{} runs; ring set up in {:.2f} s\n",
      nodes, runs, setup_s);
  std::cout << fmt::format("# {:>3} {:>8} {:>10} {:>6} {:>6} {:>6} {:>6}\n", "run", "wall_s",
                           "report_s", "nodes", "PASS", "WARN", "FAIL");
  std::vector<double> walls;
  bool all_reported = true;
  nlohmann::json rows = nlohmann::json::array();
  for (int r = 0; r < runs; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    auto p = (*ring)->sparkctl("preflight --skip net.path --json", std::chrono::seconds(30));
    double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!p) {
      std::cerr << "run failed: " << p.error().message << "\n";
      return 2;
    }
    auto j = nlohmann::json::parse(p->out, nullptr, false);
    int reported = j.is_object() ? static_cast<int>(j["nodes"].size()) : 0;
    auto cnt_fail = [](const nlohmann::json& x) { return x.is_object() ? x["counts"].value("FAIL", 1) : 1; };
    if (reported != nodes || cnt_fail(j) != 0) {
      all_reported = false;
      std::cerr << p->out << p->err;
    }
    auto cnt = [&](const char* k) { return j.is_object() ? j["counts"].value(k, 0) : 0; };
    double rep_s = j.is_object() ? j.value("seconds", 0.0) : 0.0;
    std::cout << fmt::format("  {:>3} {:>8.3f} {:>10.3f} {:>6} {:>6} {:>6} {:>6}\n", r, wall, rep_s,
                             reported, cnt("PASS"), cnt("WARN"), cnt("FAIL"));
    walls.push_back(wall);
    rows.push_back({{"run", r},
                    {"wall_s", wall},
                    {"report_s", rep_s},
                    {"nodes", reported},
                    {"fail", cnt("FAIL")}});
  }
  auto sorted = walls;
  std::sort(sorted.begin(), sorted.end());
  double median = sorted[sorted.size() / 2], worst = sorted.back();
  bool ok = all_reported && median < limit_s;
  std::cout << fmt::format("# median {:.3f} s, worst {:.3f} s, limit {:.1f} s: {}\n", median, worst,
                           limit_s, ok ? "OK" : "OVER LIMIT, MISSING NODES OR FAILED CHECKS");
  std::cout << nlohmann::json{{"bench", "preflight"},
                              {"nodes", nodes},
                              {"runs", rows},
                              {"median_s", median},
                              {"worst_s", worst},
                              {"limit_s", limit_s},
                              {"ok", ok}}
                   .dump()
            << "\n";
  return ok ? 0 : 1;
}
