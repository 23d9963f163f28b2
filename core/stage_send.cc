#include "core/stage_send.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/log.h"
#include "core/pagecache.h"
#include "core/stage_wire.h"
#include "core/strings.h"

namespace spark::stage {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kCopyPiece = 4u << 20;  // pread+send piece where sendfile cannot be used

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using Buf = std::unique_ptr<char, FreeDeleter>;

// Bounds the chunks queued or in flight: the reader takes a slot per chunk, the chunk gives
// it back when every target is done with it.
class Slots {
 public:
  explicit Slots(size_t n) : left_(n) {}
  void take() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [&] { return left_ > 0; });
    --left_;
  }
  void give() {
    {
      std::lock_guard<std::mutex> g(mu_);
      ++left_;
    }
    cv_.notify_one();
  }

 private:
  size_t left_;
  std::mutex mu_;
  std::condition_variable cv_;
};

// One source file, open while any of its chunks is queued or in flight. When the last chunk
// is done on every target, its page cache is dropped (unless --keep-cache) and it is closed.
struct SourceFile {
  int fd = -1;
  std::string path;
  bool evict = true;
  ~SourceFile() {
    if (fd < 0) return;
    if (evict) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
};

// A chunk to send: either a range of a source file (sent with sendfile from the page cache,
// no copy through user space) or bytes in memory (chain mode: what a receiver verified).
struct ChunkBuf {
  uint32_t file = 0, chunk = 0;
  uint64_t len = 0;
  uint64_t offset = 0;              // in src
  std::shared_ptr<SourceFile> src;  // set: send len bytes of src at offset
  Buf data;                         // otherwise: len bytes here
  Slots* slots = nullptr;
  ~ChunkBuf() {
    if (slots) slots->give();
  }
};

// Sends len bytes of f at off on c: sendfile where the kernel allows it, else pread + send.
// Fault injection (test double): corrupt flips the first byte on the wire.
Status send_file_range(Conn& c, const SourceFile& f, uint64_t off, uint64_t len, bool corrupt,
                       const std::string& node) {
  auto gone = [&](ssize_t k, uint64_t at) {
    return make_error(Errc::io,
                      fmt::format("source: cannot read {} at {} for {}: {}", f.path, at, node,
                                  k == 0 ? "file shrank (changed since the manifest was made?)"
                                         : std::strerror(errno)));
  };
  uint64_t done = 0;
  if (!corrupt) {
    while (done < len) {
      off_t o = static_cast<off_t>(off + done);
      ssize_t k = ::sendfile(c.fd(), f.fd, &o, static_cast<size_t>(len - done));
      if (k > 0) {
        done += static_cast<uint64_t>(k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EINVAL || errno == ENOSYS) && done == 0) break;  // no splice here
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return make_error(Errc::timeout,
                          fmt::format("{} did not take data (stalled or gone)", c.peer()));
      if (k < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN))
        return make_error(Errc::network,
                          fmt::format("sending to {}: {} (the peer closed the connection: "
                                      "killed, crashed or out of disk?)",
                                      c.peer(), std::strerror(errno)));
      return gone(k, off + done);
    }
    if (done == len) return {};
  }
  std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(len - done, kCopyPiece)));
  while (done < len) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(len - done, buf.size()));
    ssize_t k = ::pread(f.fd, buf.data(), want, static_cast<off_t>(off + done));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return gone(k, off + done);
    if (corrupt && done == 0) buf[0] = static_cast<char>(buf[0] ^ 0x5a);
    SPARK_TRY(c.send_all(buf.data(), static_cast<size_t>(k)));
    done += static_cast<uint64_t>(k);
  }
  return {};
}

struct TargetRun {
  TargetSpec spec;
  TargetResult res;
  Conn control;
  std::vector<std::vector<bool>> need;  // [file][chunk]
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<ChunkBuf>> q;
  bool closed = false;
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> acked{0}, sent{0}, chunks{0}, resent{0};
  std::atomic<int64_t> sent_count{0};

  void fail(Errc code, const std::string& msg) {
    std::lock_guard<std::mutex> g(mu);
    if (!failed.exchange(true)) {
      res.code = code;
      res.error = msg;
    }
    q.clear();
    cv.notify_all();
  }
};

