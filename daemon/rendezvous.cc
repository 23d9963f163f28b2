#include "daemon/rendezvous.h"

#include <atomic>
#include <boost/asio.hpp>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/json_text.h"
#include "core/log.h"

namespace spark::daemon {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {
constexpr std::string_view kComp = "rdzv";
constexpr size_t kMaxLine = 1 << 20;

nlohmann::json ok_reply() {
  return {{"ok", true}};
}
nlohmann::json err_reply(Errc c, const std::string& m) {
  return {{"ok", false}, {"error", {{"code", std::string(errc_name(c))}, {"message", m}}}};
}
Errc errc_from_name(const std::string& n) {
  for (int i = 0; i <= static_cast<int>(Errc::internal); ++i)
    if (errc_name(static_cast<Errc>(i)) == n) return static_cast<Errc>(i);
  return Errc::internal;
}
std::string fmt_ms(milliseconds ms) {
  return ms.count() < 10000 ? std::to_string(ms.count()) + " ms"
                            : std::to_string(ms.count() / 1000) + " s";
}
std::string short_digest(const std::string& d) {
  return d.empty() ? "(empty)" : d.size() > 16 ? d.substr(0, 16) + "…" : d;
}
}  // namespace

nlohmann::json to_json(const RankIdentity& id) {
  return {{"rank", id.rank},
          {"world_size", id.world_size},
          {"node", id.node},
          {"host", id.host},
          {"pid", id.pid},
          {"version", id.version},
          {"config_digest", id.config_digest},
          {"model_digest", id.model_digest}};
}

RankIdentity identity_from_json(const nlohmann::json& j) {
  RankIdentity id;
  id.rank = j.at("rank").get<int>();
  id.world_size = j.at("world_size").get<int>();
  id.node = j.value("node", "");
  id.host = j.value("host", "");
  id.pid = j.value("pid", 0);
  id.version = j.value("version", "");
  id.config_digest = j.value("config_digest", "");
  id.model_digest = j.value("model_digest", "");
  return id;
}

Status compare_identity(const RankIdentity& ref, const RankIdentity& in) {
  std::string who =
      "rank " + std::to_string(in.rank) + " (node " + in.node + ", host " + in.host + ")";
  auto differ = [&](const char* field, const std::string& a, const std::string& b,
                    const char* fix) -> Status {
    return make_error(Errc::integrity, who + " refused: " + field + " " + short_digest(b) +
                                           " differs from rank 0's " + short_digest(a) + "; " +
                                           fix);
  };
  if (in.world_size != ref.world_size)
    return differ("world_size", std::to_string(ref.world_size), std::to_string(in.world_size),
                  "every rank must use the same cluster file");
  if (in.version != ref.version)
    return differ("version", ref.version, in.version,
                  "install the same sparkd on every node (sparkctl version)");
  if (in.config_digest != ref.config_digest)
    return differ("config_digest", ref.config_digest, in.config_digest,
                  "the cluster file or its environment overrides differ between nodes: compare "
                  "`sparkctl config show` on both");
  if (in.model_digest != ref.model_digest)
    return differ("model_digest", ref.model_digest, in.model_digest,
                  "the model files differ between nodes: re-stage the model (sparkctl stage)");
  return Status::Ok();
}

// ---------------------------------------------------------------- server

class RdzvConn;

struct RendezvousServer::Impl : std::enable_shared_from_this<RendezvousServer::Impl> {
  net::io_context& io;
  tcp::acceptor acceptor;
  RankIdentity reference;
  std::vector<std::string> node_of_rank;
  milliseconds hb_timeout;
  uint16_t port = 0;
  std::vector<std::weak_ptr<RdzvConn>> conns;  // reactor only
  bool closed = false;                         // reactor only

  struct Waiter {
    std::weak_ptr<RdzvConn> conn;
    std::shared_ptr<net::steady_timer> timer;
    int rank = -1;
  };
  std::map<std::string, std::set<int>> barrier_arrived;        // reactor only
  std::map<std::string, std::vector<Waiter>> barrier_waiters;  // reactor only
  std::map<std::string, std::string> kv;                       // reactor only
  std::map<std::string, std::vector<Waiter>> get_waiters;      // reactor only
  std::optional<net::steady_timer> sweep;                      // reactor only

