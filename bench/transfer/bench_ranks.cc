#include "bench/transfer/bench_ranks.h"

#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/transfer/bench_layout.h"

namespace pdlib_bench {
namespace {

using Clock = std::chrono::steady_clock;

// CurrentDecodeProgress's figures, written by the decode drivers.
std::atomic<uint64_t> g_decode_ended{0};
std::mutex g_oldest_mu;
// Guarded by g_oldest_mu: the oldest request in flight ("request 3 (room 7) in Transferring"),
// empty when none is, and when it started.
std::string g_oldest;
Clock::time_point g_oldest_start;

// What a driver loop does when a pass over its handles changed nothing: yield a few times (the
// next event is usually microseconds away), then sleep, each sleep twice as long as the one
// before up to a cap, so that on a small machine an idle driver leaves the CPU to pdlib's own
// threads (a driver waking every 20 us during a 10 ms transfer costs a core's worth of context
// switches) while a busy one still reacts within microseconds.
class Idler {
 public:
  // With a simulated forward the decode driver measures exposed transfer times: it never
  // sleeps more than 50 us, so that its polling adds little to them.
  explicit Idler(const BenchConfig& c)
      : spins_(c.idle_spins),
        first_sleep_(c.idle_sleep_us),
        max_sleep_(c.layer_compute_us > 0
                       ? std::min<uint64_t>(200, std::max(c.idle_sleep_us, c.idle_sleep_max_us))
                       : std::max(c.idle_sleep_us, c.idle_sleep_max_us)) {
    ::prctl(PR_SET_TIMERSLACK, 1000UL);  // 1 us: short sleeps stay short
  }
  void Progress() {
    idle_ = 0;
    sleep_ = first_sleep_;
  }
  void Idle() {
    if (++idle_ <= spins_) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_));
      sleep_ = std::min(max_sleep_, sleep_ * 2);
    }
  }

 private:
  uint64_t spins_, first_sleep_, max_sleep_, idle_ = 0;
  uint64_t sleep_ = first_sleep_;
};

// The buffers and the manager of one rank.
struct Rank {
  BenchPool pool;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::MetadataSlotAllocator> slots;
  std::unique_ptr<pdlib::KVManager> manager;

  // `c` is the rank's own configuration (item_bytes already this rank's share, see RankConfig).
  std::string Create(const BenchConfig& c, pdlib::Mode mode, bool start_bootstrap) {
    const BenchPool::Fill fill = c.backend == "fake"             ? BenchPool::Fill::kLazy
                                 : mode == pdlib::Mode::kPrefill ? BenchPool::Fill::kPattern
                                                                 : BenchPool::Fill::kZero;
    if (std::string e = pool.Allocate(c, fill, mode); !e.empty()) return e;
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
    o.bootstrap_host = c.prefill_host;
    o.listen_host = c.prefill_host;
    o.start_bootstrap_server = start_bootstrap;
    o.transfer_workers = c.transfer_workers;
    o.room_log_every = c.room_log_every;
    o.direction = c.direction;
    o.checksum = c.checksum;
    o.checksum_sample_every = c.checksum_sample_every;
    for (uint64_t b = 0; b < pool.buffers(); ++b) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(pool.buffer(b)));
      o.args.kv.lens.push_back(pool.buffer_bytes());
      o.args.kv.item_lens.push_back(c.item_bytes);
    }
    o.args.memory_kind = c.memory;
    o.args.nic_names = mode == pdlib::Mode::kPrefill ? c.prefill_nic_names : c.decode_nic_names;
    o.args.device_id = c.cuda_device;
    o.args.aux = aux->Describe();
    const int32_t tp = mode == pdlib::Mode::kPrefill ? c.prefill_tp : c.decode_tp;
    o.args.page_size = c.page_size;
    o.args.parallel.tp_size = tp;
    o.args.parallel.tp_rank = c.tp_rank;
    o.args.kv_head_num = std::max(1, c.kv_heads / tp);
    o.args.kv_layout = c.kv_layout;
    // head_dim in 2-byte elements: a model-wide page is page_size x kv_heads x head_dim x 2.
    const uint64_t head_bytes =
        c.item_bytes / (uint64_t(c.page_size) * uint64_t(o.args.kv_head_num));
    o.args.fingerprint = {int32_t(c.layers),     c.kv_heads, int32_t(head_bytes / 2), 2, 1,
                          "pdlib-transfer-bench"};
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
  // Prefill: the request's pages that decode holds already (its decode prefix in pages); the
  // pages sent are the ones after them.
  uint64_t held = 0;
};

