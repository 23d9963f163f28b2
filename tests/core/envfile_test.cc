// The .env syntax of the cluster file: every rule of core/envfile.h, and errors at
// file:line:col.
#include "core/envfile.h"

#include <doctest/doctest.h>

#include "support/tempdir.h"

using namespace spark;

namespace {

std::vector<EnvEntry> parse_ok(std::string_view text) {
  auto r = parse_env_text(text, "t.env");
  INFO(text);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  return r.value();
}

std::string parse_err(std::string_view text) {
  auto r = parse_env_text(text, "t.env");
  INFO(text);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::config);
  return r.error().message;
}

}  // namespace

TEST_CASE("envfile: plain assignments keep order, key, value and line") {
  auto e = parse_ok("A=1\nB_2=two words\n_c=x\n");
  REQUIRE(e.size() == 3);
  CHECK(e[0].key == "A");
  CHECK(e[0].value == "1");
  CHECK(e[0].line == 1);
  CHECK(e[0].file == "t.env");
  CHECK(e[1].key == "B_2");
  CHECK(e[1].value == "two words");
  CHECK(e[2].key == "_c");
  CHECK(e[2].line == 3);
}

TEST_CASE("envfile: comments and blank lines are skipped but counted") {
  auto e = parse_ok("# heading\n\n   # indented comment\n\t\nA=1 # trailing comment\nB=x#y\n");
  REQUIRE(e.size() == 2);
  CHECK(e[0].line == 5);
  CHECK(e[0].value == "1");
  // '#' only starts a comment after whitespace: x#y is a value (URL fragments, etc.).
  CHECK(e[1].value == "x#y");
  CHECK(e[1].line == 6);
}

TEST_CASE("envfile: empty values and surrounding whitespace") {
  auto e = parse_ok("A=\nB=   \nC=  v  \n  D=4\n");
  REQUIRE(e.size() == 4);
  CHECK(e[0].value.empty());
  CHECK(e[1].value.empty());
  CHECK(e[2].value == "v");
  CHECK(e[3].key == "D");
}

TEST_CASE("envfile: single quotes are literal") {
  auto e = parse_ok("A='a \"b\" \\n $HOME # not a comment'\nB=''\n");
  REQUIRE(e.size() == 2);
  CHECK(e[0].value == "a \"b\" \\n $HOME # not a comment");
  CHECK(e[1].value.empty());
}

TEST_CASE("envfile: double quotes take \\\" \\\\ \\n \\t \\$ escapes") {
  auto e = parse_ok(R"(A="q\" b\\ n\n t\t d\$ # kept"  # comment)"
                    "\nB=\"\"\n");
  REQUIRE(e.size() == 2);
  CHECK(e[0].value == "q\" b\\ n\n t\t d$ # kept");
  CHECK(e[1].value.empty());
}

TEST_CASE("envfile: no variable expansion") {
  auto e = parse_ok("A=$HOME/x\nB=\"${USER}\"\n");
  CHECK(e[0].value == "$HOME/x");
  CHECK(e[1].value == "${USER}");
}

TEST_CASE("envfile: the export prefix is tolerated") {
  auto e = parse_ok("export A=1\nexport\tB=2\n  export   C='3'\nexportD=4\n");
  REQUIRE(e.size() == 4);
  CHECK(e[0].key == "A");
  CHECK(e[1].key == "B");
  CHECK(e[2].value == "3");
  CHECK(e[3].key == "exportD");  // no space: part of the key
}

TEST_CASE("envfile: CRLF line ends, a missing final newline and a UTF-8 BOM") {
  auto e = parse_ok(
      "\xEF\xBB\xBF"
      "A=1\r\nB='two'\r\n# c\r\nC=\"3\"");
  REQUIRE(e.size() == 3);
  CHECK(e[0].key == "A");
  CHECK(e[0].value == "1");
  CHECK(e[1].value == "two");
  CHECK(e[2].value == "3");
  CHECK(e[2].line == 4);
}

TEST_CASE("envfile: empty input and comment-only input give no entries") {
  CHECK(parse_ok("").empty());
  CHECK(parse_ok("\n\n# only\n").empty());
}

TEST_CASE("envfile: syntax errors name file:line:col and the key") {
  CHECK(parse_err("A=1\nB = 2\n").rfind("t.env:2:2: no spaces allowed around '=' after B", 0) == 0);
  CHECK(parse_err("A=1\n\n1A=2\n").rfind("t.env:3:1: expected KEY=VALUE", 0) == 0);
  CHECK(parse_err("  -A=2\n").rfind("t.env:1:3:", 0) == 0);
  CHECK(parse_err("JUSTAKEY\n").rfind("t.env:1:9: expected '=' after key JUSTAKEY", 0) == 0);
  CHECK(parse_err("A.B=1\n").rfind("t.env:1:2: expected '=' after key A", 0) == 0);
  CHECK(parse_err("A='open\n").rfind("t.env:1:3: unterminated single quote in value of A", 0) == 0);
  CHECK(
      parse_err("X=1\nA=\"open\n").rfind("t.env:2:3: unterminated double quote in value of A", 0) ==
      0);
  CHECK(parse_err("A=\"ends in backslash\\\"\n").find("unterminated double quote") !=
        std::string::npos);
  CHECK(parse_err("A=\"bad \\q\"\n").rfind("t.env:1:8: unknown escape '\\q' in value of A", 0) ==
        0);
  CHECK(parse_err("A=it's\n").rfind("t.env:1:5: quote inside an unquoted value of A", 0) == 0);
  CHECK(parse_err("A='x' y\n").rfind("t.env:1:7: unexpected text after the value of A", 0) == 0);
  CHECK(parse_err("A=\"x\"y\n").rfind("t.env:1:6: unexpected text after the value of A", 0) == 0);
}

TEST_CASE("envfile: a CRLF file reports the same columns as an LF file") {
  CHECK(parse_err("A=1\r\nB = 2\r\n").rfind("t.env:2:2:", 0) == 0);
}

TEST_CASE("envfile: values may hold any byte but a newline") {
  std::string text = "A=caf\xC3\xA9\nB='\x01\x7f'\n";
  auto e = parse_ok(text);
  CHECK(e[0].value == "caf\xC3\xA9");
  CHECK(e[1].value == "\x01\x7f");
}

TEST_CASE("envfile: parse_env_file reads a file and names it in errors") {
  test::TempDir dir;
  auto good = dir.write("good.env", "A=1\n");
  auto bad = dir.write("bad.env", "A=1\nB='\n");
  auto e = parse_env_file(good);
  REQUIRE(e.ok());
  CHECK(e->at(0).file == good);
  auto b = parse_env_file(bad);
  REQUIRE_FALSE(b.ok());
  CHECK(b.error().message.rfind(bad + ":2:3:", 0) == 0);
  auto missing = parse_env_file(dir / "missing.env");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == Errc::not_found);
  CHECK(missing.error().message.find("missing.env") != std::string::npos);
}
