// The transport toolkit (backends/common/), tested without a NIC: option parsing and its errors,
// chunk splitting and the in-flight window, batch and completion bookkeeping, the API-side
// tables (peer states, region checks), and the progress thread's wake and sleep driven by a fake
// wire (an eventfd standing in for a completion channel).
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/common/backend_options.h"
#include "backends/common/batches.h"
#include "backends/common/inflight_window.h"
#include "backends/common/progress_thread.h"
#include "backends/common/tables.h"

namespace spi = pdlib::spi;
namespace toolkit = pdlib::toolkit;
using pdlib::Status;
using pdlib::StatusCode;
using pdlib::StatusOr;

namespace {

std::string Message(const Status& s) { return std::string(s.message()); }

}  // namespace

// --- options -------------------------------------------------------------------------------------

TEST_CASE("toolkit options: byte sizes with binary units") {
  CHECK(*toolkit::ParseByteSize("65536") == 65536);
  CHECK(*toolkit::ParseByteSize("64k") == 65536);
  CHECK(*toolkit::ParseByteSize("64K") == 65536);
  CHECK(*toolkit::ParseByteSize("4M") == uint64_t{4} << 20);
  CHECK(*toolkit::ParseByteSize("1gb") == uint64_t{1} << 30);
  CHECK(*toolkit::ParseByteSize("0") == 0);
  for (const char* bad : {"", "k", "1t", "1kk", "-1", "1 k", "17179869184g"}) {
    INFO(bad);
    auto r = toolkit::ParseByteSize(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(r.status()), Catch::Contains(std::string("'") + bad + "'"));
  }
}

TEST_CASE("toolkit options: numbers within bounds, units only where allowed") {
  using toolkit::Units;
  CHECK(*toolkit::ParseNumber("x", "x.n", "12", 1, 100) == 12);
  CHECK(*toolkit::ParseNumber("x", "x.n", "4k", 1, 1 << 20, Units::kBinary) == 4096);
  CHECK(*toolkit::ParseNumber("x", "x.n", "1M", 1, 1 << 20, Units::kBinary) == 1 << 20);
  struct Bad {
    const char* text;
    uint64_t min, max;
    Units units;
  };
  for (const Bad& b : {Bad{"0", 1, 100, Units::kNone}, Bad{"101", 1, 100, Units::kNone},
                       Bad{"4k", 1, 1 << 20, Units::kNone}, Bad{"2M", 1, 1 << 20, Units::kBinary},
                       Bad{"1x", 1, 100, Units::kBinary}, Bad{"", 0, 100, Units::kNone},
                       Bad{"k", 0, 100, Units::kBinary}, Bad{"5 ", 0, 100, Units::kNone}}) {
    INFO(b.text);
    auto r = toolkit::ParseNumber("x", "x.n", b.text, b.min, b.max, b.units);
    REQUIRE_FALSE(r.ok());
    CHECK(Message(r.status()) == "x: option x.n='" + std::string(b.text) +
                                     "' is not a number in [" + std::to_string(b.min) + ", " +
                                     std::to_string(b.max) + "]");
  }
}

