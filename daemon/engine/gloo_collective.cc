#include "daemon/engine/gloo_collective.h"

#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>

#include "core/log.h"
#include "daemon/engine/tcp_store.h"

namespace spark::engine {
namespace {

// Gloo's Store interface over our TCP store client; Gloo expects exceptions on failure.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(TcpStoreClient* c, std::string prefix, std::chrono::milliseconds timeout)
      : c_(c), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    auto st = c_->set(prefix_ + key, std::string(data.begin(), data.end()));
    if (!st.ok()) throw std::runtime_error(st.message());
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    auto v = c_->try_get(prefix_ + key);
    if (!v) throw std::runtime_error(v.error().message);
    if (!v->has_value()) throw std::runtime_error("rendezvous key " + key + " vanished");
    return std::vector<char>((*v)->begin(), (*v)->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    (void)timeout;  // Gloo passes its operation timeout; joining ranks get the rendezvous one
    auto st = c_->wait(full, timeout_);
    if (!st.ok()) throw std::runtime_error(st.message());
  }

 private:
  TcpStoreClient* c_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// Gloo's Store interface over a RendezvousStore (sparkd's rendezvous: text values, so the
// binary address blobs are hex-encoded).
class RendezvousStoreAdapter final : public gloo::rendezvous::Store {
 public:
  RendezvousStoreAdapter(RendezvousStore* s, std::string prefix, std::chrono::milliseconds timeout)
      : s_(s), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    auto st = s_->set(prefix_ + key, hex_encode(std::string(data.begin(), data.end())));
    if (!st.ok()) throw std::runtime_error(st.message());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = s_->get(prefix_ + key, timeout_);
    if (!v) throw std::runtime_error(v.error().message);
    auto bytes = hex_decode(*v);
    if (!bytes) throw std::runtime_error(bytes.error().message);
    return std::vector<char>(bytes->begin(), bytes->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    for (const auto& k : keys) {
      auto v = s_->get(prefix_ + k, timeout_);
      if (!v) throw std::runtime_error(v.error().message);
    }
  }

 private:
  RendezvousStore* s_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::string hex_encode(const std::string& bytes) {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char c : bytes) {
    auto b = static_cast<unsigned char>(c);
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

Result<std::string> hex_decode(const std::string& hex) {
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (hex.size() % 2) return make_error(Errc::integrity, "rendezvous value is not hex: odd length");
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return make_error(Errc::integrity,
                        fmt::format("rendezvous value is not hex at offset {}", 2 * i));
    out[i] = static_cast<char>(hi << 4 | lo);
  }
  return out;
}

struct GlooCollective::Impl {
  GlooOptions opts;
  std::shared_ptr<TcpStoreServer> server;
  std::unique_ptr<TcpStoreClient> client;
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  uint32_t tag = 0;

  Status open(const char* op) const {
    if (ctx) return Status::Ok();
    return make_error(Errc::precondition,
                      fmt::format("Gloo {} on rank {} of {}: this rank left the ring after a "
                                  "fatal error",
                                  op, opts.rank, opts.world));
  }

