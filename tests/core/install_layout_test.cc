// Where sparkctl finds sparkd: the installed prefix (bin/../sbin) first, then beside itself,
// then the build tree; and the node-side lookup that a node without the head's path uses.
#include "core/install_layout.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include "core/process.h"
#include "support/tempdir.h"

using spark::test::TempDir;

namespace {
std::string exe(const TempDir& d, const std::string& name) {
  std::string p = d.write(name, "#!/bin/sh\necho sparkd-ran \"$@\"\n");
  ::chmod(p.c_str(), 0755);
  return p;
}
spark::ProcessResult sh(const std::string& script, const std::string& path) {
  auto spec = spark::shell_spec(script);
  spec.env = {{"PATH", path}};
  auto r = spark::run_process(spec);
  REQUIRE(r);
  return *r;
}
}  // namespace

TEST_CASE("install layout: an installed sparkctl finds PREFIX/sbin/sparkd, not PATH") {
  TempDir d("spark-layout");
  std::string self = d / "usr/bin/sparkctl";
  d.write("usr/bin/sparkctl", "");
  CHECK(spark::locate_sparkd(self).empty());  // nothing installed yet
  exe(d, "usr/daemon/sparkd");
  CHECK(spark::locate_sparkd(self) == d / "usr/bin/../daemon/sparkd");  // build tree
  exe(d, "usr/bin/sparkd");
  CHECK(spark::locate_sparkd(self) == d / "usr/bin/sparkd");  // beside
  std::string sbin = exe(d, "usr/sbin/sparkd");
  CHECK(spark::locate_sparkd(self) == d / "usr/bin/../sbin/sparkd");  // the installed prefix
  // A file that is not executable is not a sparkd.
  ::chmod(sbin.c_str(), 0644);
  CHECK(spark::locate_sparkd(self) == d / "usr/bin/sparkd");
}

TEST_CASE("install layout: the node-side lookup falls back to the node's own sparkd") {
  TempDir d("spark-layout");
  std::string bin = exe(d, "bin/sparkd");
  std::string run = " && exec \"$B\" --version";
  // The head's path exists on the node: used as is.
  auto a = sh(spark::sparkd_shell_lookup(bin, false) + run, "/usr/bin:/bin");
  CHECK_MESSAGE(a.out == "sparkd-ran --version\n", (a.out + a.err));
  // The head's path is missing on the node: the node's PATH (cron's PATH has no sbin, the
  // lookup adds it, but here the tool is on the given PATH).
  auto b = sh(spark::sparkd_shell_lookup(d / "nowhere/sparkd", false) + run,
              d / "bin" + ":/usr/bin:/bin");
  CHECK_MESSAGE(b.out == "sparkd-ran --version\n", (b.out + b.err));
  // Nowhere at all: a fatal line naming what was tried, not "exec: sparkd: not found".
  auto c = sh(spark::sparkd_shell_lookup(d / "nowhere/sparkd", false) + run, "/usr/bin:/bin");
  if (c.out.find("sparkd-ran") == std::string::npos) {  // a sparkd installed on this machine
    CHECK(c.exit_status == 1);
    CHECK_MESSAGE(c.out.find("@@fatal x sparkd not found on this node") != std::string::npos,
                  c.out);
    CHECK(c.out.find(d / "nowhere/sparkd") != std::string::npos);
  }
  // SPARKD_BIN named explicitly: no fallback, the key is named.
  auto e = sh(spark::sparkd_shell_lookup(d / "nowhere/sparkd", true) + run,
              d / "bin" + ":/usr/bin:/bin");
  CHECK(e.exit_status == 1);
  CHECK_MESSAGE(e.out.find("@@fatal x SPARKD_BIN") != std::string::npos, e.out);
}