TEST_CASE(
    "toolkit options: a table applies its keys, ignores other backends', names unknown ones") {
  enum class Mode { kA, kB };
  uint32_t depth = 7;
  uint64_t bytes = 0;
  Mode mode = Mode::kA;
  std::map<std::string, std::string> passed;
  std::string tls;
  auto make = [&] {
    toolkit::OptionParser p("wire");
    p.On("wire.tls", [&](const std::string&, const std::string& v) {
      tls = v;
      return Status::OK();
    });
    p.OnPrefix("wire.config.", "wire.config.<NAME>",
               [&](const std::string& k, const std::string& v) {
                 passed[k] = v;
                 return Status::OK();
               });
    p.Number("wire.depth", &depth, 2, 1024, toolkit::Units::kBinary);
    p.Bytes("wire.chunk_bytes", &bytes);
    p.Choice("wire.mode", &mode, {{"a", Mode::kA}, {"b", Mode::kB}});
    return p;
  };
  toolkit::OptionParser parser = make();
  CHECK(parser.KnownKeys() ==
        "wire.tls, wire.config.<NAME>, wire.depth, wire.chunk_bytes, wire.mode");

  Status ok = parser.Parse({{"wire.tls", "shm"},
                            {"wire.config.X_Y", "1"},
                            {"wire.depth", "1k"},
                            {"wire.chunk_bytes", "64k"},
                            {"wire.mode", "b"},
                            {"other.depth", "whatever"},  // another backend's: ignored
                            {"wiretls", "x"}});           // no prefix dot: not ours
  REQUIRE(ok.ok());
  CHECK(tls == "shm");
  CHECK(passed == std::map<std::string, std::string>{{"wire.config.X_Y", "1"}});
  CHECK(depth == 1024);
  CHECK(bytes == 65536);
  CHECK(mode == Mode::kB);

  struct Case {
    std::map<std::string, std::string> options;
    std::string expect;
  };
  const Case cases[] = {
      {{{"wire.dpeth", "4"}},
       "wire: unknown backend option 'wire.dpeth' (known: wire.tls, wire.config.<NAME>, "
       "wire.depth, wire.chunk_bytes, wire.mode)"},
      {{{"wire.depth", "1"}}, "wire: option wire.depth='1' is not a number in [2, 1024]"},
      {{{"wire.chunk_bytes", "0"}}, "wire: option wire.chunk_bytes must not be 0"},
      {{{"wire.chunk_bytes", "3q"}}, "wire: option wire.chunk_bytes: '3q' has an unknown unit"},
      {{{"wire.mode", "c"}}, "wire: option wire.mode='c' must be 'a' or 'b'"},
  };
  for (const Case& c : cases) {
    INFO(c.expect);
    Status s = make().Parse(c.options);
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s), Catch::StartsWith(c.expect));
  }
}

// --- window --------------------------------------------------------------------------------------

TEST_CASE("toolkit chunk splitting covers every byte once") {
  for (uint64_t chunk : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{64}, uint64_t{1} << 20}) {
    for (uint64_t length = 0; length < 300; ++length) {
      INFO("length " << length << " chunk " << chunk);
      uint64_t covered = 0, count = 0;
      while (covered < length) {
        uint64_t piece = toolkit::ChunkLength(length, covered, chunk);
        REQUIRE(piece > 0);
        if (chunk != 0) CHECK(piece <= chunk);
        if (covered + piece < length && chunk != 0)
          CHECK(piece == chunk);  // only the last is short
        covered += piece;
        ++count;
      }
      CHECK(covered == length);
      CHECK(count == toolkit::ChunkCount(length, chunk));
    }
  }
  CHECK(toolkit::ChunkCount(uint64_t{16} << 20, uint64_t{1} << 20) == 16);
  CHECK(toolkit::ChunkCount((uint64_t{16} << 20) + 1, uint64_t{1} << 20) == 17);
  CHECK(toolkit::ChunkLength(~uint64_t{0}, 0, 0) == ~uint64_t{0});
}

TEST_CASE("toolkit in-flight window bounds the bytes posted and never blocks forever") {
  toolkit::InflightWindow window(100);
  CHECK(window.CanPost(1000));  // nothing in flight: an oversized chunk still moves, alone
  window.OnPosted(1000);
  CHECK_FALSE(window.CanPost(1));
  window.OnCompleted(1000);
  CHECK(window.in_flight() == 0);
  window.OnPosted(60);
  CHECK(window.CanPost(40));
  CHECK_FALSE(window.CanPost(41));
  window.OnPosted(40);
  CHECK_FALSE(window.CanPost(1));
  window.OnCompleted(60);
  CHECK(window.CanPost(60));
  window.OnCompleted(1000);  // more than in flight: clamps instead of wrapping
  CHECK(window.in_flight() == 0);

  toolkit::InflightWindow unbounded(0);
  unbounded.OnPosted(~uint64_t{0} / 2);
  CHECK(unbounded.CanPost(~uint64_t{0} / 2));

  // A random schedule: in flight never exceeds the limit, except one oversized chunk alone.
  std::mt19937_64 rng(7);
  toolkit::InflightWindow w(1 << 20);
  std::vector<uint64_t> posted;
  for (int step = 0; step < 100000; ++step) {
    uint64_t size = 1 + rng() % (3 << 19);
    if (rng() % 2 == 0 && w.CanPost(size)) {
      w.OnPosted(size);
      posted.push_back(size);
    } else if (!posted.empty()) {
      size_t i = rng() % posted.size();
      w.OnCompleted(posted[i]);
      posted.erase(posted.begin() + static_cast<ptrdiff_t>(i));
    }
    uint64_t sum = std::accumulate(posted.begin(), posted.end(), uint64_t{0});
    REQUIRE(w.in_flight() == sum);
    REQUIRE((sum <= w.limit() || posted.size() == 1));
  }
}
// --- batches -------------------------------------------------------------------------------------

