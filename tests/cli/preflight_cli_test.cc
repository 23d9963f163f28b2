// The preflight, env and plan commands through the real command line (cli::run), on the
// captured fixture trees: exit codes, JSON shapes, fail-closed env.
#include <doctest/doctest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "core/strings.h"
#include "support/tempdir.h"

using namespace spark;

namespace {

struct Out {
  int rc;
  std::string out, err;
};

Out sparkctl(std::vector<std::string> args) {
  args.insert(args.begin(), "sparkctl");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream o, e;
  int rc = cli::run(static_cast<int>(argv.size()), argv.data(), o, e, Environment{});
  return {rc, o.str(), e.str()};
}

std::string fx(const std::string& rel) {
  return std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/" + rel;
}

}  // namespace

TEST_CASE("preflight exit codes: 0 all pass, 1 a failure, 15 warnings only, 2 usage") {
  auto ok = sparkctl({"--config", fx("healthy-pair/cluster.env"), "preflight", "--sysroot",
                      fx("healthy-pair/node0"), "--sysroot", fx("healthy-pair/node1")});
  CHECK_MESSAGE(ok.rc == 0, ok.out);
  CHECK(
      ok.out.find(
          "# ranks: 0=spark-a/gpu0 gid rocep1s0f0:3 rocep1s0f1:3, 1=spark-b/gpu0 gid rocep1s0f0:3 "
          "rocep1s0f1:3\n") != std::string::npos);
  CHECK(ok.out.find("# 61 PASS, 0 WARN, 0 FAIL, 1 SKIP on 2 node(s)") != std::string::npos);
  auto fail = sparkctl({"--config", fx("zero-gid/cluster.env"), "--json", "preflight", "--sysroot",
                        fx("zero-gid/node0"), "--sysroot", fx("zero-gid/node1")});
  CHECK(fail.rc == 1);
  auto j = nlohmann::json::parse(fail.out);
  CHECK(j["schema"] == 1);
  CHECK(j["exit_code"] == 1);
  CHECK(j["counts"]["FAIL"] == 1);
  CHECK(j["nodes"][1]["links"][0]["gid_index"].is_null());
  CHECK(j["nodes"][1]["links"][1]["gid_index"] == 3);
  CHECK(j["ranks"][1]["node"] == "spark-b");
  CHECK(j["ranks"][1]["gid_index"]["rocep1s0f0"].is_null());
  CHECK(j["ranks"][0]["gid_index"]["rocep1s0f1"] == 3);
  auto warn = sparkctl({"--config", fx("mtu1500/cluster.env"), "preflight", "--local", "--node",
                        "1", "--sysroot", fx("mtu1500/node1")});
  CHECK_MESSAGE(warn.rc == 15, warn.out);
  auto bad =
      sparkctl({"--config", fx("healthy-pair/cluster.env"), "preflight", "--only", "rdma.gdi"});
  CHECK(bad.rc == 2);
  CHECK(bad.err.find("did you mean rdma.gid") != std::string::npos);
  auto count = sparkctl({"--config", fx("healthy-pair/cluster.env"), "preflight", "--sysroot",
                         fx("healthy-pair/node0")});
  CHECK(count.rc == 2);  // one tree for a two-node ring
  auto missing = sparkctl({"--config", fx("healthy-pair/cluster.env"), "preflight", "--local",
                           "--node", "0", "--sysroot", "/nonexistent"});
  CHECK(missing.rc == 4);
}

TEST_CASE("env --rank renders each node's own GID index; fails closed on a broken one") {
  auto e0 = sparkctl({"--config", fx("head4-worker3/cluster.env"), "env", "--rank", "0",
                      "--sysroot", fx("head4-worker3/node0")});
  REQUIRE_MESSAGE(e0.rc == 0, e0.err);
  CHECK(e0.out.find("NCCL_IB_GID_INDEX=4\n") != std::string::npos);
  CHECK(e0.out.find("NCCL_IB_HCA==rocep1s0f0:1,rocep1s0f1:1\n") != std::string::npos);
  CHECK(e0.out.find("NCCL_NVLS_ENABLE=0\n") != std::string::npos);
  auto e1 = sparkctl({"--config", fx("head4-worker3/cluster.env"), "--json", "env", "1",
                      "--sysroot", fx("head4-worker3/node1")});
  REQUIRE(e1.rc == 0);
  auto j = nlohmann::json::parse(e1.out);
  CHECK(j["env"]["NCCL_IB_GID_INDEX"] == "3");
  CHECK(j["env"]["MASTER_ADDR"] == "10.10.2.1");
  auto broken = sparkctl({"--config", fx("zero-gid/cluster.env"), "env", "--rank", "1", "--sysroot",
                          fx("zero-gid/node1")});
  CHECK(broken.rc == 10);
  CHECK(broken.err.find("spark-b rocep1s0f0: no usable RoCE v2 GID index") != std::string::npos);
  CHECK(broken.out.empty());
  CHECK(sparkctl({"--config", fx("zero-gid/cluster.env"), "env", "--rank", "7"}).rc == 2);
}

