#include "bench/transfer/bench_ranks.h"

#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <unordered_set>

namespace pdlib_bench {
namespace {

using Clock = std::chrono::steady_clock;

// Page lists are precomputed for this many requests and reused in a ring, so the timed loop
// does no random number generation and memory stays small for long runs.
constexpr uint64_t kPageRing = 4096;

// The KV buffers of one rank: 2 * layers anonymous mappings. MAP_NORESERVE: the fake backend
// never touches them, so only a real transport makes the kernel back them with memory.
class Pools {
 public:
  bool Allocate(uint64_t count, uint64_t bytes) {
    for (uint64_t i = 0; i < count; ++i) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) return false;
      maps_.push_back({p, bytes});
    }
    return true;
  }
  ~Pools() {
    for (auto [p, n] : maps_) ::munmap(p, n);
  }
  const std::vector<std::pair<void*, uint64_t>>& maps() const { return maps_; }

 private:
  std::vector<std::pair<void*, uint64_t>> maps_;
};

// Page indices of request i: `pages` of them, at ring[(i % slots) * pages].
class PageRing {
 public:
  PageRing(const BenchConfig& c, uint64_t seed) : pages_(c.pages) {
    const uint64_t pool = c.PoolPages();
    slots_ = std::min<uint64_t>(kPageRing, c.warmup + c.requests);
    ring_.reserve(slots_ * pages_);
    std::mt19937_64 rng(seed);
    std::vector<int32_t> all;
    for (uint64_t s = 0; s < slots_; ++s) {
      if (c.layout == Layout::kContiguous) {
        const uint64_t start = (s % std::max<uint64_t>(1, pool / pages_)) * pages_;
        for (uint64_t k = 0; k < pages_; ++k) ring_.push_back(int32_t(start + k));
      } else if (pages_ * 4 <= pool) {
        // Distinct random pages in random order: almost nothing coalesces.
        std::unordered_set<int32_t> seen;
        while (seen.size() < pages_) {
          const auto p = int32_t(rng() % pool);
          if (seen.insert(p).second) ring_.push_back(p);
        }
      } else {
        if (all.empty()) {
          for (uint64_t p = 0; p < pool; ++p) all.push_back(int32_t(p));
        }
        std::shuffle(all.begin(), all.end(), rng);
        ring_.insert(ring_.end(), all.begin(), all.begin() + std::ptrdiff_t(pages_));
      }
    }
  }
  std::span<const int32_t> For(uint64_t i) const {
    return std::span(ring_).subspan((i % slots_) * pages_, pages_);
  }

 private:
  uint64_t pages_;
  uint64_t slots_ = 1;
  std::vector<int32_t> ring_;
};

// What a driver loop does when a pass over its handles changed nothing: yield a few times (the
// next event is usually microseconds away), then sleep briefly so that on a small machine the
// drivers leave the CPU to pdlib's own threads.
class Idler {
 public:
  explicit Idler(const BenchConfig& c) : spins_(c.idle_spins), sleep_(c.idle_sleep_us) {
    ::prctl(PR_SET_TIMERSLACK, 1000UL);  // 1 us: short sleeps stay short
  }
  void Progress() { idle_ = 0; }
  void Idle() {
    if (++idle_ <= spins_) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_));
    }
  }

 private:
  uint64_t spins_, sleep_, idle_ = 0;
};

// The buffers and the manager of one rank.
struct Rank {
  Pools pools;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::MetadataSlotAllocator> slots;
  std::unique_ptr<pdlib::KVManager> manager;

  std::string Create(const BenchConfig& c, pdlib::Mode mode, bool start_bootstrap) {
    const uint64_t bytes = c.PoolPages() * c.item_bytes;
    if (!pools.Allocate(2 * c.layers, bytes)) return "mmap of the KV pools failed";
    const size_t nslots = pdlib::MetadataBuffers::SlotCountFor(c.concurrency);
    auto buffers = pdlib::MetadataBuffers::Create(nslots, 0, 0);
    if (!buffers.ok()) return buffers.status().ToString();
    aux = std::move(*buffers);
    slots = std::make_unique<pdlib::MetadataSlotAllocator>(nslots);

    pdlib::KVManagerOptions o;
    o.mode = mode;
    o.backend = c.backend;
    o.backend_options = c.backend_options;
    o.control_plane = c.control_plane;
    o.bootstrap_port = c.bootstrap_port;
    o.start_bootstrap_server = start_bootstrap;
    o.transfer_workers = c.transfer_workers;
    for (auto [p, n] : pools.maps()) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(p));
      o.args.kv.lens.push_back(n);
      o.args.kv.item_lens.push_back(c.item_bytes);
    }
    o.args.aux = aux->Describe();
    o.args.page_size = 16;
    o.args.fingerprint = {int32_t(c.layers), 8, 128, 2, 1, "pdlib-transfer-bench"};
    auto m = pdlib::KVManager::Create(o);
    if (!m.ok()) return "KVManager::Create: " + m.status().ToString();
    manager = std::move(*m);
    return "";
  }
};

