// The rendezvous store and its clients over real loopback TCP.
#include "daemon/rendezvous.h"

#include <doctest/doctest.h>

#include <boost/asio.hpp>
#include <future>
#include <thread>
#include <utility>  // before Asio: Boost 1.74 awaitable.hpp uses std::exchange

#include "spark/version.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {

RankIdentity ident(int rank, int world) {
  RankIdentity id;
  id.rank = rank;
  id.world_size = world;
  id.node = std::string(1, static_cast<char>('a' + rank));
  id.host = "host-" + id.node;
  id.pid = 1000 + rank;
  id.version = kVersion;
  id.config_digest = "cfgdigest0123456789";
  id.model_digest = "";
  return id;
}

// A store on its own reactor thread, as rank 0 runs it.
struct Store {
  boost::asio::io_context io;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work{
      io.get_executor()};
  RendezvousServer server;
  std::thread thread;
  Store(int world, std::chrono::milliseconds hb)
      : server(io, ident(0, world), {"a", "b", "c", "d"}, hb) {
    REQUIRE(server.listen("127.0.0.1", 0).ok());
    thread = std::thread([this] { io.run(); });
  }
  ~Store() {
    server.close();
    work.reset();
    io.stop();
    thread.join();
  }
  std::unique_ptr<RendezvousClient> client(int rank) {
    auto c = std::make_unique<RendezvousClient>("127.0.0.1", server.port(),
                                                "rank " + std::to_string(rank));
    REQUIRE(c->connect(2000ms).ok());
    return c;
  }
};

template <typename Pred>
bool eventually(Pred p, std::chrono::milliseconds limit = 5000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (p()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return p();
}

}  // namespace

TEST_CASE("rendezvous: ranks join, meet at a barrier and share a blob") {
  Store s(3, 5000ms);
  auto c0 = s.client(0), c1 = s.client(1), c2 = s.client(2);
  REQUIRE(c0->join(ident(0, 3), 2000ms).ok());
  REQUIRE(c1->join(ident(1, 3), 2000ms).ok());
  REQUIRE(c2->join(ident(2, 3), 2000ms).ok());
  auto f1 = std::async(std::launch::async, [&] { return c1->barrier("joined", 1, 3000ms); });
  auto f2 = std::async(std::launch::async, [&] { return c2->barrier("joined", 2, 3000ms); });
  std::this_thread::sleep_for(50ms);
  CHECK(f1.wait_for(0ms) == std::future_status::timeout);  // rank 0 has not arrived yet
  REQUIRE(c0->barrier("joined", 0, 3000ms).ok());
  CHECK(f1.get().ok());
  CHECK(f2.get().ok());

  // Followers ask before rank 0 publishes; they get it when it does.
  auto g1 = std::async(std::launch::async, [&] { return c1->get("nccl_id", 3000ms); });
  std::this_thread::sleep_for(50ms);
  std::string blob(128, '\0');
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<char>('A' + i % 26);
  REQUIRE(c0->set("nccl_id", blob).ok());
  auto v1 = g1.get();
  REQUIRE(v1.ok());
  CHECK(*v1 == blob);
  auto v2 = c2->get("nccl_id", 1000ms);
  REQUIRE(v2.ok());
  CHECK(*v2 == blob);
  auto ranks = s.server.ranks();
  REQUIRE(ranks.size() == 3);
  CHECK(ranks[2].joined);
  CHECK(ranks[2].host == "host-c");
  CHECK_FALSE(s.server.problem().has_value());
}

TEST_CASE("rendezvous: a barrier deadline names the ranks that did not arrive") {
  Store s(4, 5000ms);
  auto c0 = s.client(0), c1 = s.client(1);
  auto f1 = std::async(std::launch::async, [&] { return c1->barrier("loaded", 1, 300ms); });
  Status st0 = c0->barrier("loaded", 0, 300ms);
  Status st1 = f1.get();
  REQUIRE_FALSE(st0.ok());
  CHECK(st0.code() == Errc::timeout);
  CHECK(st0.message().find("rank 2 (node c), rank 3 (node d) did not arrive") != std::string::npos);
  CHECK(st1.code() == Errc::timeout);
  auto g = c1->get("never", 200ms);
  REQUIRE_FALSE(g.ok());
  CHECK(g.error().code == Errc::timeout);
  CHECK(g.error().message.find("'never'") != std::string::npos);
}

TEST_CASE("rendezvous: an identity mismatch is refused naming the rank and the field") {
  Store s(2, 5000ms);
  auto c1 = s.client(1);
  RankIdentity bad = ident(1, 2);
  bad.config_digest = "otherdigest";
  Status st = c1->join(bad, 2000ms);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::integrity);
  CHECK(st.message().find("rank 1 (node b") != std::string::npos);
  CHECK(st.message().find("config_digest") != std::string::npos);
  auto p = s.server.problem();
  REQUIRE(p.has_value());
  CHECK(p->state == State::fatal);
  CHECK(p->reason.find("config_digest") != std::string::npos);

  RankIdentity v = ident(1, 2);
  v.version = "0.0.0-other";
  Status sv = compare_identity(ident(0, 2), v);
  CHECK(sv.message().find("version") != std::string::npos);
  RankIdentity m = ident(1, 2);
  m.model_digest = "abc";
  CHECK(compare_identity(ident(0, 2), m).message().find("model_digest") != std::string::npos);
  CHECK(compare_identity(ident(0, 2), ident(1, 2)).ok());
}

