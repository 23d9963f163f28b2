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

/// The sparkd a node runs when the head asks for `preferred`: `preferred` when it is
/// executable here (or a name found on PATH); else, unless `explicit_bin` (the cluster file
/// named it in SPARKD_BIN), this node's own: locate_sparkd(self_exe), /usr/sbin/sparkd,
/// /usr/local/sbin/sparkd, sparkd on PATH. "" when none; `tried` lists what was looked at.
std::string node_sparkd(const std::string& preferred, bool explicit_bin,
                        const std::string& self_exe, std::string* tried);

}  // namespace spark