namespace {

struct TestBatch : toolkit::BatchBase<TestBatch> {
  std::shared_ptr<int> held;  // stands for the registrations a batch keeps alive
};

std::unique_ptr<TestBatch> MakeBatch(uint64_t seq, std::vector<std::string>* log,
                                     std::weak_ptr<int>* held_seen = nullptr) {
  auto batch = std::make_unique<TestBatch>();
  batch->seq = seq;
  batch->held = std::make_shared<int>(1);
  std::weak_ptr<int> held = batch->held;
  batch->done = [seq, log, held, held_seen](Status s) {
    log->push_back(std::to_string(seq) + ":" + (s.ok() ? "OK" : Message(s)) +
                   (held.expired() ? "" : ":held"));
    if (held_seen) *held_seen = held;
  };
  return batch;
}

}  // namespace

TEST_CASE("toolkit batches: complete when every part has, the first error wins") {
  std::vector<std::string> log;
  toolkit::BatchList<TestBatch> list;
  toolkit::Completions<TestBatch> completions;
  TestBatch& a = list.Add(MakeBatch(1, &log));
  TestBatch& b = list.Add(MakeBatch(2, &log));
  a.AddPart();
  a.AddPart();                // two parts plus the holding reference
  CHECK_FALSE(a.PartDone());  // the holding reference
  a.Fail(Status::Unavailable("first"));
  CHECK_FALSE(a.PartDone());
  a.Fail(Status::Cancelled("second"));  // later errors do not replace the first
  REQUIRE(a.PartDone());
  completions.Add(list.Remove(a));
  CHECK(list.size() == 1);
  CHECK(log.empty());  // callbacks wait for the safe point
  completions.Run();
  REQUIRE(log == std::vector<std::string>{"1:first"});  // and the batch was destroyed first
  CHECK(completions.empty());

  REQUIRE(b.PartDone());
  completions.Add(list.Remove(b));
  completions.Run();
  CHECK(log.back() == "2:OK");
  CHECK(list.empty());
}

