#include "core/config.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>

#include "core/strings.h"

using namespace spark;

TEST_CASE("a minimal local ring resolves with defaults and provenance") {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text("NODE0_SSH=local\n", "t.env", env, &d);
  REQUIRE(cfg.ok());
  CHECK(cfg->nodes.size() == 1);
  CHECK(cfg->nodes[0].local);
  CHECK(cfg->nodes[0].fabric_ip == "127.0.0.1");
  CHECK(cfg->get("API_PORT") == "8000");
  CHECK(cfg->settings.at("API_PORT").source == "default");
  CHECK(cfg->settings.at("NODE0_SSH").source == "t.env:1");
}

namespace {

// Loads text with the given environment; returns the result and fills diags.
Result<RingConfig> load(std::string_view text, std::vector<Diagnostic>* d,
                        std::map<std::string, std::string> vars = {}) {
  Environment env;
  env.vars = std::move(vars);
  return load_config_text(text, "t.env", env, d);
}

// Loads text that must fail; returns the one error message (all errors joined).
std::string load_err(std::string_view text, std::map<std::string, std::string> vars = {}) {
  std::vector<Diagnostic> d;
  auto cfg = load(text, &d, std::move(vars));
  INFO(text);
  REQUIRE_FALSE(cfg.ok());
  CHECK(cfg.error().code == Errc::config);
  return cfg.error().message;
}

bool has_diag(const std::vector<Diagnostic>& d, bool error, std::string_view where,
              std::string_view text) {
  for (const auto& x : d)
    if (x.error == error && x.where == where && x.message.find(text) != std::string::npos)
      return true;
  return false;
}

const char* kTwo =
    "NODE0_SSH=spark-a\n"
    "NODE0_FABRIC_IP=10.10.2.1\n"
    "NODE1_SSH=spark-b\n"
    "NODE1_FABRIC_IP=10.10.2.2\n";

}  // namespace

TEST_CASE("config: two nodes, ranks in order, per-node fields") {
  std::vector<Diagnostic> d;
  std::string text = std::string(kTwo) +
                     "NODE0_NETDEVS=enp1s0f0np0,enp1s0f1np1\n"
                     "NODE0_HCAS=rocep1s0f0,rocep1s0f1\n"
                     "NODE1_GID_INDEX=3\n"
                     "NODE1_GPUS=0,1\n"
                     "NODE1_SSH=me@spark-b:2222\n"
                     "MODEL_PATH=/models/glm/\n";
  auto cfg = load(text, &d);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  REQUIRE(cfg->nodes.size() == 2);
  const auto& a = cfg->nodes[0];
  const auto& b = cfg->nodes[1];
  CHECK(a.name == "node0");
  CHECK(a.ssh_host == "spark-a");
  CHECK(a.ssh_port == 22);
  CHECK(a.netdevs == std::vector<std::string>{"enp1s0f0np0", "enp1s0f1np1"});
  CHECK(a.hcas == std::vector<std::string>{"rocep1s0f0", "rocep1s0f1"});
  CHECK_FALSE(a.gid_index.has_value());  // auto
  CHECK(b.gid_index == 3);
  CHECK(b.ssh_user == "me");
  CHECK(b.ssh_port == 2222);
  CHECK(b.model_path == "/models/glm/");
  CHECK(cfg->get("MODEL") == "glm");  // derived from MODEL_PATH
  CHECK(cfg->world_size() == 3);
  auto r = cfg->ranks();
  CHECK(r[2].node == 1);
  CHECK(r[2].local_rank == 1);
  CHECK(r[2].gpu == 1);
  // The second NODE1_SSH wins, with a warning that points at both lines.
  CHECK(has_diag(d, false, "t.env:9", "NODE1_SSH is set again (first at t.env:3)"));
}

TEST_CASE("config: the environment overrides the file and says so") {
  std::vector<Diagnostic> d;
  auto cfg = load(std::string(kTwo) + "API_PORT=8000\nMODEL=a\n", &d,
                  {{"API_PORT", "8100"}, {"NODE1_FABRIC_IP", "10.10.2.9"}, {"PATH", "/bin"}});
  REQUIRE(cfg.ok());
  CHECK(cfg->get("API_PORT") == "8100");
  CHECK(cfg->settings.at("API_PORT").source == "environment");
  CHECK(cfg->nodes[1].fabric_ip == "10.10.2.9");
  CHECK(cfg->settings.at("MODEL").source == "t.env:6");
  CHECK(d.empty());  // unrelated environment variables are not warned about
}