Errc errc_from_wire(uint8_t s) {
  return s > 0 && s <= static_cast<uint8_t>(Errc::internal) ? static_cast<Errc>(s) : Errc::remote;
}

// Reads an ERROR frame's message.
Error wire_error(Conn& c, const Header& h) {
  auto msg = c.recv_payload(h);
  return make_error(errc_from_wire(h.status), msg ? *msg : "receiver reported an error");
}

Status hello(Conn& c, const std::string& token, uint32_t stream) {
  return c.send_frame(Header{Frame::hello, 0, stream, 0, token.size()}, token.data());
}

Status decode_need(TargetRun& t, const json& files, const Manifest& m);

// Connects the control stream, sends the manifest and reads the plan.
Status plan_target(TargetRun& t, const Manifest& m, const std::string& manifest_text,
                   const SendOptions& o) {
  if (t.spec.addrs.empty())
    return make_error(Errc::config, fmt::format("{}: no fabric address", t.spec.node));
  auto c = connect_to(t.spec.addrs[0].first, t.spec.addrs[0].second, o.timeout, t.spec.node);
  if (!c) return c.error();
  t.control = std::move(*c);
  json req = {{"manifest", manifest_text}, {"deep", o.deep}, {"keep_cache", o.keep_cache}};
  std::string body = req.dump();
  Status sent = hello(t.control, t.spec.token, 0);
  if (sent) sent = t.control.send_frame(Header{Frame::manifest, 0, 0, 0, body.size()}, body.data());
  t.control.set_timeout(o.plan_timeout);
  Result<Header> h = sent ? t.control.recv_header() : Result<Header>(sent.error());
  if (!h) {
    if (h.error().code == Errc::network)
      return make_error(Errc::auth, fmt::format("{}: the receiver closed the control connection "
                                                "before answering (wrong token, or it exited: "
                                                "see its log): {}",
                                                t.spec.node, h.error().message));
    return h.error();
  }
  if (h->type == Frame::error) return wire_error(t.control, *h);
  if (h->type != Frame::plan)
    return make_error(Errc::network, fmt::format("{}: expected PLAN", t.spec.node));
  auto text = t.control.recv_payload(*h);
  if (!text) return text.error();
  auto p = json::parse(*text, nullptr, false);
  if (p.is_discarded() || !p.is_object() || !p.contains("files") || !p["files"].is_array())
    return make_error(Errc::network, fmt::format("{}: malformed PLAN", t.spec.node));
  t.control.set_timeout(o.timeout);
  t.res.need_bytes = p.value("need_bytes", uint64_t{0});
  t.res.skip_bytes = p.value("skip_bytes", uint64_t{0});
  t.res.skip_files = p.value("skip_files", uint64_t{0});
  t.res.resume_bytes = p.value("resume_bytes", uint64_t{0});
  t.res.resume_mismatch_chunks = p.value("resume_mismatch_chunks", uint64_t{0});
  t.res.fs_free = p.value("fs_free", uint64_t{0});
  t.res.fs_total = p.value("fs_total", uint64_t{0});
  t.res.fs_used = p.value("fs_used", uint64_t{0});
  auto why = space_problem(t.spec.node, p.value("new_bytes", uint64_t{0}), t.res.fs_free,
                           t.res.fs_total, t.res.fs_used, o.max_use_pct);
  if (!why.empty()) return make_error(Errc::resource, why);
  return decode_need(t, p["files"], m);
}

// Decodes the plan's ranges into need bits (validated against the manifest).
Status decode_need(TargetRun& t, const json& files, const Manifest& m) {
  if (files.size() != m.files.size())
    return make_error(Errc::network, fmt::format("{}: PLAN lists {} files, manifest {}",
                                                 t.spec.node, files.size(), m.files.size()));
  t.need.resize(m.files.size());
  for (size_t i = 0; i < m.files.size(); ++i) {
    uint64_t n = m.chunk_count(m.files[i].size);
    t.need[i].assign(n, false);
    if (!files[i].is_array()) return make_error(Errc::network, "malformed PLAN ranges");
    for (const auto& r : files[i]) {
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_unsigned() ||
          !r[1].is_number_unsigned())
        return make_error(Errc::network, "malformed PLAN range");
      uint64_t a = r[0].get<uint64_t>(), b = r[1].get<uint64_t>();
      if (a > b || b > n) return make_error(Errc::network, "PLAN range out of bounds");
      for (uint64_t c = a; c < b; ++c) t.need[i][c] = true;
    }
  }
  return {};
}