TEST_CASE("toolkit completions: each callback once, then the waiters, callbacks may queue more") {
  std::vector<std::string> log;
  toolkit::BatchList<TestBatch> list;
  toolkit::Completions<TestBatch> completions;
  for (uint64_t seq = 1; seq <= 3; ++seq) list.Add(MakeBatch(seq, &log));
  std::promise<void> waiter;
  std::future<void> waited = waiter.get_future();
  completions.AddSignal(std::move(waiter));
  // A callback that completes another batch (as Disconnect from a callback does).
  auto first = list.TakeAll();
  REQUIRE(first.size() == 3);
  auto it = first.begin();
  std::unique_ptr<TestBatch> third = std::move(*std::next(it, 2));
  first.pop_back();
  auto chained = [&completions, &third, inner = std::move((*it)->done)](Status s) mutable {
    inner(std::move(s));
    completions.Add(std::move(third));
  };
  (*it)->done = std::move(chained);
  for (auto& batch : first) completions.Add(std::move(batch));
  completions.AddCall([&log](Status s) { log.push_back("orphan:" + Message(s)); },
                      Status::Cancelled("gone"));
  completions.Run();
  CHECK(log == std::vector<std::string>{"1:OK", "2:OK", "orphan:gone", "3:OK"});
  CHECK(waited.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
  completions.Run();  // nothing left: runs nothing twice
  CHECK(log.size() == 4);
}

// --- tables --------------------------------------------------------------------------------------

namespace {

struct Local {
  uint64_t length = 0;
};
struct Remote {
  uint64_t length = 0;
};
struct Peer {
  std::vector<Remote> regions;
  Status failure;
};
struct Target {
  bool fenced = false;
};

}  // namespace

TEST_CASE("toolkit tables: region ids start at 1 and are never reused") {
  toolkit::LocalRegions<Local> regions("wire");
  CHECK(regions.Find(0) == nullptr);
  const auto a = regions.Add({100});
  const auto b = regions.Add({200});
  CHECK(a == 1);
  CHECK(b == 2);
  REQUIRE(regions.Find(b) != nullptr);
  CHECK(regions.Find(b)->length == 200);
  REQUIRE(regions.Remove(a).ok());
  CHECK(regions.Find(a) == nullptr);
  auto again = regions.Remove(a);
  CHECK(again.status().code() == StatusCode::kNotFound);
  CHECK(Message(again.status()) == "wire: local region 1 not registered");
  CHECK(regions.Add({300}) == 3);
}

TEST_CASE("toolkit tables: a peer is connected, failed (first reason) or gone") {
  toolkit::PeerTable<Peer> peers("wire");
  const spi::PeerId id = peers.NextId();
  CHECK(peers.NextId() == id + 1);
  peers.Add(id, Peer{{Remote{64}}, Status()});
  REQUIRE(peers.ForWrites(id).ok());
  peers.MarkFailed(id, Status::Unavailable("wire: peer died"));
  peers.MarkFailed(id, Status::Cancelled("later"));
  auto failed = peers.ForWrites(id);
  CHECK(failed.status().code() == StatusCode::kUnavailable);
  CHECK(Message(failed.status()) == "wire: peer died");
  CHECK(peers.ForImport(id).status().code() == StatusCode::kUnavailable);
  CHECK(peers.Find(id) != nullptr);  // still there: Disconnect removes it
  CHECK(peers.Erase(id));
  CHECK_FALSE(peers.Erase(id));
  auto gone = peers.ForWrites(id);
  CHECK(gone.status().code() == StatusCode::kNotFound);
  CHECK(Message(gone.status()) ==
        "wire: unknown peer " + std::to_string(id) + " (never connected, or disconnected)");
  peers.MarkFailed(id, Status::Unavailable("x"));  // gone: nothing to mark
  CHECK(peers.Find(id) == nullptr);
}

TEST_CASE("toolkit tables: every write is checked against both regions") {
  toolkit::LocalRegions<Local> locals("wire");
  toolkit::PeerTable<Peer> peers("wire");
  const auto local = locals.Add({4096});
  const spi::PeerId id = peers.NextId();
  Peer& peer = peers.Add(id, Peer{{Remote{1024}}, Status()});
  struct Case {
    spi::WriteOp op;
    StatusCode code;
    std::string message;
  };
  const Case cases[] = {
      {{local, 0, 0, 0, 1024}, StatusCode::kOk, ""},
      {{local, 3072, 0, 1000, 24}, StatusCode::kOk, ""},
      {{local, 4096, 0, 1024, 0}, StatusCode::kOk, ""},  // empty, at the very end
      {{9, 0, 0, 0, 1},
       StatusCode::kInvalidArgument,
       "wire: write 5 names unregistered local region 9"},
      {{local, 0, 1, 0, 1},
       StatusCode::kInvalidArgument,
       "wire: write 5 names unknown remote region 1 of peer " + std::to_string(id)},
      {{local, 4000, 0, 0, 97},
       StatusCode::kOutOfRange,
       "wire: write 5 of 97 bytes at offset 4000 leaves local region 1 of 4096 bytes"},
      {{local, 0, 0, 1000, 25},
       StatusCode::kOutOfRange,
       "wire: write 5 of 25 bytes at offset 1000 leaves remote region 0 of 1024 bytes"},
      {{local, 0, 0, ~uint64_t{0}, 2},
       StatusCode::kOutOfRange,
       "wire: write 5 of 2 bytes at offset 18446744073709551615 leaves remote region 0 of 1024 "
       "bytes"},
      {{local, 0, 0, 0, ~uint64_t{0}},
       StatusCode::kOutOfRange,
       "wire: write 5 of 18446744073709551615 bytes at offset 0 leaves local region 1 of 4096 "
       "bytes"},
  };
  for (const Case& c : cases) {
    INFO(c.message);
    auto r = peers.ResolveWrite(id, peer, locals, 5, c.op);
    CHECK(r.status().code() == c.code);
    if (c.code == StatusCode::kOk) {
      REQUIRE(r.ok());
      CHECK(r->first == locals.Find(local));
      CHECK(r->second == &peer.regions[0]);
    } else {
      CHECK(Message(r.status()) == c.message);
    }
    // Reads (PostReads) are checked the same way and named as reads.
    auto read = peers.ResolveWrite(id, peer, locals, 5, c.op, toolkit::OpKind::kRead);
    CHECK(read.status().code() == c.code);
    if (c.code != StatusCode::kOk) {
      std::string expected = c.message;
      expected.replace(expected.find("write 5"), 7, "read 5");
      CHECK(Message(read.status()) == expected);
    }
  }
  CHECK(toolkit::CheckRemoteRegion("wire", {0x1000, 0, {}}).code() == StatusCode::kInvalidArgument);
  CHECK(Message(toolkit::CheckRemoteRegion("wire", {~uint64_t{0} - 10, 100, {}})) ==
        "wire: remote region wraps around");
  CHECK(toolkit::CheckRemoteRegion("wire", {0x1000, 100, {}}).ok());
}

TEST_CASE("toolkit tables: a target endpoint is open, fenced or closed") {
  toolkit::TargetTable<Target> targets("wire");
  const auto id = targets.Add({});
  CHECK(id == 1);
  REQUIRE(targets.FindUnfenced(id).ok());
  (*targets.Find(id))->fenced = true;
  CHECK(targets.Find(id).ok());  // still open: fencing does not close it
  auto fenced = targets.FindUnfenced(id);
  CHECK(fenced.status().code() == StatusCode::kFailedPrecondition);
  CHECK(Message(fenced.status()) == "wire: target endpoint 1 was fenced");
  CHECK(targets.Take(id).has_value());
  CHECK_FALSE(targets.Take(id).has_value());
  CHECK(targets.Find(id).status().code() == StatusCode::kNotFound);
  CHECK(targets.Add({}) == 2);
}

// --- progress thread -----------------------------------------------------------------------------

TEST_CASE("toolkit idle policy: poll for busy_poll after the last work, then sleep") {
  using Clock = toolkit::IdlePolicy::Clock;
  toolkit::IdlePolicy idle(std::chrono::microseconds(20));
  const Clock::time_point t0 = Clock::now();
  CHECK_FALSE(idle.ShouldSleep(t0, true));
  CHECK(idle.last_work() == t0);
  CHECK_FALSE(idle.ShouldSleep(t0 + std::chrono::microseconds(19), false));
  CHECK(idle.ShouldSleep(t0 + std::chrono::microseconds(20), false));
  CHECK_FALSE(idle.ShouldSleep(t0 + std::chrono::microseconds(30), true));  // work again
  CHECK_FALSE(idle.ShouldSleep(t0 + std::chrono::microseconds(49), false));
  CHECK(idle.ShouldSleep(t0 + std::chrono::microseconds(50), false));
  toolkit::IdlePolicy no_spin(std::chrono::microseconds(0));
  CHECK(no_spin.ShouldSleep(t0, false));
}

namespace {

// A fake wire: "completions" arrive through an eventfd, as a completion channel's would, and the
// loop has to notice them whether it is busy or asleep. The loop sleeps up to 10 s, so a lost
// wake-up shows as a test that takes seconds.
class FakeWireLoop {
 public:
  struct Batch : toolkit::BatchBase<Batch> {};

  FakeWireLoop() : progress_("fake") {
    wire_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    const int fds[] = {wire_fd_};
    open_ = progress_.Open(fds);
    progress_.Start([this] { Loop(); });
  }
  ~FakeWireLoop() {
    progress_.Stop();
    close(wire_fd_);
  }

  bool open() const { return open_.ok(); }
  toolkit::ProgressThread<Batch>& progress() { return progress_; }
  // The wire completes `n` requests.
  void Complete(uint64_t n) {
    ssize_t w = write(wire_fd_, &n, sizeof(n));
    (void)w;
  }
  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_acquire); }
  // True from just before the loop's Sleep until it returns.
  bool asleep() const { return asleep_.load(std::memory_order_acquire); }
  uint64_t batches() const { return batches_.load(std::memory_order_acquire); }

 private:
  void Loop() {
    toolkit::IdlePolicy idle(std::chrono::microseconds(50));
    while (true) {
      bool stop = false;
      bool worked = progress_.RunCommands(
          [this](std::unique_ptr<Batch>) { batches_.fetch_add(1, std::memory_order_release); },
          &stop);
      if (stop) return;
      uint64_t n = 0;  // "poll the CQ"
      if (read(wire_fd_, &n, sizeof(n)) == sizeof(n)) {
        completed_.fetch_add(n, std::memory_order_release);
        worked = true;
      }
      if (idle.ShouldSleep(std::chrono::steady_clock::now(), worked)) {
        epoll_event events[2];
        asleep_.store(true, std::memory_order_release);
        if (progress_.Sleep(10000, events) >= 0) sleeps_.fetch_add(1, std::memory_order_release);
        asleep_.store(false, std::memory_order_release);
      }
    }
  }

  int wire_fd_ = -1;
  Status open_;
  std::atomic<uint64_t> completed_{0};  // release by the loop, acquire by the test
  std::atomic<uint64_t> sleeps_{0};
  std::atomic<uint64_t> batches_{0};
  std::atomic<bool> asleep_{false};
  toolkit::ProgressThread<Batch> progress_;
};

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

}  // namespace

