// Where sparkctl finds sparkd: the installed prefix (bin/../sbin) first, then beside itself,
// then the build tree; and the node-side lookup that a node without the head's path uses.
#include "core/install_layout.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include "support/tempdir.h"

using spark::test::TempDir;

namespace {
std::string exe(const TempDir& d, const std::string& name) {
  std::string p = d.write(name, "#!/bin/sh\necho sparkd-ran \"$@\"\n");
  ::chmod(p.c_str(), 0755);
  return p;
}
}  // namespace

TEST_CASE("install layout: an installed sparkctl finds PREFIX/sbin/sparkd, not PATH") {
  TempDir d("spark-layout");
  std::string self = d / "usr/bin/sparkctl";
  d.write("usr/bin/sparkctl", "");
  CHECK(spark::locate_sparkd(self).empty());  // nothing installed yet
  exe(d, "usr/daemon/sparkd");
  CHECK(spark::locate_sparkd(self) == d / "usr/daemon/sparkd");  // build tree
  exe(d, "usr/bin/sparkd");
  CHECK(spark::locate_sparkd(self) == d / "usr/bin/sparkd");  // beside
  std::string sbin = exe(d, "usr/sbin/sparkd");
  CHECK(spark::locate_sparkd(self) == d / "usr/sbin/sparkd");  // the installed prefix
  // A file that is not executable is not a sparkd.
  ::chmod(sbin.c_str(), 0644);
  CHECK(spark::locate_sparkd(self) == d / "usr/bin/sparkd");
}

TEST_CASE("install layout: a node without the head's path runs its own sparkd") {
  TempDir d("spark-layout");
  std::string bin = exe(d, "bin/sparkd");
  std::string tried;
  // The head's path exists on the node: used as is.
  CHECK(spark::node_sparkd(bin, false, "", &tried) == bin);
  // Missing here: this node's install, found from its own sparkctl (PREFIX/bin/sparkctl).
  std::string own = exe(d, "usr/sbin/sparkd");
  CHECK(spark::node_sparkd(d / "nowhere/sparkd", false, d / "usr/bin/sparkctl", &tried) ==
        d / "usr/sbin/sparkd");
  CHECK(tried.find(d / "nowhere/sparkd") != std::string::npos);
  // SPARKD_BIN named it: no fallback, "" so the caller names the key.
  CHECK(spark::node_sparkd(d / "nowhere/sparkd", true, d / "usr/bin/sparkctl", &tried).empty());
  (void)own;
}