void stream_loop(TargetRun& t, int stream, const SendOptions& o) {
  // sendfile has no MSG_NOSIGNAL: with SIGPIPE blocked in this thread, a peer that died
  // gives EPIPE (a clear error naming the node) instead of killing the process. The pending
  // signal goes away with the thread.
  sigset_t pipe_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, nullptr);
  const auto& addr = t.spec.addrs[static_cast<size_t>(stream) % t.spec.addrs.size()];
  auto c = connect_to(addr.first, addr.second, o.timeout, t.spec.node);
  if (!c) return t.fail(c.error().code, c.error().message);
  if (auto s = hello(*c, t.spec.token, static_cast<uint32_t>(stream + 1)); !s)
    return t.fail(s.code(), s.message());
  std::vector<char> flipped;
  for (;;) {
    std::shared_ptr<ChunkBuf> b;
    {
      std::unique_lock<std::mutex> g(t.mu);
      t.cv.wait(g, [&] { return !t.q.empty() || t.closed || t.failed.load(); });
      if (t.failed.load()) return;
      if (t.q.empty()) break;
      b = std::move(t.q.front());
      t.q.pop_front();
      t.cv.notify_all();  // a forwarder's push() may wait for room
    }
    for (int attempt = 0;; ++attempt) {
      if (attempt >= 4)
        return t.fail(Errc::integrity,
                      fmt::format("{}: file #{} chunk {} was rejected {} times (hash mismatch "
                                  "on arrival); check the link and the target's memory",
                                  t.spec.node, b->file, b->chunk, attempt));
      Header h{Frame::chunk, 0, b->file, b->chunk, b->len};
      Status s = c->send_header(h);
      int64_t nth = t.sent_count++;
      // Fault injection (test double): one flipped byte on the wire.
      const bool corrupt = attempt == 0 && nth == o.fault_corrupt_chunk && b->len > 0;
      if (s && b->src) {
        s = send_file_range(*c, *b->src, b->offset, b->len, corrupt, t.spec.node);
      } else if (s && corrupt) {
        char x = static_cast<char>(b->data.get()[0] ^ 0x5a);
        s = c->send_all(&x, 1);
        if (s) s = c->send_all(b->data.get() + 1, b->len - 1);
      } else if (s) {
        s = c->send_all(b->data.get(), b->len);
      }
      if (!s)
        return t.fail(s.code(), fmt::format("{} (while sending file #{} chunk {}); run "
                                            "stage-weights again to resume",
                                            s.message(), b->file, b->chunk));
      t.sent += b->len;
      ++t.chunks;
      auto a = c->recv_header();
      if (!a)
        return t.fail(a.error().code, fmt::format("{} (waiting for the ack of file #{} chunk "
                                                  "{}); run stage-weights again to resume",
                                                  a.error().message, b->file, b->chunk));
      if (a->type == Frame::error) {
        auto e = wire_error(*c, *a);
        return t.fail(e.code, e.message);
      }
      if (a->type != Frame::ack || a->a != b->file || a->b != b->chunk)
        return t.fail(Errc::network, fmt::format("{}: out-of-order ack", t.spec.node));
      if (o.fault_delay_ms > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(o.fault_delay_ms));
      if (a->status == static_cast<uint8_t>(AckStatus::ok)) {
        t.acked += b->len;
        break;
      }
      ++t.resent;
      log::warn("stage", "{}: file #{} chunk {} arrived damaged; sending it again", t.spec.node,
                b->file, b->chunk);
    }
  }
  (void)c->send_frame(Header{Frame::done, 0, 0, 0, 0});
}

json encode_need(const std::vector<std::vector<bool>>& need) {
  json files = json::array();
  for (const auto& f : need) {
    json r = json::array();
    for (size_t c = 0; c < f.size();) {
      if (!f[c]) {
        ++c;
        continue;
      }
      size_t a = c;
      while (c < f.size() && f[c]) ++c;
      r.push_back({a, c});
    }
    files.push_back(std::move(r));
  }
  return files;
}