TEST_CASE("toolkit progress thread: sleeps when idle, a command or the wire wakes it at once") {
  FakeWireLoop loop;
  REQUIRE(loop.open());
  using std::chrono::milliseconds;
  for (int round = 0; round < 20; ++round) {
    INFO("round " << round);
    // Idle, it falls asleep (in epoll, for up to 10 s); the command queue wakes it.
    REQUIRE(WaitFor([&] { return loop.asleep(); }, milliseconds(5000)));
    const auto start = std::chrono::steady_clock::now();
    bool on_thread = false;  // written there, read here after Run returned (a future orders it)
    StatusOr<int> r = loop.progress().Run<StatusOr<int>>([&]() -> StatusOr<int> {
      on_thread = loop.progress().OnThread();
      return 40 + round;
    });
    REQUIRE(r.ok());
    CHECK(*r == 40 + round);
    CHECK(on_thread);
    CHECK(std::chrono::steady_clock::now() - start < milliseconds(2000));
    // Asleep again, the wire's fd wakes it.
    REQUIRE(WaitFor([&] { return loop.asleep(); }, milliseconds(5000)));
    const uint64_t before = loop.completed();
    loop.Complete(3);
    CHECK(WaitFor([&] { return loop.completed() == before + 3; }, milliseconds(2000)));
  }
  CHECK(loop.sleeps() >= 10);  // it did sleep between the rounds
  CHECK_FALSE(loop.progress().OnThread());
}

