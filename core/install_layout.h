// Where an installed or built sparkctl finds its sparkd. Installed (cmake --install, the
// .deb), sparkctl is PREFIX/bin/sparkctl and sparkd PREFIX/sbin/sparkd; in the build tree
// they are cli/sparkctl and daemon/sparkd. PATH comes last: cron's PATH (/usr/bin:/bin)
// and a non-root SSH session have no sbin, so PATH alone misses an installed sparkd.
#pragma once

#include <string>
#include <vector>

namespace spark {

/// The places, in order, where the sparkctl at `self_exe` looks for sparkd: the installed
/// prefix (bin/../sbin/sparkd), beside itself, the build tree (../daemon/sparkd).
std::vector<std::string> sparkd_candidates(const std::string& self_exe);

/// The first of sparkd_candidates(self_exe) that is an executable file; "" when none is.
std::string locate_sparkd(const std::string& self_exe);

/// The shell snippet that sets B on a node to the sparkd to run: `preferred` when it is
/// executable there, else PREFIX/sbin/sparkd of the usual prefixes, else sparkd on PATH
/// with the sbin directories added; it prints "@@fatal x <message>" and exits 1 when none.
/// `explicit_bin`: the cluster file named it (SPARKD_BIN), so no fallback is tried.
std::string sparkd_shell_lookup(const std::string& preferred, bool explicit_bin);

}  // namespace spark