TEST_CASE("env --rank refuses a twin whose port is DOWN, as start does") {
  auto down = sparkctl({"--config", fx("port-down/cluster.env"), "env", "--rank", "1", "--sysroot",
                        fx("port-down/node1")});
  CHECK(down.rc == 10);
  CHECK(down.err.find("spark-b rocep1s0f1: port 1 is 1: DOWN") != std::string::npos);
  CHECK(down.out.empty());
  auto up = sparkctl({"--config", fx("port-down/cluster.env"), "env", "--rank", "0", "--sysroot",
                      fx("port-down/node0")});
  CHECK_MESSAGE(up.rc == 0, up.err);
}

TEST_CASE("bytes that are not UTF-8 in sysfs: --json and --local --json still report") {
  auto ring = sparkctl({"--config", fx("bad-utf8/cluster.env"), "--json", "-v", "preflight",
                        "--sysroot", fx("bad-utf8/node0"), "--sysroot", fx("bad-utf8/node1")});
  CHECK_MESSAGE(ring.rc == 0, ring.err);
  auto j = nlohmann::json::parse(ring.out, nullptr, false);
  REQUIRE_FALSE(j.is_discarded());
  CHECK(ring.out.find("5: LinkUp\\\\xFF\\\\xFE") != std::string::npos);
  auto local = sparkctl({"--config", fx("bad-utf8/cluster.env"), "--json", "-v", "preflight",
                         "--local", "--node", "1", "--sysroot", fx("bad-utf8/node1")});
  CHECK_MESSAGE(local.rc == 0, local.err);
  auto jl = nlohmann::json::parse(local.out, nullptr, false);
  REQUIRE_FALSE(jl.is_discarded());
  CHECK(jl["node"] == "spark-b");
}

TEST_CASE("a --sysroot that is a symlink loop names ELOOP with the input-error exit code") {
  spark::test::TempDir t("spark-sysroot-loop");
  std::filesystem::create_symlink(t / "loop", t / "loop");
  for (std::vector<std::string> cmd :
       {std::vector<std::string>{"preflight", "--local", "--node", "0", "--sysroot", t / "loop"},
        std::vector<std::string>{"env", "--rank", "0", "--sysroot", t / "loop"}}) {
    cmd.insert(cmd.begin(), {"--config", fx("healthy-pair/cluster.env")});
    auto r = sparkctl(cmd);
    CHECK(r.rc == 4);
    CHECK(r.err.find("--sysroot " + (t / "loop") + ": symlink loop (ELOOP)") != std::string::npos);
  }
  auto missing = sparkctl({"--config", fx("healthy-pair/cluster.env"), "env", "--rank", "0",
                           "--sysroot", "/nonexistent"});
  CHECK(missing.rc == 4);
}