template <typename Handle>
struct InFlight {
  std::unique_ptr<Handle> handle;
  uint64_t index = 0;
  std::optional<uint32_t> aux;
  Clock::time_point start;
  bool acted = false;  // prefill: Send() called; decode: Init() called
};

void CountFailure(RankResult* r, const pdlib::KVPollable& h) {
  if (r->failed++ == 0) r->first_failure = h.FailureReason().ToString();
}

// Drives requests [begin, end) through the prefill rank's senders.
void DrivePrefill(const BenchConfig& c, Rank& rank, const PageRing& pages, uint64_t begin,
                  uint64_t end, RankResult* result) {
  std::vector<InFlight<pdlib::KVSender>> active;
  active.reserve(c.concurrency);
  Idler idler(c);
  uint64_t next = begin;
  while (next < end || !active.empty()) {
    bool progressed = false;
    while (active.size() < c.concurrency && next < end) {
      const uint64_t room = c.FirstRoom() + next;
      auto sender = rank.manager->CreateSender(room);
      if (!sender.ok()) {
        if (result->failed++ == 0) result->first_failure = sender.status().ToString();
        ++next;
        continue;
      }
      InFlight<pdlib::KVSender> f{std::move(*sender), next++, rank.slots->Alloc(), {}, false};
      if (f.aux) rank.aux->bootstrap_room(*f.aux)[0] = room;  // decode checks it (R4.4)
      active.push_back(std::move(f));
      progressed = true;
    }
    for (size_t i = 0; i < active.size();) {
      auto& f = active[i];
      const pdlib::KVPoll st = f.handle->Poll();
      if (pdlib::IsTerminal(st)) {
        if (st == pdlib::KVPoll::kSuccess) {
          ++result->succeeded;
        } else {
          CountFailure(result, *f.handle);
        }
        f.handle.reset();
        if (f.aux) rank.slots->Free(*f.aux).IgnoreError();
        std::swap(f, active.back());
        active.pop_back();
        progressed = true;
        continue;
      }
      if (!f.acted && st == pdlib::KVPoll::kWaitingForInput) {
        f.acted = true;
        const auto src = pages.For(f.index);
        pdlib::Status s = f.handle->Init(src.size(), f.aux);
        if (s.ok()) s = f.handle->Send(src, true);
        if (!s.ok()) f.handle->Abort(s.ToString());
        progressed = true;
      }
      ++i;
    }
    if (progressed) {
      idler.Progress();
    } else {
      idler.Idle();
    }
  }
}