void CountFailure(RankResult* r, const pdlib::KVPollable& h) {
  if (r->failed++ == 0) r->first_failure = h.FailureReason().ToString();
}

// The simulated prefill forward (BenchConfig::layer_compute_us): one request at a time, FIFO,
// layer l finishing layer_compute_us x (l + 1) after the forward began.
struct Forward {
  uint64_t index = 0;  // the request's index (its entry in `active` may move)
  Clock::time_point start;
  uint64_t layers_done = 0;
};

// Nanoseconds on the monotonic clock both processes share; prefill stamps the end of a
// request's last layer with it in bootstrap_room(slot)[1], decode subtracts it at Success.
uint64_t MonotonicNs() {
  return uint64_t(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}

// Prefill with --decode-prefix, as an engine: once the sender is WaitingForInput, decode's prefix
// is known; the pages to send are those after it (PagesAfterPrefix), the first of them the page
// of token decode_prefix_len. Sets *held to the pages skipped; an error when the sender does not
// know the prefix yet or counts pages other than the request's after the prefix.
pdlib::Status AfterPrefix(const BenchConfig& c, const pdlib::KVSender& sender, uint64_t pages,
                          uint64_t* held) {
  if (c.direction == pdlib::TransferDirection::kPull) {
    // Pull: prefill publishes every page of the prompt, before decode's prefix is known; decode
    // reads only the pages after it.
    const pdlib::StatusOr<uint64_t> all = sender.PagesAfterPrefix(c.PromptTokens());
    if (!all.ok()) return all.status();
    if (*all != pages) {
      return pdlib::Status::Internal("pull: PagesAfterPrefix counts " + std::to_string(*all) +
                                     " pages of the request's " + std::to_string(pages));
    }
    *held = 0;
    return pdlib::Status::OK();
  }
  const std::optional<uint64_t> prefix = sender.decode_prefix_len();
  if (!prefix) return pdlib::Status::FailedPrecondition("decode prefix unknown at WaitingForInput");
  const pdlib::StatusOr<uint64_t> after = sender.PagesAfterPrefix(c.PromptTokens());
  if (!after.ok()) return after.status();
  if (*prefix % c.page_size != 0 || *prefix / c.page_size + *after != pages) {
    return pdlib::Status::Internal("decode prefix of " + std::to_string(*prefix) +
                                   " tokens leaves " + std::to_string(*after) +
                                   " pages of the request's " + std::to_string(pages));
  }
  *held = *prefix / c.page_size;
  return pdlib::Status::OK();
}

// Drives requests [begin, end) through the prefill rank's senders.
void DrivePrefill(const BenchConfig& c, Rank& rank, const PageRing& pages, uint64_t begin,
                  uint64_t end, RankResult* result) {
  std::vector<InFlight<pdlib::KVSender>> active;
  active.reserve(c.concurrency);
  Idler idler(c);
  const auto per_layer = std::chrono::microseconds(c.layer_compute_us);
  std::deque<uint64_t> to_compute;  // request indices with their TransferInfo, FIFO
  Forward forward;
  bool computing = false;
  const bool pull = c.direction == pdlib::TransferDirection::kPull;
  auto find = [&](uint64_t index) -> InFlight<pdlib::KVSender>* {
    for (auto& f : active) {
      if (f.index == index) return &f;
    }
    return nullptr;
  };
  // Advances the forward in progress: announces the layers finished by now; after the last one
  // stamps the end and completes the request's only chunk.
  auto compute = [&]() -> bool {
    if (!computing && !to_compute.empty()) {
      forward = Forward{to_compute.front(), Clock::now(), 0};
      computing = true;
      to_compute.pop_front();
    }
    if (!computing) return false;
    InFlight<pdlib::KVSender>* f = find(forward.index);
    if (f == nullptr) {  // failed meanwhile
      computing = false;
      return true;
    }
    const uint64_t due =
        std::min<uint64_t>(c.layers, uint64_t((Clock::now() - forward.start) / per_layer));
    if (due == forward.layers_done) return false;
    forward.layers_done = due;
    const auto src = pages.For(f->index).subspan(f->held);
    pdlib::Status s;
    if (due == c.layers) {
      if (f->aux) rank.aux->bootstrap_room(*f->aux)[1] = MonotonicNs();
      s = f->handle->Send(src, true);
      computing = false;
    } else if (c.layerwise) {
      s = f->handle->SendLayers(src, int32_t(due), true);
    }
    if (!s.ok()) f->handle->Abort(s.ToString());
    return true;
  };
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
      // Push: once decode's TransferInfo is in; pull: at once (prefill publishes its pages).
      if (!f.acted && (st == pdlib::KVPoll::kWaitingForInput || pull)) {
        f.acted = true;
        const auto all = pages.For(f.index);
        pdlib::Status s =
            c.decode_prefix ? AfterPrefix(c, *f.handle, all.size(), &f.held) : pdlib::Status::OK();
        const auto src = all.subspan(f.held);
        if (s.ok()) s = f.handle->Init(src.size(), f.aux);
        if (s.ok() && c.layer_compute_us > 0) {
          to_compute.push_back(f.index);
        } else if (s.ok()) {
          s = f.handle->Send(src, true);
        }
        if (!s.ok()) f.handle->Abort(s.ToString());
        progressed = true;
      }
      ++i;
    }
    if (c.layer_compute_us > 0) progressed |= compute();
    if (computing) {
      // The next layer ends at a known time: sleep until then (or poll again at once).
      std::this_thread::sleep_until(std::min<Clock::time_point>(
          forward.start + per_layer * int64_t(forward.layers_done + 1),
          Clock::now() + std::chrono::microseconds(c.idle_sleep_max_us)));
      idler.Progress();
    } else if (progressed) {
      idler.Progress();
    } else {
      idler.Idle();
    }
  }
}