  // Shared with other threads.
  mutable std::mutex mu;
  struct Rank {
    RankHealth h;
    bool refused = false;
    std::string refused_why;
    bool lost = false;
    std::string lost_why;
    std::optional<Clock::time_point> last;
    int slots_total = 0, slots_busy = 0;
  };
  std::vector<Rank> ranks;
  State ring_state = State::loading;
  std::string ring_reason;

  Impl(net::io_context& i, RankIdentity ref, std::vector<std::string> nodes, milliseconds hb)
      : io(i),
        acceptor(i),
        reference(std::move(ref)),
        node_of_rank(std::move(nodes)),
        hb_timeout(hb) {
    ranks.resize(static_cast<size_t>(reference.world_size));
    for (size_t r = 0; r < ranks.size(); ++r) {
      ranks[r].h.rank = static_cast<int>(r);
      ranks[r].h.node = r < node_of_rank.size() ? node_of_rank[r] : "?";
      ranks[r].h.state = "unknown";
    }
  }

  std::string name_of(int r) const {
    return "rank " + std::to_string(r) + " (node " +
           (r >= 0 && static_cast<size_t>(r) < node_of_rank.size()
                ? node_of_rank[static_cast<size_t>(r)]
                : "?") +
           ")";
  }

  void accept();
  void arm_sweep();
  void handle(const std::shared_ptr<RdzvConn>& c, const nlohmann::json& req);
  void on_conn_closed(RdzvConn* c);
  nlohmann::json handle_join(const std::shared_ptr<RdzvConn>& c, const nlohmann::json& req);
  void mark_lost(int rank, const std::string& why);
};

class RdzvConn : public std::enable_shared_from_this<RdzvConn> {
 public:
  RdzvConn(tcp::socket s, std::shared_ptr<RendezvousServer::Impl> srv)
      : sock_(std::move(s)), buf_(kMaxLine), srv_(std::move(srv)) {}
  void start() { read(); }
  void reply(const nlohmann::json& j) {
    outq_.push_back(dump_json(j) + "\n");
    write();
  }
  void close() {
    boost::system::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
  }
  int heartbeat_rank = -1;
  int joined_rank = -1;

 private:
  void read() {
    net::async_read_until(
        sock_, buf_, '\n', [self = shared_from_this()](boost::system::error_code ec, size_t n) {
          if (ec) {
            self->srv_->on_conn_closed(self.get());
            return self->close();
          }
          std::string line(net::buffers_begin(self->buf_.data()),
                           net::buffers_begin(self->buf_.data()) + static_cast<std::ptrdiff_t>(n));
          self->buf_.consume(n);
          nlohmann::json req;
          try {
            req = nlohmann::json::parse(line);
          } catch (const std::exception& e) {
            self->reply(err_reply(Errc::usage, std::string("bad rendezvous request: ") + e.what()));
            return self->read();
          }
          try {
            self->srv_->handle(self, req);
          } catch (const std::exception& e) {
            self->reply(err_reply(Errc::usage, std::string("bad rendezvous request: ") + e.what()));
          }
          self->read();
        });
  }
  void write() {
    if (writing_ || outq_.empty()) return;
    writing_ = true;
    net::async_write(sock_, net::buffer(outq_.front()),
                     [self = shared_from_this()](boost::system::error_code ec, size_t) {
                       self->writing_ = false;
                       if (ec) return self->close();
                       self->outq_.pop_front();
                       self->write();
                     });
  }
  tcp::socket sock_;
  net::streambuf buf_;
  std::shared_ptr<RendezvousServer::Impl> srv_;
  std::deque<std::string> outq_;
  bool writing_ = false;
};

void RendezvousServer::Impl::accept() {
  acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, tcp::socket s) {
    if (ec == net::error::operation_aborted || self->closed) return;
    if (!ec) {
      boost::system::error_code ig;
      s.set_option(tcp::no_delay(true), ig);
      s.set_option(net::socket_base::keep_alive(true), ig);
      auto c = std::make_shared<RdzvConn>(std::move(s), self);
      auto& v = self->conns;
      v.erase(std::remove_if(v.begin(), v.end(), [](auto& w) { return w.expired(); }), v.end());
      v.push_back(c);
      c->start();
    }
    self->accept();
  });
}

