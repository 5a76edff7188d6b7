#include "tools/chaos/chaos_peer.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "pdlib/pdlib.h"
#include "tools/chaos/chaos_pattern.h"

namespace pdlib_chaos {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

void Emit(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Whether the negative control spoils `room` (about one room in `one_in`).
bool Spoiled(uint64_t room, uint64_t one_in, uint64_t salt) {
  return one_in > 0 && Mix(room ^ salt) % one_in == 0;
}

// One request in flight and what the peer holds for it.
struct Request {
  uint64_t room = 0;
  RequestShape shape;
  std::unique_ptr<pdlib::KVSender> sender;
  std::unique_ptr<pdlib::KVReceiver> receiver;
  std::optional<uint32_t> aux;
  std::vector<int32_t> pages;
  size_t chunks_sent = 0;             // prefill
  Clock::time_point next_chunk_at{};  // prefill: when the next chunk's "forward pass" is done
  bool initialized = false;
  Clock::time_point held_since{};  // when the engine put it aside, its pages not reusable yet

  const pdlib::KVPollable& handle() const {
    return sender ? static_cast<const pdlib::KVPollable&>(*sender) : *receiver;
  }
};

class Peer {
 public:
  explicit Peer(const PeerConfig& c) : c_(c) {}

  bool Start() {
    const size_t pool_pages = 2 * c_.concurrency * c_.max_pages;
    pools_.resize(2 * c_.layers);
    for (auto& pool : pools_) pool.assign(pool_pages * c_.item_bytes, 0);
    pages_ = std::make_unique<PagePool>(pool_pages, prefill() ? 0x70ULL : 0x64ULL);
    const size_t slots = pdlib::MetadataBuffers::SlotCountFor(c_.concurrency);
    auto aux = pdlib::MetadataBuffers::Create(slots, 0, 0);
    if (!aux.ok()) return Error("MetadataBuffers::Create: " + aux.status().ToString());
    aux_ = std::move(*aux);
    slots_ = std::make_unique<pdlib::MetadataSlotAllocator>(slots);
    slot_in_use_.assign(slots, false);
    last_room_.assign(pool_pages, kNoRoom);
    last_position_.assign(pool_pages, 0);
    last_slot_room_.assign(slots, kNoRoom);
    if (!prefill()) {
      for (size_t page = 0; page < pool_pages; ++page) PoisonPage(int32_t(page));
      for (size_t slot = 0; slot < slots; ++slot) PoisonSlot(uint32_t(slot));
    }

    pdlib::KVManagerOptions o;
    o.mode = c_.mode;
    o.backend = c_.backend;
    o.backend_options = c_.backend_options;
    o.listen_host = c_.listen_host;
    o.listen_port = 0;
    o.bootstrap_host = c_.bootstrap_host;
    o.bootstrap_port = c_.bootstrap_port;
    if (!c_.etcd_endpoints.empty()) {
      o.discovery = pdlib::Discovery::kEtcd;
      o.etcd_endpoints = c_.etcd_endpoints;
    }
    o.liveness_timeout = milliseconds(c_.liveness_ms);
    o.connect_timeout = milliseconds(c_.connect_ms);
    o.bootstrap_timeout = milliseconds(c_.bootstrap_ms);
    o.waiting_timeout = milliseconds(c_.waiting_ms);
    o.transfer_timeout = milliseconds(c_.transfer_ms);
    for (auto& pool : pools_) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(pool.data()));
      o.args.kv.lens.push_back(pool.size());
      o.args.kv.item_lens.push_back(c_.item_bytes);
    }
    o.args.aux = aux_->Describe();
    o.args.page_size = 16;
    o.args.fingerprint = {int32_t(c_.layers), 8, 128, 2, 1, "pdlib-chaos"};
    if (prefill()) {
      o.args.parallel.dp_size = c_.dp_size;
      o.args.parallel.dp_rank = c_.dp_rank;
    }
    auto manager = pdlib::KVManager::Create(o);
    if (!manager.ok()) return Error("KVManager::Create: " + manager.status().ToString());
    manager_ = std::move(*manager);
    std::string port = "0";
    if (prefill()) port = manager_->endpoint().substr(manager_->endpoint().rfind(':') + 1);
    Emit("READY port=" + port);
    return true;
  }