// With --verify: "" when every page of request `index` after decode's prefix holds the source
// page prefill sent for that position, and, with --decode-prefix, every prefix page still holds
// the zeroes ZeroPrefix wrote before Init (prefill wrote nothing there).
std::string VerifyRequest(const BenchConfig& c, const Rank& rank, const PageRing& dst_pages,
                          const PageRing& src_pages, uint64_t index) {
  const auto dst = dst_pages.For(index), src = src_pages.For(index);
  const uint64_t held = c.PrefixPages();
  std::vector<uint8_t> got(c.item_bytes);  // a copy: the pool may be GPU memory
  for (uint64_t b = 0; b < rank.pool.buffers(); ++b) {
    for (size_t i = 0; i < dst.size(); ++i) {
      if (std::string e = rank.pool.Read(b, uint64_t(dst[i]) * c.item_bytes, got); !e.empty()) {
        return "verify: request " + std::to_string(index) + ": " + e;
      }
      if (i < held) {
        if (std::any_of(got.begin(), got.end(), [](uint8_t x) { return x != 0; })) {
          return "verify: request " + std::to_string(index) + ", buffer " + std::to_string(b) +
                 ": decode prefix page " + std::to_string(dst[i]) + " (position " +
                 std::to_string(i) + " of " + std::to_string(held) +
                 " held) was written; prefill must send only the pages after the prefix";
        }
        continue;
      }
      const uint64_t want = b * rank.pool.buffer_bytes() + uint64_t(src[i]) * c.item_bytes;
      if (!HoldsPattern(got.data(), c.item_bytes, want)) {
        return "verify: request " + std::to_string(index) + ", buffer " + std::to_string(b) +
               ": decode page " + std::to_string(dst[i]) + " (position " + std::to_string(i) +
               ") does not hold prefill page " + std::to_string(src[i]);
      }
    }
  }
  return "";
}

// With --verify and --decode-prefix: zeroes request `index`'s prefix pages before its Init, so
// that VerifyRequest can tell that nothing was written there.
std::string ZeroPrefix(const BenchConfig& c, Rank& rank, const PageRing& dst_pages,
                       uint64_t index) {
  const auto held = dst_pages.For(index).first(c.PrefixPages());
  for (uint64_t b = 0; b < rank.pool.buffers(); ++b) {
    for (int32_t page : held) {
      if (std::string e = rank.pool.Zero(b, uint64_t(page) * c.item_bytes, c.item_bytes);
          !e.empty()) {
        return "verify: request " + std::to_string(index) + ": " + e;
      }
    }
  }
  return "";
}

