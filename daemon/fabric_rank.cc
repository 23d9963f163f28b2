// `sparkd fabric-rank`: one rank of `sparkctl preflight --fabric`, started on its node over
// SSH with the rank's environment. With several ranks, rank 0 serves the ranks' TCP store
// on --store (RDZV_PORT: no sparkd runs yet), Gloo carries the control plane and the NCCL
// unique id, and each rank runs the same sweep and verdict as sparkd before READY; the
// report is one JSON line on stdout.
#include "daemon/fabric_rank.h"

#include <fmt/format.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <iostream>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/engine/fabric_test.h"
#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/nccl_collective.h"
#include "daemon/engine/tcp_store.h"
#include "env/nccl_env.h"
#include "kernels/cuda_runtime.h"

namespace spark::daemon {

namespace po = boost::program_options;

namespace {

Result<env::FabricReport> fabric_rank(int rank, int world, const std::string& store,
                                      const std::string& bind, const std::string& node,
                                      double min_busbw, std::chrono::milliseconds timeout) {
  if (auto n = kernels::cuda_device_count(); !n)
    return make_error(n.error().code,
                      fmt::format("{}: the fabric self-test needs this rank's GPU: {}",
                                  node.empty() ? "this node" : node, n.error().message));
  // NCCL reads its environment at its first call, which comes below.
  auto applied = env::apply_nccl_debug_env("/tmp", rank);
  auto colon = store.rfind(':');
  auto port = colon == std::string::npos ? std::nullopt : parse_i64(store.substr(colon + 1));
  if (!port) return make_error(Errc::usage, "--store: HOST:PORT expected, got " + store);
  const std::string host = store.substr(0, colon);
  std::shared_ptr<engine::Collective> ctl;
  std::unique_ptr<engine::TcpStoreClient> client;
  if (world > 1) {
    engine::GlooOptions g;
    g.rank = rank;
    g.world = world;
    g.store_host = host;
    g.store_port = static_cast<int>(*port);
    g.bind_host = bind;
    g.prefix = "fabric";
    g.timeout_ms = static_cast<int>(timeout.count());
    auto c = engine::GlooCollective::connect(g);  // rank 0 serves the store on the port
    if (!c) return c.error();
    ctl = *c;
    auto cl = engine::TcpStoreClient::connect(host, static_cast<int>(*port), timeout);
    if (!cl) return cl.error();
    client = std::move(*cl);
  } else {
    ctl = std::make_shared<engine::LocalCollective>();
  }
  engine::NcclCollective::ShareFn share;
  if (client)
    share = [&](const std::string& key, const std::string& v) -> Result<std::string> {
      if (rank == 0) {
        SPARK_TRY(client->set("fabric/" + key, v));
        return v;
      }
      SPARK_TRY(client->wait({"fabric/" + key}, timeout));
      auto got = client->try_get("fabric/" + key);
      if (!got) return got.error();
      if (!got->has_value()) return make_error(Errc::internal, "fabric: the NCCL id vanished");
      return **got;
    };
  engine::NcclOptions n;
  n.rank = rank;
  n.world = world;
  n.init_timeout = std::max(timeout, std::chrono::milliseconds(60000));
  n.op_timeout = timeout;
  auto comm = engine::NcclCollective::connect_via(n, share, ctl);
  if (!comm) return comm.error();
  engine::FabricOptions o;
  o.timeout = timeout;
  auto e = engine::fabric_expect_from_env(rank, world, node, min_busbw);
  auto r = engine::run_fabric_test(**comm, o, e, applied.debug_file);
  if (!r) return r.error();
  // The ranks leave together: nobody tears the store down under a rank still reading it.
  SPARK_TRY(ctl->barrier());
  return r;
}

}  // namespace

int fabric_rank_main(int argc, const char* const* argv) {
  po::options_description desc("sparkd fabric-rank options");
  desc.add_options()("help,h", "show this help")("rank", po::value<int>()->default_value(0),
                                                 "this rank")(
      "world", po::value<int>()->default_value(1), "ranks in the ring")(
      "store", po::value<std::string>()->default_value("127.0.0.1:0"),
      "rank 0's store HOST:PORT (rank 0 serves it)")(
      "bind", po::value<std::string>()->default_value("127.0.0.1"), "this rank's fabric address")(
      "node", po::value<std::string>()->default_value(""), "this rank's node, for messages")(
      "min-busbw", po::value<double>()->default_value(0), "FABRIC_MIN_BUSBW (GB/s)")(
      "timeout", po::value<std::string>()->default_value("30s"), "deadline of every wait");
  po::variables_map vm;
  auto fail = [](const Error& e) {
    std::cout
        << nlohmann::json{{"error", {{"code", errc_name(e.code)}, {"message", e.message}}}}.dump()
        << "\n";
    return exit_code(e.code);
  };
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    po::notify(vm);
  } catch (const std::exception& e) {
    return fail(make_error(Errc::usage, std::string("fabric-rank: ") + e.what()));
  }
  if (vm.count("help")) {
    std::cout << "usage: sparkd fabric-rank --rank R --world N --store HOST:PORT [options]\n"
              << desc;
    return 0;
  }
  std::string why;
  auto t = parse_duration_ms(vm["timeout"].as<std::string>(), &why);
  if (!t) return fail(make_error(Errc::usage, "--timeout: " + why));
  const int rank = vm["rank"].as<int>(), world = vm["world"].as<int>();
  if (world < 1 || rank < 0 || rank >= world)
    return fail(make_error(Errc::usage, fmt::format("rank {} of {} is invalid", rank, world)));
  log::set_rank(rank);
  auto r = fabric_rank(rank, world, vm["store"].as<std::string>(), vm["bind"].as<std::string>(),
                       vm["node"].as<std::string>(), vm["min-busbw"].as<double>(),
                       std::chrono::milliseconds(*t));
  if (!r) return fail(r.error());
  std::cout << env::to_json(*r).dump() << "\n";
  return r->passed() ? 0 : exit_code(Errc::precondition);
}

}  // namespace spark::daemon