TEST_CASE("config: an explicit empty environment value clears the key") {
  std::vector<Diagnostic> d;
  auto cfg = load(std::string(kTwo) + "MODEL=a\nAPI_PORT=9000\nNODE1_NAME=b\n", &d,
                  {{"MODEL", ""}, {"API_PORT", ""}, {"NODE1_NAME", ""}, {"NODE7_NAME", ""}});
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  CHECK(cfg->get("MODEL").empty());
  CHECK(cfg->get("API_PORT") == "8000");  // cleared: back to the default
  CHECK(cfg->settings.at("API_PORT").source == "environment (empty: default)");
  CHECK(cfg->nodes[1].name == "node1");
  CHECK(cfg->nodes.size() == 2);  // an empty NODE7_* adds no node
  // Clearing a required key is an error, pointing at the environment.
  auto msg = load_err(kTwo, {{"NODE1_SSH", ""}});
  CHECK(msg.find("NODE1_SSH is not set") != std::string::npos);
}

TEST_CASE("config: a misspelt known key is an error with did-you-mean; others warn") {
  std::vector<Diagnostic> d;
  auto cfg = load(std::string(kTwo) +
                      "API_PROT=1\nNODE1_FABRICIP=x\napi_port=1\nNODE12_HCA=x\n"
                      "TOTALLY_UNRELATED_NAME=1\nMODLE_PATH=/models/m\n",
                  &d);
  // The ring would run on the default of the key that was meant: refuse it.
  REQUIRE_FALSE(cfg.ok());
  CHECK(has_diag(d, true, "t.env:5",
                 "unknown key API_PROT (did you mean API_PORT?): fix its spelling, or the ring "
                 "runs without it"));
  CHECK(has_diag(d, true, "t.env:6", "(did you mean NODE1_FABRIC_IP?)"));
  CHECK(has_diag(d, true, "t.env:7", "(did you mean API_PORT?)"));
  CHECK(has_diag(d, true, "t.env:8", "(did you mean NODE12_HCAS?)"));
  CHECK(has_diag(d, true, "t.env:10", "unknown key MODLE_PATH (did you mean MODEL_PATH?)"));
  CHECK(cfg.error().message.find("MODLE_PATH") != std::string::npos);
  // A name like no key is the file's own variable: ignored with a warning.
  std::vector<Diagnostic> w;
  auto ok = load(std::string(kTwo) + "TOTALLY_UNRELATED_NAME=1\n", &w);
  REQUIRE(ok.ok());
  CHECK(has_diag(w, false, "t.env:5", "unknown key TOTALLY_UNRELATED_NAME; it is ignored"));
  CHECK_FALSE(has_diag(w, false, "t.env:5", "did you mean"));
  CHECK(ok->nodes.size() == 2);  // NODE12_HCA did not create a node
}

TEST_CASE("config: placeholders are refused, shell redirections are not placeholders") {
  auto msg = load_err(std::string(kTwo) + "NODE1_SSH=<user>@<worker-host>\n");
  CHECK(msg.find("t.env:5: NODE1_SSH=<user>@<worker-host> is still a placeholder") !=
        std::string::npos);
  CHECK(load_err(std::string(kTwo) + "MODEL_PATH=/models/<model name>\n").find("placeholder") !=
        std::string::npos);
  std::vector<Diagnostic> d;
  auto cfg = load(std::string(kTwo) + "ENGINE=exec\nENGINE_EXEC=run < in > out\n", &d);
  CHECK_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
}

TEST_CASE("config: documentation addresses are refused in all three ranges") {
  for (const char* ip : {"192.0.2.10", "198.51.100.1", "203.0.113.254"}) {
    INFO(ip);
    auto msg = load_err(fmt::format("NODE0_SSH=spark-a\nNODE0_FABRIC_IP={}\n", ip));
    CHECK(msg.find(fmt::format("t.env:2: NODE0_FABRIC_IP: {} is a documentation address", ip)) !=
          std::string::npos);
    CHECK(load_err(fmt::format("NODE0_SSH=me@{}\nNODE0_FABRIC_IP=10.0.0.1\n", ip))
              .find("documentation address") != std::string::npos);
  }
  CHECK(load_err("NODE0_SSH=local\nAPI_BIND=203.0.113.5\nAPI_KEY_FILE=/k\n")
            .find("documentation address") != std::string::npos);
  // Neighbours of the ranges are fine.
  std::vector<Diagnostic> d;
  CHECK(load("NODE0_SSH=a\nNODE0_FABRIC_IP=192.0.3.1\nNODE1_SSH=b\nNODE1_FABRIC_IP=198.51.101.1\n",
             &d)
            .ok());
  CHECK(is_documentation_ipv4(0xC0000200u));
  CHECK_FALSE(is_documentation_ipv4(0xC0000300u));
}