// Decode's Init for request `index`: without --decode-prefix the pre-prefix call (every page);
// with it a ReceiveRequest naming the pages after the prefix, the prefix and the prompt.
pdlib::Status InitReceiver(const BenchConfig& c, Rank& rank, const PageRing& dst_pages,
                           const InFlight<pdlib::KVReceiver>& f) {
  const auto dst = dst_pages.For(f.index);
  if (!c.decode_prefix) return f.handle->Init(dst, f.aux);
  if (c.verify) {
    if (std::string e = ZeroPrefix(c, rank, dst_pages, f.index); !e.empty()) {
      return pdlib::Status::Internal(e);
    }
  }
  pdlib::ReceiveRequest request;
  request.kv_page_indices = dst.subspan(c.PrefixPages());
  request.aux_index = f.aux;
  request.decode_prefix_len = c.PrefixPages() * c.page_size;
  request.prompt_len = c.PromptTokens();
  return f.handle->Init(request);
}

// Drives requests [begin, end) through the decode rank's receivers; with `latencies`, records
// each request's time from CreateReceiver() to Success.
void DriveDecode(const BenchConfig& c, Rank& rank, const PageRing& pages, uint64_t begin,
                 uint64_t end, RankResult* result, std::vector<uint32_t>* latencies) {
  std::optional<PageRing> src_pages;
  if (c.verify) src_pages.emplace(c, PrefillPageSeed(c));
  std::vector<InFlight<pdlib::KVReceiver>> active;
  active.reserve(c.concurrency);
  Idler idler(c);
  const pdlib::BootstrapAddress bootstrap{c.prefill_host, c.bootstrap_port};
  const auto started = Clock::now();
  auto next_progress = started + std::chrono::duration<double>(c.progress_every_s);
  auto next_snapshot = started;
  uint64_t next = begin;
  while (next < end || !active.empty()) {
    bool progressed = false;
    if (const auto now = Clock::now(); now >= next_snapshot) {
      // For CurrentDecodeProgress: the oldest request in flight, four times a second.
      next_snapshot = now + std::chrono::milliseconds(250);
      std::string oldest;
      Clock::time_point oldest_start;
      if (auto it =
              std::min_element(active.begin(), active.end(),
                               [](const auto& a, const auto& b) { return a.start < b.start; });
          it != active.end()) {
        char line[128];
        std::snprintf(line, sizeof line, "request %" PRIu64 " (room %" PRIu64 ") in %s", it->index,
                      c.FirstRoom() + it->index,
                      std::string(pdlib::KVPollName(it->handle->Poll())).c_str());
        oldest = line;
        oldest_start = it->start;
      }
      std::lock_guard<std::mutex> lock(g_oldest_mu);
      g_oldest = std::move(oldest);
      g_oldest_start = oldest_start;
    }
    // A request whose page window a live one holds waits for it (PageRing::Window).
    auto window_busy = [&](uint64_t index) {
      if (pages.windows() == 0) return false;
      return std::any_of(active.begin(), active.end(), [&](const auto& f) {
        return pages.Window(f.index) == pages.Window(index);
      });
    };
    while (active.size() < c.concurrency && next < end && !window_busy(next)) {
      const auto start = Clock::now();
      auto receiver = rank.manager->CreateReceiver(bootstrap, c.FirstRoom() + next);
      if (!receiver.ok()) {
        g_decode_ended.fetch_add(1, std::memory_order_relaxed);
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
        g_decode_ended.fetch_add(1, std::memory_order_relaxed);
        const auto now = Clock::now();
        if (c.progress_every_s > 0 && now >= next_progress) {
          next_progress = now + std::chrono::duration<double>(c.progress_every_s);
          const double s = std::chrono::duration<double>(now - started).count();
          const uint64_t done = result->succeeded + result->failed;
          std::fprintf(stderr,
                       "pdlib-transfer-bench: %s %" PRIu64 "/%" PRIu64
                       " requests after %.1f s (%.2f GB/s)\n",
                       latencies ? "measured" : "warm-up", done, end - begin, s,
                       double(done) * double(c.BytesPerRequest()) / s / 1e9);
        }
        std::string wrong_bytes;
        if (st == pdlib::KVPoll::kSuccess && src_pages) {
          wrong_bytes = VerifyRequest(c, rank, pages, *src_pages, f.index);
        }
        if (!wrong_bytes.empty()) {
          ++result->wrong;
          if (result->failed++ == 0) result->first_failure = wrong_bytes;
        } else if (st == pdlib::KVPoll::kSuccess) {
          ++result->succeeded;
          if (latencies) {
            const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now - f.start);
            latencies->push_back(uint32_t(std::min<int64_t>(us.count(), UINT32_MAX)));
            if (c.layer_compute_us > 0 && f.aux) {
              // Prefill stamped the end of the request's last layer (DrivePrefill).
              const uint64_t stamped = rank.aux->bootstrap_room(*f.aux)[1];
              const uint64_t now_ns = MonotonicNs();
              result->exposed_us.push_back(uint32_t(std::min<uint64_t>(
                  now_ns > stamped ? (now_ns - stamped) / 1000 : 0, UINT32_MAX)));
            }
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
        if (pdlib::Status s = InitReceiver(c, rank, pages, f); !s.ok()) {
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

// User + system CPU seconds of this process so far, every thread included.
double ProcessCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// Returns once a receiver can connect to the prefill rank (its registration with the bootstrap
// server may lag behind its READY). The probe rooms lie below every request's room.
std::string WaitForPrefill(const BenchConfig& c, Rank& rank) {
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  std::string last = "no attempt";
  for (uint64_t attempt = 1; Clock::now() < deadline; ++attempt) {
    auto probe =
        rank.manager->CreateReceiver({c.prefill_host, c.bootstrap_port}, c.FirstRoom() - attempt);
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

DecodeProgress CurrentDecodeProgress() {
  DecodeProgress p;
  p.ended = g_decode_ended.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g_oldest_mu);
  if (!g_oldest.empty()) {
    char age[48];
    std::snprintf(age, sizeof age, " for %.1f s",
                  std::chrono::duration<double>(Clock::now() - g_oldest_start).count());
    p.oldest = g_oldest + age;
  }
  return p;
}

uint64_t BenchConfig::PoolPages() const {
  if (pool_pages != 0) return std::max(pool_pages, pages);
  return std::max<uint64_t>(pages, pool_bytes / (2 * layers * item_bytes));
}

uint64_t BenchConfig::PrefixPages() const {
  if (!decode_prefix || *decode_prefix <= 0) return 0;
  // The epsilon keeps e.g. 0.29 x 100 (28.999999999999996) at 29 pages.
  const auto held = uint64_t(std::floor(*decode_prefix * double(pages) + 1e-9));
  return std::min(held, pages - 1);  // decode_prefix < 1: at least one page moves
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

namespace {

// One rank's configuration: its TP rank and its share of every page.
BenchConfig RankConfig(const BenchConfig& c, int32_t tp, int32_t rank) {
  BenchConfig r = c;
  r.tp_rank = rank;
  r.item_bytes = c.item_bytes / uint64_t(tp);
  r.pool_bytes = c.pool_bytes / uint64_t(tp);
  r.pool_pages = c.PoolPages();  // the same pages on every rank
  return r;
}

void Merge(const RankResult& from, bool first, RankResult* into) {
  if (into->error.empty() && !from.error.empty()) into->error = from.error;
  if (into->first_failure.empty()) into->first_failure = from.first_failure;
  // Every rank sees every request: a request counts once, failed if any rank failed it.
  into->succeeded = first ? from.succeeded : std::min(into->succeeded, from.succeeded);
  into->failed = std::max(into->failed, from.failed);
  into->wrong += from.wrong;
  into->seconds = std::max(into->seconds, from.seconds);
  into->cpu_seconds = std::max(into->cpu_seconds, from.cpu_seconds);
  into->latencies_us.insert(into->latencies_us.end(), from.latencies_us.begin(),
                            from.latencies_us.end());
  into->exposed_us.insert(into->exposed_us.end(), from.exposed_us.begin(), from.exposed_us.end());
  if (into->pool_allocator.empty()) into->pool_allocator = from.pool_allocator;
}

}  // namespace

RankResult RunPrefillRanks(const BenchConfig& config, bool start_bootstrap,
                           const std::function<void(const std::string&)>& on_ready,
                           const std::function<void(const RankResult&)>& before_teardown) {
  const int32_t tp = config.prefill_tp;
  if (tp == 1)
    return RunPrefillRank(RankConfig(config, 1, 0), start_bootstrap, on_ready, before_teardown);
  std::mutex mu;
  std::condition_variable cv;
  int ready = 0, done = 0;
  bool released = false;
  std::string endpoint0;
  std::vector<RankResult> results(static_cast<size_t>(tp));
  auto arrive = [&](int* counter) {
    std::unique_lock lock(mu);
    ++*counter;
    cv.notify_all();
  };
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      bool counted_ready = false, counted_done = false;
      RankResult failed = RunPrefillRank(
          RankConfig(config, tp, r), start_bootstrap && r == 0,
          [&](const std::string& ep) {
            {
              std::lock_guard lock(mu);
              if (r == 0) endpoint0 = ep;
            }
            counted_ready = true;
            arrive(&ready);
          },
          [&](const RankResult& served) {
            {
              std::lock_guard lock(mu);
              results[size_t(r)] = served;  // the rank returns only after teardown
            }
            counted_done = true;
            arrive(&done);
            std::unique_lock lock(mu);
            cv.wait(lock, [&] { return released; });
          });
      // A rank that failed before serving never called back: count it, with its error.
      if (!counted_done) {
        {
          std::lock_guard lock(mu);
          results[size_t(r)] = std::move(failed);
        }
        if (!counted_ready) arrive(&ready);
        arrive(&done);
      }
    });
    // Rank 0 hosts the bootstrap server: let it come up before the others register.
    if (r == 0) {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return ready >= 1; });
    }
  }
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return ready >= tp; });
  }
  on_ready(endpoint0);
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done >= tp; });
  }
  RankResult all;
  {
    std::lock_guard lock(mu);
    for (size_t i = 0; i < results.size(); ++i) Merge(results[i], i == 0, &all);
    all.metrics = results[0].metrics;
    for (size_t i = 1; i < results.size(); ++i) {
      all.metrics.bytes_transferred += results[i].metrics.bytes_transferred;
    }
  }
  before_teardown(all);
  {
    std::lock_guard lock(mu);
    released = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();
  return all;
}