class ForwarderImpl final : public Forwarder {
 public:
  ForwarderImpl(const TargetSpec& next, int streams, std::chrono::milliseconds timeout) {
    run_.spec = next;
    run_.res.node = next.node;
    opts_.timeout = timeout;
    streams_ = std::max(1, streams);
  }
  ~ForwarderImpl() override { (void)finish(); }
  void begin() {
    for (int s = 0; s < streams_; ++s) th_.emplace_back([this, s] { stream_loop(run_, s, opts_); });
  }
  TargetRun& run() { return run_; }
  bool needs(uint32_t file, uint32_t chunk) const override {
    return file < run_.need.size() && chunk < run_.need[file].size() && run_.need[file][chunk];
  }
  void push(uint32_t file, uint32_t chunk, char* data, uint64_t len) override {
    auto b = std::make_shared<ChunkBuf>();
    b->file = file;
    b->chunk = chunk;
    b->len = len;
    b->data.reset(data);
    std::unique_lock<std::mutex> g(run_.mu);
    run_.cv.wait(
        g, [&] { return run_.q.size() < static_cast<size_t>(2 * streams_) || run_.failed.load(); });
    if (run_.failed.load()) return;
    run_.q.push_back(std::move(b));
    run_.cv.notify_all();
  }
  Status finish() override {
    if (finished_) return status_;
    finished_ = true;
    {
      std::lock_guard<std::mutex> g(run_.mu);
      run_.closed = true;
      run_.cv.notify_all();
    }
    for (auto& t : th_) t.join();
    if (run_.failed.load()) status_ = make_error(run_.res.code, run_.res.error);
    return status_;
  }
  uint64_t bytes_sent() const override { return run_.sent.load(); }
  const std::string& node() const override { return run_.spec.node; }

 private:
  TargetRun run_;
  SendOptions opts_;
  int streams_ = 1;
  std::vector<std::thread> th_;
  bool finished_ = false;
  Status status_;
};

}  // namespace

Result<std::unique_ptr<Forwarder>> Forwarder::start(const TargetSpec& next, const Manifest& m,
                                                    const std::string& need_ranges_json,
                                                    int streams,
                                                    std::chrono::milliseconds timeout) {
  if (next.addrs.empty())
    return make_error(Errc::config, fmt::format("forward to {}: no address", next.node));
  auto f = std::make_unique<ForwarderImpl>(next, streams, timeout);
  auto j = json::parse(need_ranges_json, nullptr, false);
  if (j.is_discarded() || !j.is_array())
    return make_error(Errc::network, "FORWARD: malformed need ranges");
  SPARK_TRY(decode_need(f->run(), j, m));
  f->begin();
  return std::unique_ptr<Forwarder>(std::move(f));
}

std::string space_problem(const std::string& node, uint64_t new_bytes, uint64_t fs_free,
                          uint64_t fs_total, uint64_t fs_used, int max_use_pct) {
  if (new_bytes > fs_free)
    return fmt::format(
        "{}: the target filesystem has {} free but staging needs {} more; free "
        "space there (nothing was sent)",
        node, format_size(fs_free), format_size(new_bytes));
  if (fs_total > 0 && max_use_pct > 0) {
    long double after =
        static_cast<long double>(fs_used + new_bytes) * 100.0L / static_cast<long double>(fs_total);
    if (after > static_cast<long double>(max_use_pct))
      return fmt::format(
          "{}: staging {} would fill the target filesystem to {:.0f}%, above "
          "DISK_MAX_USE={}% (kubelet starts evicting images at 85%); free space "
          "or raise DISK_MAX_USE (nothing was sent)",
          node, format_size(new_bytes), static_cast<double>(after), max_use_pct);
  }
  return "";
}