TEST_CASE("config: duplicate nodes are refused by name, SSH target and fabric address") {
  CHECK(load_err(std::string(kTwo) + "NODE0_NAME=x\nNODE1_NAME=x\n")
            .find("t.env:6: NODE0 and NODE1 are both named 'x'") != std::string::npos);
  CHECK(load_err(
            "NODE0_SSH=h\nNODE0_FABRIC_IP=10.0.0.1\nNODE1_SSH=me@h:22\nNODE1_FABRIC_IP=10.0.0.2\n")
            .find("t.env:3: NODE0 and NODE1 have the same SSH target h:22") != std::string::npos);
  CHECK(load_err("NODE0_SSH=a\nNODE0_FABRIC_IP=10.0.0.1\nNODE1_SSH=b\nNODE1_FABRIC_IP=10.0.0.1\n")
            .find("t.env:4: NODE0 and NODE1 have the same fabric address 10.0.0.1") !=
        std::string::npos);
  // Same host on different SSH ports is two nodes (containers, port forwards).
  std::vector<Diagnostic> d;
  CHECK(load("NODE0_SSH=h:2201\nNODE0_FABRIC_IP=10.0.0.1\nNODE1_SSH=h:2202\n"
             "NODE1_FABRIC_IP=10.0.0.2\n",
             &d)
            .ok());
}

TEST_CASE("config: bad addresses are refused") {
  for (const char* ip :
       {"10.10.2", "10.10.2.256", "10.10.2.1/24", "spark-a", "10.10.2.01", "::1"}) {
    INFO(ip);
    CHECK(load_err(fmt::format("NODE0_SSH=a\nNODE0_FABRIC_IP={}\n", ip))
              .find("is not an IPv4 address") != std::string::npos);
  }
  for (const char* ip : {"0.0.0.0", "255.255.255.255", "224.0.0.1", "0.1.2.3"}) {
    INFO(ip);
    CHECK(load_err(fmt::format("NODE0_SSH=a\nNODE0_FABRIC_IP={}\n", ip))
              .find("is not a unicast host address") != std::string::npos);
  }
  CHECK(load_err("NODE0_SSH=a\nNODE0_FABRIC_IP=127.0.0.1\n").find("loopback address on a remote") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=a\n").find("t.env:1: NODE0_FABRIC_IP is not set") != std::string::npos);
  CHECK(load_err("NODE0_SSH=a b\nNODE0_FABRIC_IP=10.0.0.1\n").find("not a host name") !=
        std::string::npos);
}

TEST_CASE("config: ports out of range are refused") {
  for (const char* p : {"0", "65536", "-1", "80a", "99999999999999999999999"}) {
    INFO(p);
    CHECK(load_err(fmt::format("NODE0_SSH=local\nAPI_PORT={}\n", p))
              .find(fmt::format("t.env:2: API_PORT: port '{}' is out of range 1-65535", p)) !=
          std::string::npos);
  }
  CHECK(load_err("NODE0_SSH=h:0\nNODE0_FABRIC_IP=10.0.0.1\n").find("port is out of range") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=h:70000\nNODE0_FABRIC_IP=10.0.0.1\n").find("port is out of range") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nAPI_PORT=9000\nRDZV_PORT=9000\n").find("must differ") !=
        std::string::npos);
  std::vector<Diagnostic> d;
  CHECK(load("NODE0_SSH=local\nAPI_PORT=1\nRDZV_PORT=65535\n", &d).ok());
}

TEST_CASE("config: sizes and durations are parsed strictly") {
  std::vector<Diagnostic> d;
  auto cfg = load("NODE0_SSH=local\nMEM_FREE_MIN=110GiB\nMEM_WAIT=90s\n", &d);
  REQUIRE(cfg.ok());
  CHECK(cfg->get_size("MEM_FREE_MIN") == 110ull << 30);
  CHECK(cfg->get_duration_ms("MEM_WAIT") == 90000u);
  CHECK(cfg->get_size("MEM_RESERVE") == 4ull << 30);  // default
  for (const char* bad : {"110G", "110 GiB", "1.5B", "-1", "110gib", "lots"}) {
    INFO(bad);
    CHECK(load_err(fmt::format("NODE0_SSH=local\nMEM_FREE_MIN='{}'\n", bad))
              .find("t.env:2: MEM_FREE_MIN:") != std::string::npos);
  }
  CHECK(load_err("NODE0_SSH=local\nREADY_TIMEOUT=soon\n").find("READY_TIMEOUT:") !=
        std::string::npos);
}