TEST_CASE("plan prints the per-rank arithmetic for 1-4 nodes") {
  // The fixture's model with a config.json that sizes memory but is no model the engine
  // could load (no vocab_size or intermediate_size).
  spark::test::TempDir d("spark-plan");
  std::filesystem::copy(fx("healthy-pair/node0/models/qwen3-32b"), d / "qwen3-32b");
  d.write("qwen3-32b/config.json",
          R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","num_hidden_layers":64,)"
          R"("num_attention_heads":64,"num_key_value_heads":8,"head_dim":128,)"
          R"("hidden_size":5120,"torch_dtype":"bfloat16"})");
  const std::string model = d / "qwen3-32b";
  auto p = sparkctl({"--config", fx("healthy-pair/cluster.env"), "--json", "plan", "--model", model,
                     "--capacity", "60GiB"});
  REQUIRE_MESSAGE(p.rc == 0, p.err);
  auto j = nlohmann::json::parse(p.out);
  REQUIRE(j["rows"].size() == 4);
  // 65 GiB of weights, 64 layers x 2 x 8 KV heads x 128 x 2 bytes, 32768 tokens x 4 slots.
  CHECK(j["model"]["kv_bytes_per_token"] == 262144);
  CHECK(j["rows"][0]["fits"] == false);
  CHECK(j["rows"][0]["max_context"] == 0);
  CHECK(j["rows"][1]["weights_per_rank"] == 65ull * (1ull << 30) / 2);
  // This config.json sizes memory but is no model the engine could load (no vocab_size or
  // intermediate_size): the files' estimate, and why (the engine's figure: engine_moe_test).
  CHECK(j["rows"][1]["weights_from"] == "files");
  CHECK(j["engine_refuses"].get<std::string>().find("config.json") != std::string::npos);
  CHECK(j["rows"][1]["kv_per_rank"] == 16ull << 30);
  CHECK(j["rows"][1]["fits"] == true);  // 32.5 + 16 + 4 GiB <= 60 GiB
  CHECK(j["rows"][1]["max_context"] ==
        ((60ull << 30) - (65ull << 30) / 2 - (4ull << 30)) / (131072 * 4));
  CHECK(j["engine"]["ok"] == false);
  auto t = sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--capacity", "60GiB",
                     "--model", model});
  CHECK(t.out.find("GQA 8 KV heads x head_dim 128") != std::string::npos);
  CHECK(sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", "/nonexistent"})
            .rc == 4);
  // A config.json that is there but wrong is a config error (3) that says where and what.
  spark::test::TempDir bad("spark-plan-bad");
  bad.write("config.json", "{\"hidden_size\": \"big\"}");
  auto b = sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", bad.path()});
  CHECK(b.rc == 3);
  CHECK(b.err.find("\"hidden_size\" must be a non-negative integer") != std::string::npos);
  bad.write("config.json", "{\"hidden_size\": 64, \"rms_norm_eps\": NaN}");
  auto n = sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", bad.path()});
  CHECK(n.rc == 3);
  CHECK(n.err.find("NaN is not JSON") != std::string::npos);
  CHECK(n.err.find("not a JSON object") == std::string::npos);
}

TEST_CASE("plan shows GLM-5.3-Flash per layer type: the linear layers keep a state, not KV") {
  const std::string model =
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models/plan/glm-5.3-flash";
  auto p = sparkctl({"--config", fx("healthy-pair/cluster.env"), "--json", "plan", "--model", model,
                     "--context", "500000", "--kv-dtype", "fp8", "--kv-layout", "vllm",
                     "--capacity", "100GiB", "--slots", "1", "--nodes", "2"});
  REQUIRE_MESSAGE(p.rc == 0, p.err);
  auto j = nlohmann::json::parse(p.out);
  CHECK(j["model"]["layer_types"]["linear_attention"] == 34);
  CHECK(j["model"]["layer_types"]["deepseek_sparse_attention"] == 11);
  CHECK(j["kv_layout"] == "vllm");
  REQUIRE(j["rows"].size() == 2);
  // Per token only the 11 DSA layers count, and the latent is not halved at 2 ranks.
  CHECK(j["rows"][0]["kv_per_token_per_rank"] == 11 * 656 + 11 * 9);
  CHECK(j["rows"][1]["kv_per_token_per_rank"] == j["rows"][0]["kv_per_token_per_rank"]);
  bool state = false, latent = false;
  for (const auto& l : j["rows"][1]["layers"]) {
    if (l["layer_type"] == "linear_attention") {
      state = true;
      CHECK(l["bytes_per_state"] == 0);
      CHECK(l["bytes_per_slot"] == 3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4);
    }
    if (l["layer_type"] == "deepseek_sparse_attention" && l["part"] == "latent") {
      latent = true;
      CHECK(l["bytes_per_state"] == 656);
      CHECK(l["bytes_per_sequence"] == 11ll * 656 * 500000);
    }
  }
  CHECK(state);
  CHECK(latent);
  auto t = sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", model,
                     "--kv-dtype", "fp8", "--kv-layout", "vllm", "--capacity", "100GiB"});
  REQUIRE_MESSAGE(t.rc == 0, t.err);
  CHECK(t.out.find("11 deepseek_sparse_attention, 34 linear_attention") != std::string::npos);
  CHECK(t.out.find("fp8_ds_mla: 512 fp8 latent + 16 B scales + 128 B bf16 RoPE = 656 B") !=
        std::string::npos);
  CHECK(sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", model,
                  "--kv-layout", "sglang"})
            .rc == 2);
  // --kv-overhead is KV: it is in KV/RANK and comes off the largest context.
  auto base = sparkctl({"--config",        fx("healthy-pair/cluster.env"),
                        "--json",          "plan",
                        "--model",         model,
                        "--context",       "500000",
                        "--kv-dtype",      "fp8",
                        "--kv-layout",     "vllm",
                        "--capacity",      "120GiB",
                        "--slots",         "1",
                        "--nodes",         "2",
                        "--weights-dtype", "fp4"});
  auto over = sparkctl({"--config",        fx("healthy-pair/cluster.env"),
                        "--json",          "plan",
                        "--model",         model,
                        "--context",       "500000",
                        "--kv-dtype",      "fp8",
                        "--kv-layout",     "vllm",
                        "--capacity",      "120GiB",
                        "--slots",         "1",
                        "--nodes",         "2",
                        "--weights-dtype", "fp4",
                        "--kv-overhead",   "7GiB"});
  REQUIRE_MESSAGE(base.rc == 0, base.err);
  REQUIRE_MESSAGE(over.rc == 0, over.err);
  auto jb = nlohmann::json::parse(base.out), jo = nlohmann::json::parse(over.out);
  CHECK(jo["kv_overhead"] == 7ull << 30);
  CHECK(jo["rows"][1]["kv_per_rank"].get<uint64_t>() ==
        jb["rows"][1]["kv_per_rank"].get<uint64_t>() + (7ull << 30));
  CHECK(jo["rows"][1]["max_context"].get<int64_t>() < jb["rows"][1]["max_context"].get<int64_t>());
  CHECK(sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", model,
                  "--kv-overhead", "lots"})
            .rc == 2);
}