  int Loop() {
    const auto deadline = Clock::now() + std::chrono::seconds(c_.max_seconds);
    while (!quit_) {
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "pdlib-chaos peer: max_seconds %lld passed, exiting\n",
                     static_cast<long long>(c_.max_seconds));
        std::fflush(stderr);
        _exit(3);
      }
      const bool progressed = Drive();
      ReadCommands(progressed ? 0 : (requests_.empty() ? 20 : 1));
    }
    requests_.clear();  // destroying a live handle aborts its room
    held_.clear();
    dropped_.clear();
    manager_.reset();
    Emit("BYE");
    return 0;
  }

 private:
  bool prefill() const { return c_.mode == pdlib::Mode::kPrefill; }

  bool Error(const std::string& message) {
    Emit("ERROR " + message);
    return false;
  }

  void StartRoom(uint64_t room) {
    auto r = std::make_unique<Request>();
    r->room = room;
    r->shape = ShapeOf(room, c_.max_pages, c_.max_chunks);
    pdlib::Status s;
    if (prefill()) {
      auto sender = manager_->CreateSender(room);
      s = sender.status();
      if (sender.ok()) r->sender = std::move(*sender);
    } else {
      auto receiver = manager_->CreateReceiver({c_.bootstrap_host, c_.bootstrap_port}, room);
      s = receiver.status();
      if (receiver.ok()) r->receiver = std::move(*receiver);
    }
    if (!s.ok()) {
      Emit("ROOM " + std::to_string(room) + " Failed " + s.ToString());
      return;
    }
    // The driver keeps at most `concurrency` rooms on a peer, so this only fails on a bug here.
    r->aux = slots_->Alloc();
    auto pages = pages_->Alloc(room, r->shape.pages, r->shape.contiguous);
    if (!r->aux || !pages) {
      if (r->aux) slots_->Free(*r->aux).IgnoreError();
      if (pages) pages_->Free(*pages);
      Emit("ROOM " + std::to_string(room) + " Failed RESOURCE_EXHAUSTED: chaos peer has no " +
           (r->aux ? "free pages" : "free metadata slot") + " for it (" +
           std::to_string(requests_.size()) + " rooms in flight)");
      return;
    }
    r->pages = std::move(*pages);
    slot_in_use_[*r->aux] = true;
    if (!prefill()) {
      for (int32_t page : r->pages) CheckFreePage(page);
      CheckFreeSlot(*r->aux);
    }
    // Prefill's engine writes the slot before the last chunk; decode clears it, so that what a
    // previous request left there cannot pass the check.
    pdlib::MetadataSlot slot;
    if (prefill()) {
      slot = AuxSlotOf(room);
      if (Spoiled(room, c_.corrupt_aux_one_in, 0xa)) slot.output_topk_index[15] ^= 1;
    } else {
      slot.bootstrap_room.fill(~uint64_t{0});
    }
    if (pdlib::Status s = aux_->WriteSlot(*r->aux, slot); !s.ok()) {
      Error("WriteSlot: " + s.ToString());
    }
    requests_.push_back(std::move(r));
  }

  // One pass over every request; true when anything moved.
  bool Drive() {
    bool progressed = ReleaseReusable();
    for (size_t i = 0; i < requests_.size();) {
      Request& r = *requests_[i];
      const pdlib::KVPoll st = r.handle().Poll();
      if (pdlib::IsTerminal(st)) {
        Finish(i, st);
        progressed = true;
        continue;
      }
      progressed |= prefill() ? StepSender(r, st) : StepReceiver(r, st);
      ++i;
    }
    return progressed;
  }

  bool StepReceiver(Request& r, pdlib::KVPoll st) {
    if (r.initialized) return false;
    if (!r.shape.early_init && st < pdlib::KVPoll::kWaitingForInput) return false;
    r.initialized = true;
    if (pdlib::Status s = r.receiver->Init(r.pages, r.aux); !s.ok()) {
      Emit("ERROR room " + std::to_string(r.room) + " Init: " + s.ToString());
      r.receiver->Abort("Init() refused: " + s.ToString());
    }
    return true;
  }

  // The simulated forward pass before each chunk of `r`.
  Clock::duration ChunkComputeTime(const Request& r) const {
    const uint64_t total_ms = Mix(r.room ^ 0x636f6d70ULL) % uint64_t(2 * c_.prefill_ms + 1);
    return milliseconds(int64_t(total_ms / r.shape.chunks));
  }

  // One chunk per pass, its pages filled just before its Send(), as a chunked prefill would.
  bool StepSender(Request& r, pdlib::KVPoll st) {
    if (st < pdlib::KVPoll::kWaitingForInput || r.chunks_sent == r.shape.chunks) return false;
    auto refused = [&](const pdlib::Status& s, const char* what) {
      if (s.ok()) return false;
      Emit("ERROR room " + std::to_string(r.room) + " " + what + ": " + s.ToString());
      r.sender->Abort(std::string(what) + " refused: " + s.ToString());
      r.chunks_sent = r.shape.chunks;
      return true;
    };
    const auto now = Clock::now();
    if (!r.initialized) {
      r.initialized = true;
      if (refused(r.sender->Init(r.pages.size(), r.aux), "Init")) return true;
      r.next_chunk_at = now + ChunkComputeTime(r);
      return true;
    }
    if (now < r.next_chunk_at) return false;
    r.next_chunk_at = now + ChunkComputeTime(r);
    size_t first = 0;
    for (size_t c = 0; c < r.chunks_sent; ++c) first += ChunkPages(r.shape, c);
    const size_t n = ChunkPages(r.shape, r.chunks_sent);
    for (size_t b = 0; b < pools_.size(); ++b) {
      for (size_t i = first; i < first + n; ++i) {
        FillPage(pools_[b].data() + size_t(r.pages[i]) * c_.item_bytes, c_.item_bytes, r.room,
                 uint32_t(b), uint32_t(i));
      }
    }
    if (first == 0 && Spoiled(r.room, c_.corrupt_kv_one_in, 0xb)) {
      pools_.back()[size_t(r.pages[0]) * c_.item_bytes + c_.item_bytes / 3] ^= 0x10;
    }
    ++r.chunks_sent;
    const bool last = r.chunks_sent == r.shape.chunks;
    refused(r.sender->Send(std::span(r.pages).subspan(first, n), last), "Send");
    return true;
  }

  // Decode, after Success: nullopt when every KV byte and the aux slot are the request's.
  std::optional<std::string> Check(const Request& r) const {
    auto slot = aux_->ReadSlot(*r.aux);
    if (!slot.ok()) return "aux.ReadSlot:" + std::string(slot.status().message());
    if (auto bad = CheckAuxSlot(*slot, r.room)) return bad;
    for (size_t b = 0; b < pools_.size(); ++b) {
      for (size_t i = 0; i < r.pages.size(); ++i) {
        auto bad = CheckPage(pools_[b].data() + size_t(r.pages[i]) * c_.item_bytes, c_.item_bytes,
                             r.room, uint32_t(b), uint32_t(i));
        if (bad) return *bad + ",page=" + std::to_string(r.pages[i]);
      }
    }
    return std::nullopt;
  }

  void Finish(size_t index, pdlib::KVPoll st) {
    std::unique_ptr<Request> r = std::move(requests_[index]);
    requests_.erase(requests_.begin() + std::ptrdiff_t(index));
    const uint64_t room_id = r->room;
    const std::string room = std::to_string(room_id);
    if (st != pdlib::KVPoll::kSuccess) {
      Emit("ROOM " + room + " Failed " + r->handle().FailureReason().ToString());
    } else if (prefill()) {
      Emit("ROOM " + room + " Success OK");
    } else if (!c_.verify) {
      Emit("ROOM " + room + " Success OK bytes=0");
    } else if (auto bad = Check(*r)) {
      Emit("ROOM " + room + " BadBytes " + *bad);
    } else {
      const uint64_t bytes = r->pages.size() * pools_.size() * c_.item_bytes + AuxSlotBytes();
      Emit("ROOM " + room + " Success OK bytes=" + std::to_string(bytes));
    }
    // Page reuse (kv_manager.h): a failed request's pages stay aside until pdlib says no late
    // write can land in them. Half of such requests keep their handle and poll PagesReusable();
    // the other half drop it at once and wait for the room in TakeReusableRooms().
    if (!r->handle().PagesReusable()) {
      r->held_since = Clock::now();
      if (Mix(room_id ^ 0x686f6c64ULL) % 2 == 0) {
        held_.push_back(std::move(r));
      } else {
        r->sender.reset();
        r->receiver.reset();
        dropped_.emplace(room_id, std::move(r));
      }
      return;
    }
    Release(std::move(r));
  }

  // Handles put aside whose pages became reusable: released now. True when any was.
  bool ReleaseReusable() {
    bool any = false;
    for (size_t i = 0; i < held_.size();) {
      if (!held_[i]->handle().PagesReusable()) {
        ++i;
        continue;
      }
      std::unique_ptr<Request> r = std::move(held_[i]);
      held_.erase(held_.begin() + std::ptrdiff_t(i));
      Release(std::move(r));
      any = true;
    }
    if (dropped_.empty()) return any;
    for (uint64_t room : manager_->TakeReusableRooms()) {
      auto it = dropped_.find(room);
      if (it == dropped_.end()) continue;  // a failed room released after PagesReusable()
      std::unique_ptr<Request> r = std::move(it->second);
      dropped_.erase(it);
      Release(std::move(r));
      any = true;
    }
    return any;
  }

  size_t HeldPages() const {
    size_t n = 0;
    for (const auto& r : held_) n += r->pages.size();
    for (const auto& [room, r] : dropped_) n += r->pages.size();
    return n;
  }

  // The engine releases the request: the handle first, then its slot and pages.
  void Release(std::unique_ptr<Request> r) {
    const uint64_t room_id = r->room;
    if (r->held_since != Clock::time_point{} && !prefill()) {
      const auto held_ms = std::chrono::duration_cast<milliseconds>(Clock::now() - r->held_since);
      Emit("QUARANTINE room=" + std::to_string(room_id) + " pages=" +
           std::to_string(r->pages.size()) + " held_ms=" + std::to_string(held_ms.count()) +
           " held_pages_now=" + std::to_string(HeldPages() + r->pages.size()));
    }
    r->sender.reset();
    r->receiver.reset();
    const std::optional<uint32_t> aux = r->aux;
    const std::vector<int32_t> pages = std::move(r->pages);
    r.reset();

    if (!prefill()) {
      // From here on pdlib must not write to them: the canary shows if it does.
      for (size_t i = 0; i < pages.size(); ++i) {
        PoisonPage(pages[i]);
        last_room_[size_t(pages[i])] = room_id;
        last_position_[size_t(pages[i])] = uint32_t(i);
      }
      if (!pages.empty() && Spoiled(room_id, c_.corrupt_free_one_in, 0xc)) {
        pools_.front()[size_t(pages[0]) * c_.item_bytes + 7] ^= 0x01;
      }
      if (aux) {
        PoisonSlot(*aux);
        last_slot_room_[*aux] = room_id;
      }
    }
    if (aux) {
      slot_in_use_[*aux] = false;
      slots_->Free(*aux).IgnoreError();
    }
    pages_->Free(pages);
  }

  // Decode: the pages and metadata slots the engine does not lend to pdlib hold a canary byte;
  // a write there is a write after its request was over (a stale or misdirected write).
  void PoisonPage(int32_t page) {
    for (auto& pool : pools_) {
      std::memset(pool.data() + size_t(page) * c_.item_bytes, kCanary, c_.item_bytes);
    }
  }

  void PoisonSlot(uint32_t slot) {
    for (int f = 0; f < pdlib::kMetadataFieldCount; ++f) {
      auto row = aux_->Row(pdlib::MetadataField(f), slot);
      std::memset(row.data(), kCanary, row.size());
    }
  }

  // Reports (STALE line) and restores a free page whose canary was overwritten. Returns true
  // when it was intact.
  bool CheckFreePage(int32_t page) {
    std::string first;   // the first overwritten byte
    size_t buffers = 0;  // buffers of this page with one
    bool from_last = true;
    const uint64_t last = last_room_[size_t(page)];
    for (size_t b = 0; b < pools_.size(); ++b) {
      const uint8_t* p = pools_[b].data() + size_t(page) * c_.item_bytes;
      const uint8_t* end = p + c_.item_bytes;
      const uint8_t* bad = std::find_if(p, end, [](uint8_t x) { return x != kCanary; });
      if (bad == end) continue;
      if (buffers++ == 0) {
        first = " buffer=" + std::to_string(b) + " offset=" + std::to_string(bad - p);
      }
      from_last &= last != kNoRoom &&
                   !CheckPage(p, c_.item_bytes, last, uint32_t(b), last_position_[size_t(page)]);
    }
    if (buffers == 0) return true;
    Emit("STALE page=" + std::to_string(page) + first + " buffers=" + std::to_string(buffers) +
         " last_room=" + (last == kNoRoom ? std::string("none") : std::to_string(last)) +
         " holds_last_room_bytes=" + (from_last ? "1" : "0"));
    PoisonPage(page);
    return false;
  }

  bool CheckFreeSlot(uint32_t slot) {
    bool intact = true;
    for (int f = 0; f < pdlib::kMetadataFieldCount; ++f) {
      auto row = aux_->Row(pdlib::MetadataField(f), slot);
      if (std::all_of(row.begin(), row.end(),
                      [](std::byte x) { return x == std::byte{kCanary}; })) {
        continue;
      }
      intact = false;
      const uint64_t last = last_slot_room_[slot];
      Emit("STALE aux_slot=" + std::to_string(slot) + " field=" + std::to_string(f) +
           " last_room=" + (last == kNoRoom ? std::string("none") : std::to_string(last)));
    }
    if (!intact) PoisonSlot(slot);
    return intact;
  }

  // Decode: every free page and slot still holds its canary. Returns how many did not.
  uint64_t SweepFree() {
    uint64_t broken = 0;
    if (prefill()) return 0;
    for (size_t page = 0; page < pages_->capacity(); ++page) {
      if (!pages_->in_use(page) && !CheckFreePage(int32_t(page))) ++broken;
    }
    for (size_t slot = 0; slot < slot_in_use_.size(); ++slot) {
      if (!slot_in_use_[slot] && !CheckFreeSlot(uint32_t(slot))) ++broken;
    }
    return broken;
  }

  void PrintMetrics() {
    const uint64_t stale = SweepFree();
    const pdlib::KVManagerMetrics m = manager_->metrics();
    std::ostringstream out;
    out << "METRICS live_rooms=" << m.live_rooms << " connections=" << m.connections
        << " bootstrap_queue=" << m.bootstrap_queue_size
        << " transfer_queue=" << m.transfer_queue_size << " requests_total=" << m.requests_total
        << " rooms_succeeded=" << m.rooms_succeeded << " rooms_failed=" << m.rooms_failed
        << " handles=" << requests_.size() + held_.size() + dropped_.size()
        << " quarantined_pages=" << m.quarantined_pages
        << " quarantine_max_hold_ms=" << m.quarantine_max_hold_ms
        << " aux_free=" << slots_->available() << " aux_capacity=" << slots_->capacity()
        << " pages_free=" << pages_->available() << " pages_capacity=" << pages_->capacity()
        << " stale_free=" << stale;
    Emit(out.str());
  }

  void HandleCommand(std::string_view line) {
    std::istringstream in{std::string(line)};
    std::string cmd;
    in >> cmd;
    if (cmd == "START") {
      uint64_t room = 0;
      if (in >> room) {
        StartRoom(room);
      } else {
        Error("usage: START <room>");
      }
    } else if (cmd == "METRICS") {
      PrintMetrics();
    } else if (cmd == "QUIT") {
      quit_ = true;
    } else if (!cmd.empty()) {
      Error("unknown command '" + cmd + "'");
    }
  }

  // Runs every complete line stdin has, waiting up to timeout_ms for the first byte.
  void ReadCommands(int timeout_ms) {
    pollfd pfd{STDIN_FILENO, POLLIN, 0};
    if (::poll(&pfd, 1, timeout_ms) <= 0) return;
    char buf[4096];
    const ssize_t n = ::read(STDIN_FILENO, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      quit_ = true;  // the driver is gone or closed our input
      return;
    }
    input_.append(buf, size_t(n));
    for (size_t nl; !quit_ && (nl = input_.find('\n')) != std::string::npos;) {
      const std::string line = input_.substr(0, nl);
      input_.erase(0, nl + 1);
      HandleCommand(line);
    }
  }

  static constexpr uint8_t kCanary = 0xc5;
  static constexpr uint64_t kNoRoom = ~uint64_t{0};

  const PeerConfig c_;
  std::vector<std::vector<uint8_t>> pools_;  // a K and a V pool per layer
  std::unique_ptr<PagePool> pages_;
  std::unique_ptr<pdlib::MetadataBuffers> aux_;
  std::unique_ptr<pdlib::MetadataSlotAllocator> slots_;
  std::vector<bool> slot_in_use_;
  // Decode: the request that last held each page (and its position there) and each slot.
  std::vector<uint64_t> last_room_;
  std::vector<uint32_t> last_position_;
  std::vector<uint64_t> last_slot_room_;
  std::unique_ptr<pdlib::KVManager> manager_;
  std::vector<std::unique_ptr<Request>> requests_;
  // Over, pages not reusable yet: with their handle, or with the handle dropped (by room).
  std::vector<std::unique_ptr<Request>> held_;
  std::map<uint64_t, std::unique_ptr<Request>> dropped_;
  std::string input_;
  bool quit_ = false;
};

}  // namespace