TEST_CASE("rendezvous: a follower whose heartbeat connection closes is lost at once") {
  Store s(2, 5000ms);
  auto c1 = s.client(1);
  REQUIRE(c1->join(ident(1, 2), 2000ms).ok());
  auto hb = s.client(1);
  auto r = hb->call({{"op", "heartbeat"}, {"rank", 1}, {"state", "ready"}}, 2000ms);
  REQUIRE(r.ok());
  CHECK((*r)["ring"].contains("state"));
  std::string why;
  CHECK(s.server.followers_ready(&why));
  hb->close();
  // "At once" is a cause, not a time: the closed connection, never the 5 s timeout.
  REQUIRE(eventually([&] { return s.server.problem().has_value(); }, 4000ms));
  CHECK(s.server.problem()->reason.find("rank 1 (node b) lost") != std::string::npos);
  CHECK(s.server.problem()->reason.find("heartbeat connection closed") != std::string::npos);
  CHECK_FALSE(s.server.ranks()[1].alive);
}

TEST_CASE("rendezvous: a follower's stalled state is passed on with its reason") {
  // No heartbeat can time out during this test (60 s), so the state seen is the one sent.
  Store s(3, 60000ms);
  auto c1 = s.client(1), c2 = s.client(2);
  REQUIRE(c1->join(ident(1, 3), 2000ms).ok());
  REQUIRE(c2->join(ident(2, 3), 2000ms).ok());
  auto hb2 = s.client(2);
  REQUIRE(hb2->call({{"op", "heartbeat"},
                     {"rank", 2},
                     {"state", "stalled"},
                     {"reason", "decode step 90 s"}},
                    1000ms)
              .ok());
  auto hb1 = s.client(1);
  REQUIRE(hb1->call({{"op", "heartbeat"}, {"rank", 1}, {"state", "loading"}}, 1000ms).ok());
  auto p = s.server.problem();
  REQUIRE(p.has_value());
  CHECK(p->state == State::stalled);
  CHECK(p->reason.find("rank 2 (node c) is stalled: decode step 90 s") != std::string::npos);
}

TEST_CASE("rendezvous: a silent follower is lost after the heartbeat timeout") {
  // Rank 1 is the only follower, so a loss can only be its own: the claims below follow
  // from rank 1 falling silent, however late the sweep runs on a loaded machine.
  Store s(2, 400ms);
  auto c1 = s.client(1);
  REQUIRE(c1->join(ident(1, 2), 2000ms).ok());
  auto hb1 = s.client(1);
  REQUIRE(hb1->call({{"op", "heartbeat"}, {"rank", 1}, {"state", "loading"}}, 1000ms).ok());
  // Rank 1 stays silent with its connection open.
  REQUIRE(eventually(
      [&] {
        auto q = s.server.problem();
        return q && q->state == State::fatal;
      },
      5000ms));
  auto p = s.server.problem();
  CHECK(p->reason.find("rank 1") != std::string::npos);
  CHECK(p->reason.find("no heartbeat") != std::string::npos);
  // A lost rank's later heartbeat is told so (it must not linger).
  auto late = hb1->call({{"op", "heartbeat"}, {"rank", 1}, {"state", "ready"}}, 1000ms);
  REQUIRE_FALSE(late.ok());
  CHECK(late.error().code == Errc::precondition);
}

TEST_CASE("rendezvous: a lost rank outranks a stalled one") {
  // Rank 2 reports stalled and then falls silent as well; whichever of the two is lost
  // first, the ring is fatal (never merely stalled) and says which rank is gone.
  Store s(3, 400ms);
  auto c1 = s.client(1), c2 = s.client(2);
  REQUIRE(c1->join(ident(1, 3), 2000ms).ok());
  REQUIRE(c2->join(ident(2, 3), 2000ms).ok());
  auto hb2 = s.client(2);
  REQUIRE(
      hb2->call({{"op", "heartbeat"}, {"rank", 2}, {"state", "stalled"}, {"reason", "x"}}, 1000ms)
          .ok());
  auto hb1 = s.client(1);
  REQUIRE(hb1->call({{"op", "heartbeat"}, {"rank", 1}, {"state", "loading"}}, 1000ms).ok());
  REQUIRE(eventually(
      [&] {
        auto q = s.server.problem();
        return q && q->state == State::fatal;
      },
      5000ms));
  auto p = s.server.problem();
  CHECK(p->reason.find("no heartbeat") != std::string::npos);
  CHECK((p->reason.find("rank 1") != std::string::npos ||
         p->reason.find("rank 2") != std::string::npos));
  // Once both are lost it stays fatal: a stalled report cannot bring the ring back.
  auto both_lost = [&] {
    int down = 0;
    for (const auto& r : s.server.ranks()) down += r.rank > 0 && r.state == "down";
    return down == 2;
  };
  REQUIRE(eventually(both_lost, 5000ms));
  CHECK(s.server.problem()->state == State::fatal);
}

TEST_CASE("rendezvous: connecting to a store that is not there fails with its address") {
  RendezvousClient c("127.0.0.1", 1, "rank 1");
  Status st = c.connect(500ms);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::timeout);  // its own deadline ended it
  CHECK(st.message().find("127.0.0.1:1") != std::string::npos);
}