void RendezvousServer::Impl::arm_sweep() {
  if (closed) return;
  if (!sweep) sweep.emplace(io);
  sweep->expires_after(std::min(milliseconds(250), hb_timeout / 4 + milliseconds(1)));
  sweep->async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (ec || self->closed) return;
    auto now = Clock::now();
    std::vector<std::pair<int, std::string>> lost;
    {
      std::lock_guard lk(self->mu);
      for (auto& r : self->ranks) {
        if (r.h.rank == 0 || !r.last || r.lost) continue;
        auto age = std::chrono::duration_cast<milliseconds>(now - *r.last);
        if (age > self->hb_timeout)
          lost.emplace_back(r.h.rank, "no heartbeat for " + std::to_string(age.count()) +
                                          " ms (HEARTBEAT_TIMEOUT " +
                                          std::to_string(self->hb_timeout.count()) + " ms)");
      }
    }
    for (auto& [r, why] : lost) self->mark_lost(r, why);
    self->arm_sweep();
  });
}

void RendezvousServer::Impl::mark_lost(int rank, const std::string& why) {
  std::lock_guard lk(mu);
  auto& r = ranks.at(static_cast<size_t>(rank));
  if (r.lost) return;
  r.lost = true;
  r.lost_why = why;
  r.h.alive = false;
  r.h.state = "down";
  log::error(kComp, "{} lost: {}", name_of(rank), why);
}

void RendezvousServer::Impl::on_conn_closed(RdzvConn* c) {
  if (closed) return;
  if (c->heartbeat_rank > 0)
    mark_lost(c->heartbeat_rank, "heartbeat connection closed (process gone?)");
}

nlohmann::json RendezvousServer::Impl::handle_join(const std::shared_ptr<RdzvConn>& c,
                                                   const nlohmann::json& req) {
  RankIdentity id = identity_from_json(req.at("identity"));
  if (id.rank < 0 || id.rank >= reference.world_size)
    return err_reply(Errc::usage, "rank " + std::to_string(id.rank) + " (host " + id.host +
                                      ") is outside the ring of " +
                                      std::to_string(reference.world_size) + " rank(s)");
  Status st = compare_identity(reference, id);
  std::lock_guard lk(mu);
  auto& r = ranks[static_cast<size_t>(id.rank)];
  if (!st.ok()) {
    r.refused = true;
    r.refused_why = st.message();
    r.h.state = "refused";
    r.h.reason = st.message();
    r.h.host = id.host;
    log::error(kComp, "{}", st.message());
    return err_reply(st.code(), st.message());
  }
  if (r.h.joined && r.h.pid != id.pid && !r.lost && id.rank != 0) {
    std::string m = name_of(id.rank) + " already joined from host " + r.h.host + " pid " +
                    std::to_string(r.h.pid) + "; a second process (host " + id.host + " pid " +
                    std::to_string(id.pid) + ") is refused: stop the ring and start it together";
    log::error(kComp, "{}", m);
    return err_reply(Errc::busy, m);
  }
  r.h.joined = true;
  r.h.alive = true;
  r.h.host = id.host;
  r.h.pid = id.pid;
  r.h.state = "loading";
  r.h.reason.clear();
  r.last = Clock::now();
  c->joined_rank = id.rank;
  log::info(kComp, "{} joined (host {}, pid {})", name_of(id.rank), id.host, id.pid);
  return {{"ok", true}, {"world_size", reference.world_size}};
}

