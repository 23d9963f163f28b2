// status --history's rendering (cli/history_view.h): sparklines and the events named in a
// history (reboot, gap, throttle, state change).
#include "cli/history_view.h"

#include <doctest/doctest.h>

using namespace spark;

TEST_CASE("history view: sparkline scales to the range and leaves unknowns blank") {
  CHECK(cli::sparkline({0, 1, 2, 3, 4, 5, 6, 7}, 8) == "▁▂▃▄▅▆▇█");
  CHECK(cli::sparkline({5, -1, 5}, 3) == "▄ ▄");
  CHECK(cli::sparkline({1, 1, 9, 9}, 2) == "▁█");  // two samples per column
  CHECK(cli::sparkline({}, 10).empty());
}

TEST_CASE("history view: reboot, gap, throttle and state changes are events") {
  std::vector<HealthSample> s(5);
  for (size_t k = 0; k < s.size(); ++k) {
    s[k].seq = k + 1;
    s[k].time_ms = 1'700'000'000'000 + static_cast<int64_t>(k) * 10'000;
    s[k].boot_id = "aaaaaaaa-0000-0000-0000-000000000000";
    s[k].state = 2;
    s[k].ranks_alive = 3;
    s[k].throttle_reasons = 0;
  }
  s[2].throttle_reasons = 0x4 | 0x1;  // power cap
  s[2].sm_clock_mhz = 900;
  s[3].time_ms += 120'000;  // a gap
  s[4].time_ms += 200'000;
  s[4].boot_id = "bbbbbbbb-0000-0000-0000-000000000000";
  s[4].state = 1;
  auto ev = cli::history_events(s, 10'000);
  auto has = [&](const char* w) {
    for (const auto& e : ev)
      if (e.find(w) != std::string::npos) return true;
    return false;
  };
  CHECK(has("THROTTLE: sw_power_cap (SM 900 MHz"));
  CHECK(has("GAP of 130 s"));
  CHECK(has("REBOOT: new boot id bbbbbbbb"));
  CHECK(has("ready -> loading"));
  CHECK_FALSE(has("LOST"));
  auto text = cli::render_history({{0, "spark-a", s, ""}}, 10'000, 20);
  CHECK(text.find("rank 0 on spark-a: 5 samples") != std::string::npos);
  CHECK(text.find("MemAvailable  n/a") != std::string::npos);
}