std::vector<std::string> PeerArgs(const PeerConfig& c) {
  const std::pair<const char*, std::string> flags[] = {
      {"--role", c.mode == pdlib::Mode::kPrefill ? "prefill" : "decode"},
      {"--listen-host", c.listen_host},
      {"--bootstrap-host", c.bootstrap_host},
      {"--bootstrap-port", std::to_string(c.bootstrap_port)},
      {"--dp-size", std::to_string(c.dp_size)},
      {"--dp-rank", std::to_string(c.dp_rank)},
      {"--backend", c.backend},
      {"--concurrency", std::to_string(c.concurrency)},
      {"--layers", std::to_string(c.layers)},
      {"--item-bytes", std::to_string(c.item_bytes)},
      {"--max-pages", std::to_string(c.max_pages)},
      {"--max-chunks", std::to_string(c.max_chunks)},
      {"--prefill-ms", std::to_string(c.prefill_ms)},
      {"--liveness-ms", std::to_string(c.liveness_ms)},
      {"--connect-timeout-ms", std::to_string(c.connect_ms)},
      {"--bootstrap-timeout-ms", std::to_string(c.bootstrap_ms)},
      {"--waiting-timeout-ms", std::to_string(c.waiting_ms)},
      {"--transfer-timeout-ms", std::to_string(c.transfer_ms)},
      {"--corrupt-kv-one-in", std::to_string(c.corrupt_kv_one_in)},
      {"--corrupt-aux-one-in", std::to_string(c.corrupt_aux_one_in)},
      {"--corrupt-free-one-in", std::to_string(c.corrupt_free_one_in)},
      {"--max-seconds", std::to_string(c.max_seconds)},
  };
  std::vector<std::string> a;
  for (const auto& [flag, value] : flags) {
    a.push_back(flag);
    a.push_back(value);
  }
  for (const auto& [k, v] : c.backend_options) {
    a.push_back("--backend-option");
    a.push_back(k + "=" + v);
  }
  if (!c.etcd_endpoints.empty()) {
    std::string endpoints;
    for (const std::string& e : c.etcd_endpoints) endpoints += (endpoints.empty() ? "" : ",") + e;
    a.insert(a.end(), {"--discovery", "etcd", "--etcd-endpoints", endpoints});
  }
  if (!c.verify) a.push_back("--no-verify");
  return a;
}

int RunPeer(const PeerConfig& config) {
  Peer peer(config);
  if (!peer.Start()) return 1;
  return peer.Loop();
}

}  // namespace pdlib_chaos
