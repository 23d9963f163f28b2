// The strict value parsers behind the cluster file, and the small string helpers.
#include "core/strings.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <string>

#include "support/tempdir.h"

using namespace spark;

TEST_CASE("strings: trim, split_list, join") {
  CHECK(trim("  a b \t\r\n") == "a b");
  CHECK(trim("").empty());
  CHECK(split_list(" a, b ,,c ,") == std::vector<std::string>{"a", "b", "c"});
  CHECK(split_list("").empty());
  CHECK(split_list("x|y", '|') == std::vector<std::string>{"x", "y"});
  CHECK(join({"a", "b", "c"}, ", ") == "a, b, c");
  CHECK(join({}, ",").empty());
}

TEST_CASE("strings: did_you_mean picks the closest name within a small distance") {
  std::vector<std::string> names = {"API_PORT", "RDZV_PORT", "MODEL_PATH"};
  CHECK(did_you_mean("API_PROT", names) == "API_PORT");
  CHECK(did_you_mean("MODEL_PTH", names) == "MODEL_PATH");
  CHECK(did_you_mean("COMPLETELY_DIFFERENT", names).empty());
  CHECK(edit_distance("kitten", "sitting") == 3);
}

TEST_CASE("strings: parse_u64 and parse_i64 are strict") {
  CHECK(parse_u64("0") == 0u);
  CHECK(parse_u64("18446744073709551615") == 18446744073709551615ull);
  CHECK_FALSE(parse_u64("18446744073709551616"));
  CHECK_FALSE(parse_u64(""));
  CHECK_FALSE(parse_u64("+1"));
  CHECK_FALSE(parse_u64("-1"));
  CHECK_FALSE(parse_u64(" 1"));
  CHECK_FALSE(parse_u64("1 "));
  CHECK_FALSE(parse_u64("0x10"));
  CHECK_FALSE(parse_u64("1e3"));
  CHECK(parse_i64("-5") == -5);
  CHECK(parse_i64("9223372036854775807") == 9223372036854775807LL);
  CHECK_FALSE(parse_i64("9223372036854775808"));
  CHECK_FALSE(parse_i64("-"));
  CHECK_FALSE(parse_i64("--1"));
}

TEST_CASE("strings: sizes take binary and decimal units, strictly") {
  std::string why;
  CHECK(parse_size("110GiB", &why) == 110ull << 30);
  CHECK(parse_size("512MiB", &why) == 512ull << 20);
  CHECK(parse_size("4KiB", &why) == 4096u);
  CHECK(parse_size("1TiB", &why) == 1ull << 40);
  CHECK(parse_size("2GB", &why) == 2000000000u);
  CHECK(parse_size("3KB", &why) == 3000u);
  CHECK(parse_size("4096", &why) == 4096u);
  CHECK(parse_size("7B", &why) == 7u);
  CHECK(parse_size("0", &why) == 0u);
  CHECK(parse_size("1.5GiB", &why) == 1610612736u);
  CHECK(parse_size("0.5KiB", &why) == 512u);

  auto refused = [](const char* s) {
    std::string w;
    auto v = parse_size(s, &w);
    INFO(s);
    CHECK_FALSE(v.has_value());
    CHECK_FALSE(w.empty());
    return w;
  };
  CHECK(refused("110G").find("unknown size unit 'G'") != std::string::npos);
  CHECK(refused("110 GiB").find("unknown size unit ' GiB'") != std::string::npos);
  CHECK(refused("1.5B").find("not a whole number of bytes") != std::string::npos);
  CHECK(refused("1.5").find("not a whole number of bytes") != std::string::npos);
  CHECK(refused("-1").find("not a size") != std::string::npos);
  refused("");
  refused("GiB");
  refused("1.GiB");
  refused(".5GiB");
  refused("1..5GiB");
  refused("1,5GiB");
  refused("110gib");
  refused("110GiB ");
  refused("+1");
  refused("1e9");
  CHECK(refused("99999999999TiB").find("too large") != std::string::npos);
  CHECK(refused("20000000000000000000").find("too large") != std::string::npos);
  // More digits than a double can hold: refused, never an exception.
  std::string huge(400, '9');
  CHECK(refused(huge.c_str()).find("too large") != std::string::npos);
  CHECK_FALSE(parse_size("x", nullptr));  // *why is optional
}

TEST_CASE("strings: durations") {
  std::string why;
  CHECK(parse_duration_ms("30s", &why) == 30000u);
  CHECK(parse_duration_ms("30", &why) == 30000u);
  CHECK(parse_duration_ms("250ms", &why) == 250u);
  CHECK(parse_duration_ms("5m", &why) == 300000u);
  CHECK(parse_duration_ms("5min", &why) == 300000u);
  CHECK(parse_duration_ms("2h", &why) == 7200000u);
  CHECK(parse_duration_ms("1d", &why) == 86400000u);
  CHECK(parse_duration_ms("1.5m", &why) == 90000u);
  CHECK(parse_duration_ms("0.25s", &why) == 250u);
  for (const char* bad : {"", "5 s", "5x", "-5s", "0.5ms", "s", "1e3s", "5S"}) {
    INFO(bad);
    std::string w;
    CHECK_FALSE(parse_duration_ms(bad, &w).has_value());
    CHECK_FALSE(w.empty());
  }
  std::string huge(400, '9');
  CHECK_FALSE(parse_duration_ms(huge + "d", &why).has_value());
}

TEST_CASE("strings: IPv4 dotted quads only") {
  CHECK(parse_ipv4("10.10.2.1") == 0x0A0A0201u);
  CHECK(parse_ipv4("0.0.0.0") == 0u);
  CHECK(parse_ipv4("255.255.255.255") == 0xFFFFFFFFu);
  CHECK(format_ipv4(0x0A0A0201u) == "10.10.2.1");
  for (const char* bad :
       {"", "10.10.2", "10.10.2.1.5", "256.1.1.1", "10.10.2.01", "10.10.2.1 ", " 10.10.2.1",
        "10.10..1", "1.2.3.-4", "a.b.c.d", "10.10.2.1/24", "::1", "1234.1.1.1", "10.10.2.1:22"}) {
    INFO(bad);
    CHECK_FALSE(parse_ipv4(bad).has_value());
  }
}

TEST_CASE("strings: format_size and to_hex") {
  CHECK(format_size(512) == "512 B");
  CHECK(format_size(1536) == "1.50 KiB");
  CHECK(format_size(110ull << 30) == "110.00 GiB");
  unsigned char b[] = {0x00, 0xab, 0xff};
  CHECK(to_hex(b, 3) == "00abff");
}

TEST_CASE("strings: write_file_atomic replaces whole files and leaves no temp file") {
  test::TempDir dir;
  auto p = dir / "f.txt";
  std::string why;
  REQUIRE(write_file_atomic(p, "first", &why));
  REQUIRE(write_file_atomic(p, "second", &why));
  CHECK(read_file(p) == std::string("second"));
  CHECK_FALSE(read_file(p + ".tmp." + std::to_string(::getpid())).has_value());
  // A directory that does not exist: a clear error, and nothing written.
  CHECK_FALSE(write_file_atomic(dir / "no/such/dir/f", "x", &why));
  CHECK(why.find("cannot create") != std::string::npos);
  CHECK_FALSE(read_file(dir / "missing").has_value());
}