void RendezvousServer::Impl::handle(const std::shared_ptr<RdzvConn>& c, const nlohmann::json& req) {
  std::string op = req.at("op").get<std::string>();
  if (op == "join") return c->reply(handle_join(c, req));
  if (op == "heartbeat") {
    int rank = req.at("rank").get<int>();
    if (rank <= 0 || rank >= reference.world_size)
      return c->reply(err_reply(
          Errc::usage, "heartbeat from rank " + std::to_string(rank) + ", outside the followers"));
    c->heartbeat_rank = rank;
    nlohmann::json ring;
    {
      std::lock_guard lk(mu);
      auto& r = ranks[static_cast<size_t>(rank)];
      if (r.lost) {
        return c->reply(err_reply(
            Errc::precondition,
            name_of(rank) + " was declared lost (" + r.lost_why + "); restart the ring together"));
      }
      r.last = Clock::now();
      r.h.alive = true;
      r.h.state = req.value("state", "unknown");
      r.h.reason = req.value("reason", "");
      r.slots_total = req.value("slots_total", 0);
      r.slots_busy = req.value("slots_busy", 0);
      r.h.device = req.value("device", "");
      r.h.mem_available = req.value("mem_available", uint64_t{0});
      ring = {{"state", state_name(ring_state)}, {"reason", ring_reason}};
    }
    auto rep = ok_reply();
    rep["ring"] = ring;
    return c->reply(rep);
  }
  if (op == "set") {
    std::string key = req.at("key").get<std::string>();
    kv[key] = req.at("value").get<std::string>();
    auto it = get_waiters.find(key);
    if (it != get_waiters.end()) {
      for (auto& w : it->second) {
        w.timer->cancel();
        if (auto wc = w.conn.lock()) wc->reply({{"ok", true}, {"value", kv[key]}});
      }
      get_waiters.erase(it);
    }
    return c->reply(ok_reply());
  }
  if (op == "get") {
    std::string key = req.at("key").get<std::string>();
    auto it = kv.find(key);
    if (it != kv.end()) return c->reply({{"ok", true}, {"value", it->second}});
    milliseconds timeout(req.value("timeout_ms", 60000));
    auto timer = std::make_shared<net::steady_timer>(io, timeout);
    get_waiters[key].push_back(Waiter{c, timer, -1});
    std::weak_ptr<RdzvConn> wc = c;
    timer->async_wait([self = shared_from_this(), key, wc, timeout](boost::system::error_code ec) {
      if (ec) return;
      auto& v = self->get_waiters[key];
      v.erase(std::remove_if(v.begin(), v.end(),
                             [&](const Waiter& w) { return w.conn.lock() == wc.lock(); }),
              v.end());
      if (auto cc = wc.lock())
        cc->reply(err_reply(Errc::timeout,
                            "key '" + key + "' was not published within " + fmt_ms(timeout)));
    });
    return;
  }
  if (op == "barrier") {
    std::string name = req.at("name").get<std::string>();
    int rank = req.at("rank").get<int>();
    milliseconds timeout(req.value("timeout_ms", 60000));
    auto& arrived = barrier_arrived[name];
    arrived.insert(rank);
    if (static_cast<int>(arrived.size()) >= reference.world_size) {
      for (auto& w : barrier_waiters[name]) {
        w.timer->cancel();
        if (auto wc = w.conn.lock()) wc->reply(ok_reply());
      }
      barrier_waiters.erase(name);
      log::info(kComp, "barrier '{}': all {} rank(s) arrived", name, reference.world_size);
      return c->reply(ok_reply());
    }
    auto timer = std::make_shared<net::steady_timer>(io, timeout);
    barrier_waiters[name].push_back(Waiter{c, timer, rank});
    std::weak_ptr<RdzvConn> wc = c;
    timer->async_wait([self = shared_from_this(), name, rank, wc,
                       timeout](boost::system::error_code ec) {
      if (ec) return;
      auto& arr = self->barrier_arrived[name];
      std::string missing;
      for (int r = 0; r < self->reference.world_size; ++r)
        if (!arr.count(r)) missing += (missing.empty() ? "" : ", ") + self->name_of(r);
      arr.erase(rank);
      auto& v = self->barrier_waiters[name];
      v.erase(std::remove_if(v.begin(), v.end(), [&](const Waiter& w) { return w.rank == rank; }),
              v.end());
      std::string m =
          "barrier '" + name + "': " + missing + " did not arrive within " + fmt_ms(timeout);
      log::error(kComp, "{}", m);
      if (auto cc = wc.lock()) cc->reply(err_reply(Errc::timeout, m));
    });
    return;
  }
  c->reply(err_reply(Errc::usage, "unknown rendezvous op '" + op + "'"));
}

RendezvousServer::RendezvousServer(net::io_context& io, RankIdentity reference,
                                   std::vector<std::string> node_of_rank,
                                   milliseconds heartbeat_timeout)
    : impl_(std::make_shared<Impl>(io, std::move(reference), std::move(node_of_rank),
                                   heartbeat_timeout)) {}

RendezvousServer::~RendezvousServer() {
  close();
}