TEST_CASE("config: other typed values") {
  CHECK(load_err("NODE0_SSH=local\nSLOTS=four\n").find("'four' is not a whole number") !=
        std::string::npos);
  // A refused value is reported once, not again by the range check.
  auto msg = load_err("NODE0_SSH=local\nSLOTS=four\n");
  CHECK(msg.find("at least 1") == std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nSLOTS=0\n").find("SLOTS must be at least 1") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nDISK_MAX_USE=101\n").find("1-100") != std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nENGINE=vllm\n").find("'vllm' is not one of native|exec") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nENGINE=exec\n").find("needs ENGINE_EXEC") != std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nNODE0_GID_INDEX=256\n").find("'auto' or 0-255") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nNODE0_GPUS=0,x\n").find("'x' is not a GPU ordinal") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nNODE0_GPUS=1,1\n").find("lists GPU 1 twice") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nLINK_SPEED_MIN=fast\n").find("LINK_SPEED_MIN") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nLOG_LEVEL=loud\n").find("LOG_LEVEL") != std::string::npos);
}

TEST_CASE("config: nodes are numbered without gaps") {
  CHECK(load_err("NODE0_SSH=local\nNODE2_SSH=b\nNODE2_FABRIC_IP=10.0.0.2\n")
            .find("t.env:2: NODE2 is defined but NODE1 is not") != std::string::npos);
  CHECK(load_err("NODE1_SSH=b\nNODE1_FABRIC_IP=10.0.0.2\n")
            .find("NODE1 is defined but NODE0 is not") != std::string::npos);
  CHECK(load_err("RING_NAME=x\n").find("no nodes") != std::string::npos);
  CHECK(load_err("").find("no nodes") != std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nNODE16_SSH=x\n").find("over the limit of 16 nodes") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nNODE99999999999999999999999_SSH=x\n").find("over the limit") !=
        std::string::npos);
}

TEST_CASE("config: HCA and netdev lists must pair up") {
  auto msg = load_err(std::string(kTwo) +
                      "NODE1_NETDEVS=enp1s0f0np0,enp1s0f1np1\n"
                      "NODE1_HCAS=rocep1s0f0\n");
  CHECK(msg.find("t.env:6: NODE1: 1 HCAs but 2 netdevs") != std::string::npos);
  CHECK(load_err(std::string(kTwo) + "NODE0_NETDEVS=averyveryverylongname0\n")
            .find("not an interface name") != std::string::npos);
  CHECK(load_err(std::string(kTwo) + "NODE0_NETDEVS=eth0:1\n").find("not an interface name") !=
        std::string::npos);
}

TEST_CASE("config: a netdev or HCA listed twice is refused (one entry per twin)") {
  auto msg = load_err(std::string(kTwo) +
                      "NODE1_NETDEVS=enp1s0f0np0,enp1s0f0np0\n"
                      "NODE1_HCAS=rocep1s0f0,rocep1s0f1\n");
  CHECK(msg.find("t.env:5: NODE1_NETDEVS lists enp1s0f0np0 twice") != std::string::npos);
  msg = load_err(std::string(kTwo) +
                 "NODE1_NETDEVS=enp1s0f0np0,enp1s0f1np1\n"
                 "NODE1_HCAS=rocep1s0f0,rocep1s0f0\n");
  CHECK(msg.find("NODE1_HCAS lists rocep1s0f0 twice") != std::string::npos);
}