TEST_CASE("plan on a directory with only config.json estimates the weights, never says fits") {
  // How a ring is sized before a 164 GiB download: config.json alone.
  spark::test::TempDir t("spark-plan-estimate");
  std::filesystem::copy(
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models/plan/glm-5.3-flash/config.json",
      t / "config.json");
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"--config", fx("healthy-pair/cluster.env"),
                                  "--json",   "plan",
                                  "--model",  t.path(),
                                  "--nodes",  "4"};
    a.insert(a.end(), extra.begin(), extra.end());
    auto p = sparkctl(a);
    REQUIRE_MESSAGE(p.rc == 0, p.err);
    return nlohmann::json::parse(p.out);
  };
  auto j = run({"--capacity", "100GiB"});
  CHECK(j["model"]["weights_estimated"] == true);
  // 288 experts x 3 x 4096 x 2048 on 42 sparse layers alone are 304 G parameters.
  uint64_t est = j["model"]["weight_bytes"].get<uint64_t>();
  CHECK(est > 600ull * 1000 * 1000 * 1000);
  CHECK(est < 700ull * 1000 * 1000 * 1000);
  CHECK(j["model"]["expert_bytes"].get<uint64_t>() > est * 9 / 10);
  for (const auto& r : j["rows"]) {
    CHECK(r["fits"].is_null());
    CHECK(r["weights_from"] == "estimate");
    CHECK(r["weights_per_rank"].get<uint64_t>() > 0);
  }
  // The old answer: one node, 0 B of weights, a 21-million-token context.
  CHECK(j["rows"][0]["fits_if_estimate_holds"] == false);
  CHECK(j["rows"][0]["max_context"] == 0);
  // At fp4 (the download's size) it is about a quarter.
  auto f = run({"--capacity", "100GiB", "--weights-dtype", "fp4"});
  uint64_t fp4 = f["model"]["weight_bytes"].get<uint64_t>();
  CHECK(fp4 < est * 3 / 10);
  CHECK(fp4 > 150ull << 30);
  CHECK(fp4 < 180ull << 30);
  CHECK(f["model"]["weights_basis"].get<std::string>().find("fp4 matrices (--weights-dtype)") !=
        std::string::npos);
  // The table says it is an estimate, and never "yes".
  auto tbl = sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", t.path(),
                       "--capacity", "1TiB", "--weights-dtype", "fp4"});
  REQUIRE_MESSAGE(tbl.rc == 0, tbl.err);
  CHECK(tbl.out.find("an ESTIMATE from config.json") != std::string::npos);
  CHECK(tbl.out.find("~yes") != std::string::npos);
  CHECK(tbl.out.find("  yes ") == std::string::npos);
  CHECK(sparkctl({"--config", fx("healthy-pair/cluster.env"), "plan", "--model", t.path(),
                  "--weights-dtype", "fp3"})
            .rc == 2);
  // A quantization_config names the bytes: fp8 matrices, bf16 embeddings.
  auto cfg = nlohmann::json::parse(spark::read_file(t / "config.json").value());
  cfg["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  t.write("config.json", cfg.dump());
  auto q = run({"--capacity", "100GiB"});
  uint64_t fp8 = q["model"]["weight_bytes"].get<uint64_t>();
  CHECK(fp8 < est * 6 / 10);
  CHECK(fp8 > est * 4 / 10);
}