// Drives requests [begin, end) through the decode rank's receivers; with `latencies`, records
// each request's time from CreateReceiver() to Success.
void DriveDecode(const BenchConfig& c, Rank& rank, const PageRing& pages, uint64_t begin,
                 uint64_t end, RankResult* result, std::vector<uint32_t>* latencies) {
  std::vector<InFlight<pdlib::KVReceiver>> active;
  active.reserve(c.concurrency);
  Idler idler(c);
  const pdlib::BootstrapAddress bootstrap{"127.0.0.1", c.bootstrap_port};
  uint64_t next = begin;
  while (next < end || !active.empty()) {
    bool progressed = false;
    while (active.size() < c.concurrency && next < end) {
      const auto start = Clock::now();
      auto receiver = rank.manager->CreateReceiver(bootstrap, c.FirstRoom() + next);
      if (!receiver.ok()) {
        if (result->failed++ == 0) result->first_failure = receiver.status().ToString();
        ++next;
        continue;
      }
      active.push_back({std::move(*receiver), next++, rank.slots->Alloc(), start, false});
      progressed = true;
    }
    for (size_t i = 0; i < active.size();) {
      auto& f = active[i];
      const pdlib::KVPoll st = f.handle->Poll();
      if (pdlib::IsTerminal(st)) {
        if (st == pdlib::KVPoll::kSuccess) {
          ++result->succeeded;
          if (latencies) {
            const auto us =
                std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - f.start);
            latencies->push_back(uint32_t(std::min<int64_t>(us.count(), UINT32_MAX)));
          }
        } else {
          CountFailure(result, *f.handle);
        }
        f.handle.reset();
        if (f.aux) rank.slots->Free(*f.aux).IgnoreError();
        std::swap(f, active.back());
        active.pop_back();
        progressed = true;
        continue;
      }
      if (!f.acted && st == pdlib::KVPoll::kWaitingForInput) {
        f.acted = true;
        if (pdlib::Status s = f.handle->Init(pages.For(f.index), f.aux); !s.ok()) {
          f.handle->Abort(s.ToString());
        }
        progressed = true;
      }
      ++i;
    }
    if (progressed) {
      idler.Progress();
    } else {
      idler.Idle();
    }
  }
}

// Returns once a receiver can connect to the prefill rank (its registration with the bootstrap
// server may lag behind its READY). The probe rooms lie below every request's room.
std::string WaitForPrefill(const BenchConfig& c, Rank& rank) {
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  std::string last = "no attempt";
  for (uint64_t attempt = 1; Clock::now() < deadline; ++attempt) {
    auto probe =
        rank.manager->CreateReceiver({"127.0.0.1", c.bootstrap_port}, c.FirstRoom() - attempt);
    if (!probe.ok()) return "probe: " + probe.status().ToString();
    while ((*probe)->Poll() == pdlib::KVPoll::kBootstrapping && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if ((*probe)->Poll() >= pdlib::KVPoll::kWaitingForInput) return "";
    last = (*probe)->FailureReason().ToString();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "prefill not reachable within 30 s: " + last;
}

}  // namespace

uint64_t BenchConfig::PoolPages() const {
  if (pool_pages != 0) return std::max(pool_pages, pages);
  return std::clamp<uint64_t>(concurrency * pages, std::max<uint64_t>(256, pages), 1 << 20);
}

uint64_t BenchConfig::FirstRoom() const {
  // Room ids of different runs (and seeds) do not collide; the 1 << 20 ids below the first one
  // are left for probes.
  return ((seed & 0xffff) << 40) + (1 << 20);
}

std::string BenchConfig::Transport() const {
  for (const auto& [key, value] : backend_options) {
    if (key.size() >= 4 && key.ends_with(".tls")) return backend + ":" + value;
  }
  return backend;
}

RankResult RunPrefillRank(const BenchConfig& config, bool start_bootstrap,
                          const std::function<void(const std::string&)>& on_ready,
                          const std::function<void(const RankResult&)>& before_teardown) {
  RankResult result;
  Rank rank;
  result.error = rank.Create(config, pdlib::Mode::kPrefill, start_bootstrap);
  if (!result.error.empty()) return result;
  const PageRing pages(config, config.seed * 2 + 1);
  on_ready(rank.manager->endpoint());
  DrivePrefill(config, rank, pages, 0, config.warmup + config.requests, &result);
  result.metrics = rank.manager->metrics();
  before_teardown(result);
  return result;
}

RankResult RunDecodeRank(const BenchConfig& config, const std::function<void()>& on_ready) {
  RankResult result;
  Rank rank;
  result.error = rank.Create(config, pdlib::Mode::kDecode, false);
  if (!result.error.empty()) return result;
  const PageRing pages(config, config.seed * 2 + 2);
  if (result.error = WaitForPrefill(config, rank); !result.error.empty()) return result;
  on_ready();
  RankResult warm;
  DriveDecode(config, rank, pages, 0, config.warmup, &warm, nullptr);
  result.latencies_us.reserve(config.requests);
  const auto start = Clock::now();
  DriveDecode(config, rank, pages, config.warmup, config.warmup + config.requests, &result,
              &result.latencies_us);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (warm.failed > 0 && result.first_failure.empty()) {
    result.first_failure = "warm-up: " + warm.first_failure;
  }
  result.metrics = rank.manager->metrics();
  return result;
}

}  // namespace pdlib_bench