TEST_CASE("config: API_BIND beyond loopback needs an API key file") {
  auto msg = load_err("NODE0_SSH=local\nAPI_BIND=0.0.0.0\n");
  CHECK(msg.find("t.env:2: API_BIND=0.0.0.0 is not loopback: set API_KEY_FILE") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nAPI_BIND=10.1.1.1\n").find("API_KEY_FILE") != std::string::npos);
  std::vector<Diagnostic> d;
  CHECK(load("NODE0_SSH=local\nAPI_BIND=0.0.0.0\nAPI_KEY_FILE=/etc/sparkctl/key\n", &d).ok());
  CHECK(load("NODE0_SSH=local\nAPI_BIND=127.0.0.2\n", &d).ok());
}

TEST_CASE("config: diagnostics come out sorted by line, the environment last") {
  std::vector<Diagnostic> d;
  auto cfg = load(
      "ZZZ_UNKNOWN=1\nSLOTS=0\nNODE0_SSH=local\nAPI_PORT=0\nAPI_BIND=10.0.0.1\n"
      "AAA_UNKNOWN=2\n",
      &d, {{"CONTEXT_LEN", "x"}});
  REQUIRE_FALSE(cfg.ok());
  std::vector<std::string> where;
  for (const auto& x : d) where.push_back(x.where);
  CHECK(where == std::vector<std::string>{"t.env:1", "t.env:2", "t.env:4", "t.env:5", "t.env:6",
                                          "environment"});
  // The error message lists the errors in the same order.
  auto m = cfg.error().message;
  CHECK(m.find("t.env:2") < m.find("t.env:4"));
  CHECK(m.find("t.env:4") < m.find("t.env:5"));
  CHECK(m.find("t.env:5") < m.find("environment"));
}

TEST_CASE("config: syntax errors and unreadable files") {
  std::vector<Diagnostic> d;
  auto cfg = load("NODE0_SSH=local\nAPI_PORT = 1\n", &d);
  REQUIRE_FALSE(cfg.ok());
  CHECK(cfg.error().message.rfind("t.env:2:9:", 0) == 0);
  auto missing = load_config("/nonexistent/sparkctl.env", Environment{}, &d);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == Errc::not_found);
  CHECK(missing.error().message.find("--config") != std::string::npos);
}

TEST_CASE("config: a very long key neither crashes nor hangs") {
  std::vector<Diagnostic> d;
  std::string key = "NODE0_" + std::string(200000, 'A');
  auto cfg = load("NODE0_SSH=local\n" + key + "=1\n", &d);
  CHECK(cfg.ok());
  CHECK(has_diag(d, false, "t.env:2", "unknown key"));
}

TEST_CASE("config: the digest follows the resolved values") {
  std::vector<Diagnostic> d;
  auto a = load(kTwo, &d);
  auto b = load(std::string("# comment\n") + kTwo, &d);
  auto c = load(kTwo, &d, {{"API_PORT", "8001"}});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(c.ok());
  CHECK(a->digest() == b->digest());
  CHECK(a->digest() != c->digest());
  CHECK(a->digest().size() == 32);
}

TEST_CASE("config: values that are not UTF-8 or hold a NUL are refused with file:line") {
  auto msg = load_err("NODE0_SSH=local\nMODEL=caf\xe9\n");
  CHECK(msg.find("t.env:2: MODEL: the value is not UTF-8 (byte 0xe9 at offset 3)") !=
        std::string::npos);
  CHECK(load_err("NODE0_SSH=local\nPROBE_PROMPT=ok \xc0\xaf\n").find("t.env:2: PROBE_PROMPT") !=
        std::string::npos);  // overlong form
  CHECK(load_err("NODE0_SSH=local\nMODEL=\xed\xa0\x80\n").find("not UTF-8") !=
        std::string::npos);  // a UTF-16 surrogate
  std::string nul = "NODE0_SSH=local\n\nMODEL=a";
  nul += '\0';
  nul += "b\n";
  CHECK(load_err(nul).find("t.env:3: MODEL: the value holds a NUL byte at offset 1") !=
        std::string::npos);
  std::vector<Diagnostic> d;
  CHECK(load("NODE0_SSH=local\nMODEL=caf\xc3\xa9 \xe6\xbc\xa2\xf0\x9f\xa4\x96\n", &d).ok());
}

TEST_CASE("utf8_invalid_at finds the first byte that is not well-formed UTF-8") {
  CHECK(utf8_invalid_at("plain") == std::string_view::npos);
  CHECK(utf8_invalid_at("\xf4\x8f\xbf\xbf") == std::string_view::npos);  // U+10FFFF
  CHECK(utf8_invalid_at("ab\xf4\x90\x80\x80") == 2);                     // past U+10FFFF
  CHECK(utf8_invalid_at("a\xe2\x82") == 1);                              // truncated
  CHECK(utf8_invalid_at("\xe0\x80\x80") == 0);                           // overlong
  CHECK(utf8_invalid_at("x\x80") == 1);                                  // lone continuation
}