  // `waiting_for`: the rank this one waited on when only one can be missing (a broadcast's
  // root), else -1; the daemon's heartbeats name the missing ranks where they know them.
  Error fail(const char* op, const std::exception& e, int waiting_for = -1) const {
    std::string who;
    if (waiting_for >= 0 && waiting_for != opts.rank)
      who = fmt::format("; rank {} did not arrive (this rank waited for its data)", waiting_for);
    if (opts.missing_ranks)
      if (std::string m = opts.missing_ranks(); !m.empty()) who += "; " + m;
    return make_error(
        Errc::network,
        fmt::format("Gloo {} failed on rank {} of {} ({}): {}{} — a peer rank stopped or the "
                    "network between ranks is down; restart the ring together",
                    op, opts.rank, opts.world, opts.bind_host, e.what(), who));
  }
};

Result<std::shared_ptr<TcpStoreServer>> start_rendezvous_store(const std::string& host, int port) {
  auto s = TcpStoreServer::start(host, port);
  if (!s) return s.error();
  return std::shared_ptr<TcpStoreServer>(std::move(*s));
}

Result<std::shared_ptr<GlooCollective>> GlooCollective::connect(const GlooOptions& o) {
  std::shared_ptr<GlooCollective> g(new GlooCollective());
  g->impl_ = std::make_unique<Impl>();
  auto& im = *g->impl_;
  im.opts = o;
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    return make_error(Errc::config,
                      fmt::format("Gloo: rank {} of world {} is invalid", o.rank, o.world));
  // Gloo writes to its sockets without MSG_NOSIGNAL: a peer that vanished would kill this
  // rank with SIGPIPE instead of failing the operation with a message. Ignore it process-wide.
  ::signal(SIGPIPE, SIG_IGN);
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  const auto join_timeout = std::chrono::milliseconds(
      o.rendezvous_timeout_ms > 0 ? o.rendezvous_timeout_ms : o.timeout_ms);
  if (o.store) {
    // sparkd: the ring's one store is the daemon's rendezvous.
  } else if (o.rank == 0 && o.store_port == 0) {
    auto s = start_rendezvous_store(o.store_host, 0);
    if (!s) return s.error();
    im.server = *s;
    im.opts.store_port = im.server->port();
  } else if (o.rank == 0) {
    // The caller may already run the store on this port (start_rendezvous_store); if not, start it.
    auto s = start_rendezvous_store(o.store_host, o.store_port);
    if (s) im.server = *s;
  }
  if (!o.store) {
    auto client = TcpStoreClient::connect(o.store_host, im.opts.store_port, join_timeout);
    if (!client) return client.error();
    im.client = std::move(*client);
  }
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = o.bind_host;
    im.dev = gloo::transport::tcp::CreateDevice(attr);
    im.ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world);
    im.ctx->setTimeout(timeout);
    if (o.store) {
      RendezvousStoreAdapter store(o.store.get(), o.prefix + "/", join_timeout);
      im.ctx->connectFullMesh(store, im.dev);
    } else {
      StoreAdapter store(im.client.get(), o.prefix + "/", join_timeout);
      im.ctx->connectFullMesh(store, im.dev);
    }
  } catch (const std::exception& e) {
    return make_error(
        Errc::network,
        fmt::format("Gloo rendezvous of rank {} of {} via {} failed: {}", o.rank, o.world,
                    o.store ? std::string("the ring's rendezvous")
                            : fmt::format("store {}:{}", o.store_host, im.opts.store_port),
                    e.what()));
  }
  // Presence is not effect: the mesh must carry data.
  float check[2] = {static_cast<float>(o.rank), 1.0f};
  SPARK_TRY(g->all_reduce_sum(check, 2));
  const float want = static_cast<float>(o.world * (o.world - 1) / 2);
  if (check[0] != want || check[1] != static_cast<float>(o.world))
    return make_error(Errc::integrity,
                      fmt::format("Gloo mesh check on rank {}: all_reduce gave ({}, {}), expected "
                                  "({}, {})",
                                  o.rank, check[0], check[1], want, o.world));
  if (o.store)
    log::info("engine", "Gloo mesh up: rank {} of {} (bind {}, through the ring's rendezvous)",
              o.rank, o.world, o.bind_host);
  else
    log::info("engine", "Gloo mesh up: rank {} of {} (bind {}, store {}:{})", o.rank, o.world,
              o.bind_host, o.store_host, im.opts.store_port);
  return g;
}

GlooCollective::~GlooCollective() = default;
int GlooCollective::rank() const {
  return impl_->opts.rank;
}
int GlooCollective::world_size() const {
  return impl_->opts.world;
}
int GlooCollective::store_port() const {
  return impl_->opts.store_port;
}
std::string GlooCollective::address() const {
  return impl_->opts.bind_host;
}

void GlooCollective::shutdown() {
  // Destroying the context closes its pairs' sockets: a peer blocked in an operation with
  // this rank fails at once ("connection closed") instead of at its deadline.
  impl_->ctx.reset();
}

Status GlooCollective::all_reduce_sum(float* data, size_t n) {
  if (impl_->opts.world == 1 || n == 0) return Status::Ok();
  SPARK_TRY(impl_->open("all_reduce_sum"));
  try {
    gloo::AllreduceOptions opts(impl_->ctx);
    opts.setOutput(data, n);
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts.setTag(impl_->tag++);
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return impl_->fail("all_reduce_sum", e);
  }
  return Status::Ok();
}

Status GlooCollective::broadcast(void* data, size_t bytes, int root) {
  if (impl_->opts.world == 1 || bytes == 0) return Status::Ok();
  SPARK_TRY(impl_->open("broadcast"));
  try {
    gloo::BroadcastOptions opts(impl_->ctx);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(root);
    opts.setTag(impl_->tag++);
    gloo::broadcast(opts);
  } catch (const std::exception& e) {
    return impl_->fail("broadcast", e, root);
  }
  return Status::Ok();
}

Status GlooCollective::all_gather(const void* in, void* out, size_t bytes_per_rank) {
  if (impl_->opts.world == 1) return LocalCollective().all_gather(in, out, bytes_per_rank);
  if (bytes_per_rank == 0) return Status::Ok();
  SPARK_TRY(impl_->open("all_gather"));
  try {
    gloo::AllgatherOptions opts(impl_->ctx);
    opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)), bytes_per_rank);
    opts.setOutput(static_cast<uint8_t*>(out),
                   bytes_per_rank * static_cast<size_t>(impl_->opts.world));
    opts.setTag(impl_->tag++);
    gloo::allgather(opts);
  } catch (const std::exception& e) {
    return impl_->fail("all_gather", e);
  }
  return Status::Ok();
}

Status GlooCollective::barrier() {
  if (impl_->opts.world == 1) return Status::Ok();
  SPARK_TRY(impl_->open("barrier"));
  try {
    gloo::BarrierOptions opts(impl_->ctx);
    opts.setTag(impl_->tag++);
    gloo::barrier(opts);
  } catch (const std::exception& e) {
    return impl_->fail("barrier", e);
  }
  return Status::Ok();
}

}  // namespace spark::engine