Status RendezvousServer::listen(const std::string& bind, uint16_t port) {
  auto& I = *impl_;
  boost::system::error_code ec;
  auto addr = net::ip::make_address(bind, ec);
  if (ec) return make_error(Errc::config, "bad rendezvous address '" + bind + "'");
  tcp::endpoint ep(addr, port);
  I.acceptor.open(ep.protocol(), ec);
  if (!ec) I.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) I.acceptor.bind(ep, ec);
  if (!ec) I.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    return make_error(Errc::network, "rendezvous cannot listen on " + bind + ":" +
                                         std::to_string(port) + ": " + ec.message() +
                                         " (another sparkd still running? set RDZV_PORT)");
  I.port = I.acceptor.local_endpoint().port();
  net::post(I.io, [self = impl_] {
    self->accept();
    self->arm_sweep();
  });
  log::info(kComp, "store listening on {}:{} for {} rank(s)", bind, I.port, I.reference.world_size);
  return Status::Ok();
}

uint16_t RendezvousServer::port() const {
  return impl_->port;
}

void RendezvousServer::close() {
  net::post(impl_->io, [self = impl_] {
    if (self->closed) return;
    self->closed = true;
    boost::system::error_code ec;
    self->acceptor.close(ec);
    if (self->sweep) self->sweep->cancel();
    for (auto& [k, v] : self->barrier_waiters)
      for (auto& w : v) w.timer->cancel();
    for (auto& [k, v] : self->get_waiters)
      for (auto& w : v) w.timer->cancel();
    for (auto& w : self->conns)
      if (auto c = w.lock()) c->close();
  });
}

std::vector<RankHealth> RendezvousServer::ranks() const {
  std::lock_guard lk(impl_->mu);
  std::vector<RankHealth> out;
  auto now = Clock::now();
  for (const auto& r : impl_->ranks) {
    RankHealth h = r.h;
    if (r.last) h.last_seen_s = std::chrono::duration<double>(now - *r.last).count();
    out.push_back(h);
  }
  return out;
}

std::optional<RendezvousServer::Problem> RendezvousServer::problem() const {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  for (const auto& r : I.ranks) {
    if (r.h.rank == 0) continue;
    if (r.refused) return Problem{State::fatal, r.refused_why};
    if (r.lost) return Problem{State::fatal, I.name_of(r.h.rank) + " lost: " + r.lost_why};
    if (r.h.state == "fatal")
      return Problem{State::fatal, I.name_of(r.h.rank) + " is fatal: " + r.h.reason};
  }
  for (const auto& r : I.ranks) {
    if (r.h.rank == 0) continue;
    if (r.h.state == "stalled")
      return Problem{State::stalled, I.name_of(r.h.rank) + " is stalled: " + r.h.reason};
  }
  return std::nullopt;
}

bool RendezvousServer::followers_ready(std::string* why) const {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  for (const auto& r : I.ranks) {
    if (r.h.rank == 0) continue;
    if (!r.h.joined) {
      *why = I.name_of(r.h.rank) + " has not joined";
      return false;
    }
    if (r.h.state != "ready") {
      *why =
          I.name_of(r.h.rank) + " is " + r.h.state + (r.h.reason.empty() ? "" : ": " + r.h.reason);
      return false;
    }
  }
  return true;
}

void RendezvousServer::set_ring_state(State s, const std::string& reason) {
  std::lock_guard lk(impl_->mu);
  impl_->ring_state = s;
  impl_->ring_reason = reason;
}

// ---------------------------------------------------------------- client

struct RendezvousClient::Impl {
  std::string host;
  uint16_t port;
  std::string who;
  net::io_context io{1};
  tcp::socket sock{io};
  net::streambuf buf{kMaxLine};
  bool connected = false;
  std::atomic<bool> aborted{false};
  std::string where() const {
    return "rank 0's rendezvous at " + host + ":" + std::to_string(port);
  }
};

RendezvousClient::RendezvousClient(std::string host, uint16_t port, std::string who)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->who = std::move(who);
}

RendezvousClient::~RendezvousClient() {
  close();
}

void RendezvousClient::abort() {
  impl_->aborted = true;
  net::post(impl_->io, [this] {
    boost::system::error_code ec;
    impl_->sock.close(ec);
  });
}

void RendezvousClient::close() {
  boost::system::error_code ec;
  impl_->sock.shutdown(tcp::socket::shutdown_both, ec);
  impl_->sock.close(ec);
  impl_->connected = false;
}

