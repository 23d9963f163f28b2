#pragma once
// systemd's readiness protocol (sd_notify(3)), written out: under a unit of Type=notify,
// systemd puts the path of a datagram socket in NOTIFY_SOCKET, and the service sends it
// newline-separated assignments such as READY=1 or STOPPING=1. sparkd sends READY=1 when its
// /health first says ready and STOPPING=1 when it begins to stop. The protocol is one
// sendto(2); the project links no libsystemd, and a build for a host without systemd needs
// none.
#include <string_view>

#include "core/error.h"

namespace spark::daemon {

/// Sends `state` (e.g. "READY=1") to $NOTIFY_SOCKET: a filesystem path, or an abstract
/// socket written with a leading '@'. Without NOTIFY_SOCKET (not started by systemd) it
/// does nothing and succeeds. Errc::config when the variable is no socket address,
/// Errc::io when the datagram cannot be sent.
Status notify_systemd(std::string_view state);

}  // namespace spark::daemon