RankResult RunDecodeRanks(const BenchConfig& config, const std::function<void()>& on_ready) {
  const int32_t tp = config.decode_tp;
  if (tp == 1) return RunDecodeRank(RankConfig(config, 1, 0), on_ready);
  std::vector<RankResult> results(static_cast<size_t>(tp));
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      // The last rank to reach prefill reports the side ready (before any rank measures).
      results[size_t(r)] = RunDecodeRank(RankConfig(config, tp, r), [&] {
        if (++ready == tp) on_ready();
      });
    });
  }
  for (auto& t : threads) t.join();
  RankResult all;
  for (size_t i = 0; i < results.size(); ++i) Merge(results[i], i == 0, &all);
  all.metrics = results[0].metrics;
  for (size_t i = 1; i < results.size(); ++i) {  // what every rank read, in pull
    all.metrics.bytes_transferred += results[i].metrics.bytes_transferred;
  }
  return all;
}

RankResult RunPrefillRank(const BenchConfig& config, bool start_bootstrap,
                          const std::function<void(const std::string&)>& on_ready,
                          const std::function<void(const RankResult&)>& before_teardown) {
  RankResult result;
  Rank rank;
  result.error = rank.Create(config, pdlib::Mode::kPrefill, start_bootstrap);
  if (!result.error.empty()) return result;
  result.pool_allocator = rank.pool.allocator();
  const PageRing pages(config, PrefillPageSeed(config));
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
  result.pool_allocator = rank.pool.allocator();
  const PageRing pages(config, DecodePageSeed(config));
  if (result.error = WaitForPrefill(config, rank); !result.error.empty()) return result;
  on_ready();
  RankResult warm;
  DriveDecode(config, rank, pages, 0, config.warmup, &warm, nullptr);
  result.latencies_us.reserve(config.requests);
  const double cpu_start = ProcessCpuSeconds();
  const auto start = Clock::now();
  DriveDecode(config, rank, pages, config.warmup, config.warmup + config.requests, &result,
              &result.latencies_us);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.cpu_seconds = ProcessCpuSeconds() - cpu_start;
  result.wrong += warm.wrong;  // a wrong byte anywhere fails the row
  if (warm.failed > 0 && result.first_failure.empty()) {
    result.first_failure = "warm-up: " + warm.first_failure;
  }
  result.metrics = rank.manager->metrics();
  return result;
}

}  // namespace pdlib_bench