namespace {

// 1. Every target's plan, in parallel (a --deep plan hashes the target's files). On any
// failure nothing was sent: every receiver is told to stop (they keep no new state).
Status plan_all(std::vector<std::unique_ptr<TargetRun>>& runs, const Manifest& m,
                const std::string& manifest_text, const SendOptions& o) {
  std::vector<std::thread> th;
  std::vector<Status> st(runs.size());
  for (size_t i = 0; i < runs.size(); ++i)
    th.emplace_back([&, i] { st[i] = plan_target(*runs[i], m, manifest_text, o); });
  for (auto& x : th) x.join();
  std::string errs;
  Errc code = Errc::ok;
  for (size_t i = 0; i < runs.size(); ++i)
    if (!st[i]) {
      errs += (errs.empty() ? "" : "; ") + st[i].message();
      if (code == Errc::ok) code = st[i].code();
    }
  if (!errs.empty()) {
    // Nothing was sent: tell every receiver to stop (they keep no new state).
    for (auto& t : runs) {
      if (!t->control.valid()) continue;
      std::string why = "stage-weights aborted before sending: " + errs;
      (void)t->control.send_frame(Header{Frame::abort, 0, 0, 0, why.size()}, why.data());
    }
    return make_error(code, errs);
  }
  return Status::Ok();
}

// Chain mode: target i forwards to target i+1 everything that i+1 and later need; the
// source feeds only target 0. Sends each target its FORWARD frame and waits for the acks.
Status set_up_chain(std::vector<std::unique_ptr<TargetRun>>& runs, const SendOptions& o) {
  std::vector<std::vector<std::vector<bool>>> u(runs.size());
  u.back() = runs.back()->need;
  for (size_t i = runs.size() - 1; i-- > 0;) {
    u[i] = runs[i]->need;
    for (size_t f = 0; f < u[i].size(); ++f)
      for (size_t c = 0; c < u[i][f].size(); ++c)
        if (u[i + 1][f][c]) u[i][f][c] = true;
  }
  std::string errs;
  Errc code = Errc::ok;
  for (size_t i = 0; i + 1 < runs.size(); ++i) {
    const auto& next = runs[i + 1]->spec;
    json addrs = json::array();
    for (const auto& a : next.addrs) addrs.push_back({a.first, a.second});
    json fw = {{"node", next.node},
               {"addrs", addrs},
               {"token", next.token},
               {"streams", std::max(1, o.streams)},
               {"need", encode_need(u[i + 1])}};
    std::string body = fw.dump();
    auto& c = runs[i]->control;
    Status st = c.send_frame(Header{Frame::forward, 0, 0, 0, body.size()}, body.data());
    Result<Header> h = st ? c.recv_header() : Result<Header>(st.error());
    if (h && h->type == Frame::error) h = wire_error(c, *h);
    if (h && h->type != Frame::forward)
      h = make_error(Errc::network, fmt::format("{}: expected FORWARD ack", runs[i]->spec.node));
    if (!h) {
      errs += (errs.empty() ? "" : "; ") + h.error().message;
      if (code == Errc::ok) code = h.error().code;
    }
  }
  if (!errs.empty()) {
    for (auto& t : runs) {
      std::string why = "stage-weights aborted before sending: " + errs;
      (void)t->control.send_frame(Header{Frame::abort, 0, 0, 0, why.size()}, why.data());
    }
    return make_error(code, errs);
  }
  runs[0]->need = u[0];
  for (size_t i = 1; i < runs.size(); ++i)
    for (auto& f : runs[i]->need) std::fill(f.begin(), f.end(), false);
  return Status::Ok();
}

// 2b. The reader walks the needed chunks in file order and queues each once for every target
// that needs it; it asks the kernel to read the chunk ahead (the disk is read once, in
// large sequential requests) and the streams sendfile it from the page cache: no copy
// through user space, and the same pages serve every target. A file's cache is dropped
// when its last chunk is done on every target (Slots bound what is queued or in flight).
// The paths read go to *read_paths.
Status read_and_queue(const std::string& dir, const Manifest& m,
                      std::vector<std::unique_ptr<TargetRun>>& runs, Slots& slots,
                      const SendOptions& o, SendReport* rep, std::vector<std::string>* read_paths) {
  Status read_status;
  for (size_t fi = 0; fi < m.files.size() && read_status; ++fi) {
    const auto& f = m.files[fi];
    uint64_t n = m.chunk_count(f.size);
    bool any = false;
    for (auto& t : runs)
      for (uint64_t c = 0; c < n && !any; ++c) any = !t->failed.load() && t->need[fi][c];
    if (!any) continue;
    auto src = std::make_shared<SourceFile>();
    src->path = dir + "/" + f.path;
    read_paths->push_back(src->path);
    src->evict = !o.keep_cache;
    src->fd = ::open(src->path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (src->fd < 0) {
      read_status = make_error(
          Errc::io, fmt::format("source: cannot open {}: {}", src->path, std::strerror(errno)));
      break;
    }
    struct stat sb {};
    if (::fstat(src->fd, &sb) != 0 || static_cast<uint64_t>(sb.st_size) < f.size) {
      read_status = make_error(
          Errc::io, fmt::format("source: {} is {} bytes, the manifest says {} (changed since the "
                                "manifest was made? run `sparkctl manifest` again)",
                                src->path, sb.st_size, f.size));
      break;
    }
    ::posix_fadvise(src->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    for (uint64_t c = 0; c < n; ++c) {
      std::vector<TargetRun*> to;
      for (auto& t : runs)
        if (!t->failed.load() && t->need[fi][c]) to.push_back(t.get());
      if (to.empty()) continue;
      slots.take();
      auto b = std::make_shared<ChunkBuf>();
      b->slots = &slots;
      b->file = static_cast<uint32_t>(fi);
      b->chunk = static_cast<uint32_t>(c);
      b->len = m.chunk_len(f.size, c);
      b->offset = c * m.chunk_size;
      b->src = src;
      ::posix_fadvise(src->fd, static_cast<off_t>(b->offset), static_cast<off_t>(b->len),
                      POSIX_FADV_WILLNEED);
      rep->bytes_read += b->len;
      for (auto* t : to) {
        std::lock_guard<std::mutex> g(t->mu);
        if (!t->failed.load()) t->q.push_back(b);
        t->cv.notify_one();
      }
    }
  }
  return read_status;
}

// 3. The final pass on one target: finalize, verify against the manifest, evict, report.
void finish_target(TargetRun* t, const SendOptions& o) {
  if (t->failed.load()) {
    std::string why = t->res.error;
    (void)t->control.send_frame(Header{Frame::abort, 0, 0, 0, why.size()}, why.data());
    return;
  }
  json req = {{"keep_cache", o.keep_cache}};
  std::string body = req.dump();
  t->control.set_timeout(o.plan_timeout);
  auto s = t->control.send_frame(Header{Frame::finish, 0, 0, 0, body.size()}, body.data());
  if (!s) return t->fail(s.code(), s.message());
  auto h = t->control.recv_header();
  if (!h) return t->fail(h.error().code, h.error().message);
  if (h->type == Frame::error) {
    auto e = wire_error(t->control, *h);
    return t->fail(e.code, e.message);
  }
  auto text = t->control.recv_payload(*h);
  if (!text) return t->fail(text.error().code, text.error().message);
  t->res.receiver_report = *text;
  auto r = json::parse(*text, nullptr, false);
  if (r.is_discarded() || !r.value("ok", false)) {
    std::string why;
    if (!r.is_discarded() && r.contains("problems"))
      for (const auto& p : r["problems"])
        why += fmt::format("{}{}: {}", why.empty() ? "" : "; ", p.value("path", "?"),
                           p.value("problem", "?"));
    if (!r.is_discarded() && !r.value("error", std::string()).empty())
      why = r.value("error", std::string()) + (why.empty() ? "" : "; " + why);
    t->fail(Errc::integrity, fmt::format("{}: final verification failed: {}", t->spec.node,
                                         why.empty() ? "unreadable report" : why));
  }
}

// Each file's cache was dropped when its last chunk was acked, but pages that TCP still
// held then (sendfile lends them to the socket until the peer's TCP acks) stay: drop the
// cache of every file read once more, now that every target has reported, and drop again
// what is still resident while the last acks are processed. The retries share one bound
// (2 s for the whole model, not per file): pages that stay because another process maps
// the file cannot cost a pause per file. The report gets the bytes advised out (each file
// once) and those still resident at the end.
void drop_read_cache(const std::vector<std::string>& read_paths, SendReport* rep) {
  std::vector<std::string> left;
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  std::map<std::string, uint64_t> resident;
  for (const auto& path : read_paths) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    struct stat sb {};
    if (evict_fd(fd, false) && ::fstat(fd, &sb) == 0)
      rep->cache_dropped_bytes += static_cast<uint64_t>(sb.st_size);
    ::close(fd);
    left.push_back(path);
  }
  for (int k = 0; !left.empty(); ++k) {
    std::vector<std::string> still;
    for (const auto& path : left) {
      auto r = file_residency(path);
      resident[path] = r ? r->resident_bytes() : 0;
      if (resident[path] > 0) still.push_back(path);
    }
    left.swap(still);
    if (left.empty() || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20 * (k + 1), 200)));
    for (const auto& path : left) {
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
      if (fd < 0) continue;
      (void)evict_fd(fd, false);
      ::close(fd);
    }
  }
  for (const auto& [path, n] : resident) rep->cache_left_bytes += n;
}

