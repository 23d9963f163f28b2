// The shared test fixtures themselves: namespaces are wired and removed, sshd answers.
#include <doctest/doctest.h>

#include "core/strings.h"
#include "support/netns.h"
#include "support/sshd.h"

using namespace spark;
using namespace spark::test;

namespace {

bool netns_exists(const std::string& name) {
  auto r = run_shell("ip netns list", std::chrono::seconds(10));
  return r.ok() && r->out.find(name) != std::string::npos;
}

}  // namespace

TEST_CASE("netns fixture: two hosts point to point, MTU, teardown") {
  if (auto why = netns_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  std::string ns0;
  {
    auto net = NetNs::create({.hosts = 2, .links = 2, .mtu = 1500});
    REQUIRE_MESSAGE(net.ok(), net.error().message);
    auto& n = **net;
    ns0 = n.ns(0);
    CHECK(netns_exists(ns0));
    CHECK(starts_with(n.ip(0), "10.254."));
    CHECK(starts_with(n.ip(1, 1), "10.253."));
    for (int l = 0; l < 2; ++l) {
      auto ping = n.exec_in(0, "ping -c1 -W2 " + n.ip(1, l));
      REQUIRE(ping.ok());
      CHECK_MESSAGE(ping->success(), ping->out << ping->err);
    }
    // A 9000-byte MTU carries a don't-fragment 8972-byte ping only after set_mtu.
    auto big = n.exec_in(0, "ping -c1 -W2 -M do -s 8972 " + n.ip(1));
    REQUIRE(big.ok());
    CHECK_FALSE(big->success());
    REQUIRE(n.set_mtu(0, 0, 9000).ok());
    auto link = n.exec_in(1, "cat /sys/class/net/" + n.ifname(0) + "/mtu");
    REQUIRE(link.ok());
    CHECK(trim(link->out) == "9000");
    big = n.exec_in(0, "ping -c1 -W2 -M do -s 8972 " + n.ip(1));
    REQUIRE(big.ok());
    CHECK_MESSAGE(big->success(), big->out << big->err);
    // Something left running inside is killed by teardown.
    auto bg = n.exec_in(0, "sleep 100 >/dev/null 2>&1 & echo $!");
    REQUIRE(bg.ok());
  }
  CHECK_FALSE(netns_exists(ns0));
}

TEST_CASE("netns fixture: a bridge joins three hosts") {
  if (auto why = netns_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  auto net = NetNs::create({.hosts = 3});
  REQUIRE_MESSAGE(net.ok(), net.error().message);
  auto& n = **net;
  CHECK_FALSE(n.switch_ns().empty());
  for (int a = 0; a < 3; ++a)
    for (int b = 0; b < 3; ++b) {
      if (a == b) continue;
      auto ping = n.exec_in(a, "ping -c1 -W2 " + n.ip(b));
      REQUIRE(ping.ok());
      CHECK_MESSAGE(ping->success(), "host " << a << " -> " << n.ip(b) << ": " << ping->err);
    }
}

TEST_CASE("sshd fixture: answers on a free loopback port with the keys it wrote") {
  if (auto why = sshd_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  auto d = Sshd::start();
  REQUIRE_MESSAGE(d.ok(), d.error().message);
  auto& s = **d;
  CHECK(s.running());
  CHECK(s.port() > 0);
  CHECK(starts_with(s.known_hosts_line(),
                    "[127.0.0.1]:" + std::to_string(s.port()) + " ssh-ed25519 "));
  CHECK(read_file(s.known_hosts()).value_or("") == s.known_hosts_line() + "\n");
  std::string old_line = s.known_hosts_line();
  REQUIRE(s.change_host_key().ok());
  CHECK(s.running());
  CHECK(s.known_hosts_line() != old_line);
  CHECK(read_file(s.known_hosts()).value_or("") == old_line + "\n");
  auto wrong = s.make_wrong_identity();
  REQUIRE(wrong.ok());
  CHECK(read_file(*wrong + ".pub").has_value());
  s.stop();
  CHECK_FALSE(s.running());
}