Status RendezvousClient::connect(milliseconds deadline) {
  auto& I = *impl_;
  boost::system::error_code ec;
  auto addr = net::ip::make_address(I.host, ec);
  if (ec) return make_error(Errc::config, "bad rendezvous address '" + I.host + "'");
  tcp::endpoint ep(addr, I.port);
  auto end = Clock::now() + deadline;
  std::string last = "not tried";
  while (Clock::now() < end) {
    if (I.aborted) return make_error(Errc::network, I.who + ": stopping");
    close();
    std::optional<boost::system::error_code> res;
    I.sock.async_connect(ep, [&](boost::system::error_code e) { res = e; });
    I.io.restart();
    auto left = std::chrono::duration_cast<milliseconds>(end - Clock::now());
    I.io.run_for(std::max(milliseconds(1), std::min(left, milliseconds(2000))));
    if (res && !*res) {
      I.connected = true;
      I.sock.set_option(tcp::no_delay(true), ec);
      return Status::Ok();
    }
    if (!res) {
      close();
      I.io.restart();
      I.io.run();  // the cancelled connect completes now; `res` must outlive it
      last = "connect timed out";
    } else {
      last = res->message();
    }
    std::this_thread::sleep_for(milliseconds(200));
  }
  return make_error(Errc::timeout, I.who + ": " + I.where() +
                                       " did not accept a connection within " +
                                       std::to_string(deadline.count() / 1000) + " s (" + last +
                                       "); is rank 0 running and RDZV_PORT open on the fabric?");
}

Result<nlohmann::json> RendezvousClient::call(const nlohmann::json& request, milliseconds timeout) {
  auto& I = *impl_;
  if (I.aborted) return make_error(Errc::network, I.who + ": stopping");
  if (!I.connected) return make_error(Errc::network, I.who + ": not connected to " + I.where());
  std::string line = dump_json(request) + "\n";
  std::optional<boost::system::error_code> wres, rres;
  size_t nread = 0;
  net::async_write(I.sock, net::buffer(line), [&](boost::system::error_code e, size_t) {
    wres = e;
    if (e) return;
    net::async_read_until(I.sock, I.buf, '\n', [&](boost::system::error_code e2, size_t n) {
      rres = e2;
      nread = n;
    });
  });
  I.io.restart();
  I.io.run_for(timeout);
  std::string op = request.value("op", "?");
  if (!rres) {
    close();
    I.io.restart();
    I.io.run();  // the cancelled operations complete now; their captures must outlive them
    return make_error(Errc::timeout, I.who + ": " + op + " got no reply from " + I.where() +
                                         " within " + std::to_string(timeout.count()) + " ms");
  }
  if (*rres) {
    close();
    return make_error(Errc::network,
                      I.who + ": " + op + " to " + I.where() + " failed: " + rres->message());
  }
  std::string reply(net::buffers_begin(I.buf.data()),
                    net::buffers_begin(I.buf.data()) + static_cast<std::ptrdiff_t>(nread));
  I.buf.consume(nread);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(reply);
  } catch (const std::exception& e) {
    return make_error(Errc::network, I.who + ": bad reply from " + I.where() + ": " + e.what());
  }
  if (!j.value("ok", false)) {
    auto e = j.value("error", nlohmann::json::object());
    return make_error(errc_from_name(e.value("code", "internal")), e.value("message", "refused"));
  }
  return j;
}

Status RendezvousClient::join(const RankIdentity& id, milliseconds timeout) {
  auto r = call({{"op", "join"}, {"identity", to_json(id)}}, timeout);
  return r.ok() ? Status::Ok() : Status(r.error());
}

Status RendezvousClient::barrier(const std::string& name, int rank, milliseconds timeout) {
  // The store enforces the deadline and names the missing ranks; wait a little longer here.
  auto r =
      call({{"op", "barrier"}, {"name", name}, {"rank", rank}, {"timeout_ms", timeout.count()}},
           timeout + milliseconds(2000));
  return r.ok() ? Status::Ok() : Status(r.error());
}

Status RendezvousClient::set(const std::string& key, const std::string& value) {
  auto r = call({{"op", "set"}, {"key", key}, {"value", value}}, milliseconds(10000));
  return r.ok() ? Status::Ok() : Status(r.error());
}

Result<std::string> RendezvousClient::get(const std::string& key, milliseconds timeout) {
  auto r = call({{"op", "get"}, {"key", key}, {"timeout_ms", timeout.count()}},
                timeout + milliseconds(2000));
  if (!r) return r.error();
  return (*r).at("value").get<std::string>();
}

}  // namespace spark::daemon