// The report: per target what was sent (in a chain, what the previous target forwarded).
void fill_report(std::vector<std::unique_ptr<TargetRun>>& runs, bool chain, SendReport* rep) {
  rep->ok = true;
  for (size_t i = 0; i < runs.size(); ++i) {
    auto& t = runs[i];
    t->res.bytes_sent = t->sent.load();
    if (chain && i > 0) {
      // What the previous target forwarded to this one.
      auto r = json::parse(runs[i - 1]->res.receiver_report, nullptr, false);
      if (!r.is_discarded()) t->res.bytes_sent = r.value("forward_bytes", uint64_t{0});
    }
    t->res.chunks_sent = t->chunks.load();
    t->res.chunks_resent = t->resent.load();
    t->res.seconds = rep->seconds;
    t->res.ok = !t->failed.load();
    if (!t->res.ok) rep->ok = false;
    rep->targets.push_back(t->res);
  }
}

}  // namespace

Result<SendReport> send_model(const std::string& dir, const Manifest& m,
                              const std::vector<TargetSpec>& targets, const SendOptions& o) {
  auto t0 = Clock::now();
  SendReport rep;
  rep.digest = m.digest();
  rep.total_bytes = m.total_bytes();
  const std::string manifest_text = manifest_to_json(m);
  std::vector<std::unique_ptr<TargetRun>> runs;
  for (const auto& s : targets) {
    auto t = std::make_unique<TargetRun>();
    t->spec = s;
    t->res.node = s.node;
    runs.push_back(std::move(t));
  }
  SPARK_TRY(plan_all(runs, m, manifest_text, o));
  for (auto& t : runs) t->res.bytes_sent = 0;
  const bool chain = o.chain && runs.size() > 1;
  if (chain) SPARK_TRY(set_up_chain(runs, o));

  // 2. Streams per target, one reader for all: each needed chunk is read once.
  const int streams = std::max(1, o.streams);
  Slots slots(static_cast<size_t>(2 * streams + 2));
  std::vector<std::thread> senders;
  for (size_t i = 0; i < (chain ? 1 : runs.size()); ++i)
    for (int s = 0; s < streams; ++s)
      senders.emplace_back([&, s, t = runs[i].get()] { stream_loop(*t, s, o); });

  std::atomic<bool> done{false};
  std::thread progress;
  if (o.progress)
    progress = std::thread([&] {
      while (!done.load()) {
        Progress p;
        for (auto& t : runs) {
          p.targets.push_back({t->spec.node, t->acked.load(), t->res.need_bytes});
          p.done += t->acked.load();
          p.total += t->res.need_bytes;
        }
        p.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        o.progress(p);
        for (int i = 0; i < 5 && !done.load(); ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });

  std::vector<std::string> read_paths;
  Status read_status = read_and_queue(dir, m, runs, slots, o, &rep, &read_paths);
  for (auto& t : runs) {
    std::lock_guard<std::mutex> g(t->mu);
    t->closed = true;
    t->cv.notify_all();
  }
  for (auto& x : senders) x.join();
  for (auto& t : runs) t->q.clear();  // (after a failure) before `slots` goes away
  if (!read_status)
    for (auto& t : runs) t->fail(read_status.code(), read_status.message());

  std::vector<std::thread> fin;
  if (chain) {
    // In order: a target reports only after it forwarded everything downstream.
    for (auto& tp : runs) finish_target(tp.get(), o);
  } else {
    for (auto& tp : runs) fin.emplace_back([&, t = tp.get()] { finish_target(t, o); });
  }
  for (auto& x : fin) x.join();
  if (!o.keep_cache) drop_read_cache(read_paths, &rep);
  done.store(true);
  if (progress.joinable()) progress.join();

  rep.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  fill_report(runs, chain, &rep);
  return rep;
}

}  // namespace spark::stage