TEST_CASE("toolkit progress thread: no wake-up is lost with many posting threads") {
  FakeWireLoop loop;
  REQUIRE(loop.open());
  constexpr int kThreads = 4;
  constexpr int kEach = 200;
  std::atomic<int> ran{0};
  std::atomic<int> refused{0};  // Catch's assertions are made on the main thread only
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        if (i % 2 == 0) {
          Status s = loop.progress().Run<Status>([&] {
            ran.fetch_add(1, std::memory_order_relaxed);
            return Status::OK();
          });
          if (!s.ok()) refused.fetch_add(1, std::memory_order_relaxed);
        } else {
          auto batch = std::make_unique<FakeWireLoop::Batch>();
          if (!loop.progress().Enqueue({std::move(batch), {}})) {
            refused.fetch_add(1, std::memory_order_relaxed);
          }
        }
        if ((i + t) % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(refused.load() == 0);
  CHECK(ran.load() == kThreads * kEach / 2);
  CHECK(WaitFor([&] { return loop.batches() == uint64_t{kThreads} * kEach / 2; },
                std::chrono::milliseconds(2000)));
  // 800 hand-overs with the thread often asleep: a lost wake-up would cost 10 s.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(8));
}

TEST_CASE("toolkit progress thread: after Stop nothing is queued and Run says why") {
  auto loop = std::make_unique<FakeWireLoop>();
  REQUIRE(loop->open());
  bool ran = false;
  REQUIRE(loop->progress().Post([&] { ran = true; }));
  loop->progress().Stop();  // runs what was queued before it
  CHECK(ran);
  CHECK_FALSE(loop->progress().Post([] {}));
  Status s = loop->progress().Run<Status>([] { return Status::OK(); });
  CHECK(s.code() == StatusCode::kCancelled);
  CHECK(Message(s) == "fake: the transport is shutting down");
  loop->progress().Stop();  // idempotent
}
