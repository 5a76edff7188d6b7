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

// Slot kinds of state take one item per request (mamba, c128_state); swa takes the window's
// pages.
bool IsSlotKind(pdlib::StateType type) { return type != pdlib::StateType::kSwa; }

// One pool of the engine's memory: the KV pages (a K and a V buffer per layer, `family` unset)
// or one state family (a buffer per layer): its buffers, its allocator and, on decode, the
// request that last held each item (and its position there).
struct Pool {
  std::string name;              // "kv", or the family's kind ("mamba", "swa", "c128_state")
  std::optional<size_t> family;  // index in KVArgs::state_families; nullopt: the KV pool
  pdlib::StateType type = pdlib::StateType::kNone;
  size_t item = 0;  // bytes per item (page or slot) and buffer
  std::vector<std::vector<uint8_t>> buffers;
  std::unique_ptr<PagePool> alloc;
  std::vector<uint64_t> last_room;
  std::vector<uint32_t> last_position;

  uint8_t* At(size_t buffer, int32_t index) {
    return buffers[buffer].data() + size_t(index) * item;
  }
  const uint8_t* At(size_t buffer, int32_t index) const {
    return buffers[buffer].data() + size_t(index) * item;
  }
  // The byte pattern's buffer id (chaos_pattern.h).
  uint32_t BufferId(size_t buffer) const {
    return family ? StateBufferId(*family, buffer) : uint32_t(buffer);
  }
};

// One request in flight and what the peer holds for it.
struct Request {
  uint64_t room = 0;
  RequestShape shape;
  std::unique_ptr<pdlib::KVSender> sender;
  std::unique_ptr<pdlib::KVReceiver> receiver;
  std::optional<uint32_t> aux;
  // The whole prompt's pages; on decode the first shape.prefix_pages are its own prefix (its
  // cache), the rest are handed over.
  std::vector<int32_t> pages;
  // Per state family, this side's index list; and all of them as pdlib takes them.
  std::vector<std::vector<int32_t>> state;
  std::vector<int32_t> state_flat;
  std::vector<uint32_t> state_counts;
  size_t chunks_sent = 0;             // prefill
  Clock::time_point next_chunk_at{};  // prefill: when the next chunk's "forward pass" is done
  Clock::time_point init_at{};        // decode: not Init before (pull: InitAt)
  bool initialized = false;
  bool handed_over = false;  // decode: Init() took the pages (InvalidPages() answers for them)
  Clock::time_point held_since{};  // when the engine put it aside, its pages not reusable yet
  // Prefill: what was wrong with the prefix pdlib reported (reported as BadBytes at the end).
  std::string bad;

  pdlib::StateIndices state_view() const { return {state_flat, state_counts}; }

  const pdlib::KVPollable& handle() const {
    return sender ? static_cast<const pdlib::KVPollable&>(*sender) : *receiver;
  }
};

class Peer {
 public:
  explicit Peer(const PeerConfig& c) : c_(c) {}

  bool Start() {
    const size_t slots = pdlib::MetadataBuffers::SlotCountFor(c_.concurrency);
    const uint64_t salt = prefill() ? 0x70ULL : 0x64ULL;
    auto add_pool = [&](std::string name, std::optional<size_t> family, pdlib::StateType type,
                        size_t buffers, size_t items, size_t item) {
      Pool p;
      p.name = std::move(name);
      p.family = family;
      p.type = type;
      p.item = item;
      p.buffers.resize(buffers);
      for (auto& b : p.buffers) b.assign(items * item, 0);
      p.alloc = std::make_unique<PagePool>(items, salt + 0x100 * pools_.size());
      p.last_room.assign(items, kNoRoom);
      p.last_position.assign(items, 0);
      pools_.push_back(std::move(p));
    };
    add_pool("kv", std::nullopt, pdlib::StateType::kNone, 2 * c_.layers,
             2 * c_.concurrency * c_.max_pages, c_.item_bytes);
    for (size_t f = 0; f < c_.state_families.size(); ++f) {
      const pdlib::StateType type = c_.state_families[f];
      // Slots: one per request, as many as metadata slots, half a page and 8 bytes each (a size
      // of their own, so that a write sized for another pool shows); swa: window pages.
      if (IsSlotKind(type)) {
        add_pool(std::string(pdlib::StateTypeName(type)), f, type, c_.layers, slots,
                 c_.item_bytes / 2 + 8);
      } else {
        add_pool(std::string(pdlib::StateTypeName(type)), f, type, c_.layers,
                 2 * c_.concurrency * kMaxWindowPages, c_.item_bytes);
      }
    }
    auto aux = pdlib::MetadataBuffers::Create(slots, 0, 0);
    if (!aux.ok()) return Error("MetadataBuffers::Create: " + aux.status().ToString());
    aux_ = std::move(*aux);
    slots_ = std::make_unique<pdlib::MetadataSlotAllocator>(slots);
    slot_in_use_.assign(slots, false);
    last_slot_room_.assign(slots, kNoRoom);
    if (!prefill()) {
      for (Pool& pool : pools_) {
        for (size_t i = 0; i < pool.alloc->capacity(); ++i) Poison(pool, int32_t(i));
      }
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
    o.direction = c_.direction;
    o.pull_lease = milliseconds(c_.pull_lease_ms);
    o.checksum = c_.checksum;
    if (c_.corrupt_in_flight_one_in > 0) {
      o.failure_injection_prob = 1.0 / double(c_.corrupt_in_flight_one_in);
      o.failure_injection_stages = "corrupt";
    }
    for (auto& buffer : kv().buffers) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(buffer.data()));
      o.args.kv.lens.push_back(buffer.size());
      o.args.kv.item_lens.push_back(c_.item_bytes);
    }
    // Every state family through KVArg::state_families, each buffer replicated (not split).
    for (size_t k = 1; k < pools_.size(); ++k) {
      pdlib::StateFamily family;
      family.type = pools_[k].type;
      for (auto& buffer : pools_[k].buffers) {
        family.buffers.ptrs.push_back(reinterpret_cast<uint64_t>(buffer.data()));
        family.buffers.lens.push_back(buffer.size());
        family.buffers.item_lens.push_back(pools_[k].item);
      }
      o.args.state_families.push_back(std::move(family));
    }
    o.args.aux = aux_->Describe();
    o.args.page_size = uint32_t(kPageTokens);
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
  bool pull() const { return c_.direction == pdlib::TransferDirection::kPull; }

  // Decode, pull: when decode calls Init for `room` (its TransferInfo goes then). Half the rooms
  // wait up to 2 x prefill_ms, as a decode waiting for memory would, so that prefill often
  // publishes before decode's TransferInfo arrives; the others as in push.
  Clock::time_point InitAt(uint64_t room) const {
    const uint64_t h = Mix(room ^ 0x7075626cULL);
    if (!pull() || h % 2 == 0) return Clock::now();
    return Clock::now() + milliseconds(int64_t((h >> 8) % uint64_t(2 * c_.prefill_ms + 1)));
  }

  bool Error(const std::string& message) {
    Emit("ERROR " + message);
    return false;
  }

  // The state items a request of `shape` takes in pool `pool` on this side.
  size_t StateItems(const Pool& pool, const RequestShape& shape) const {
    if (IsSlotKind(pool.type)) return 1;
    return prefill() ? shape.swa_prefill : shape.swa_decode;
  }

  // Entries of a state family's lists that pdlib pairs up (AlignStateLists): the first ones of
  // the shorter list.
  static size_t PairedItems(const Pool& pool, const RequestShape& shape) {
    if (IsSlotKind(pool.type)) return 1;
    return std::min(shape.swa_prefill, shape.swa_decode);
  }

  void StartRoom(uint64_t room) {
    auto r = std::make_unique<Request>();
    r->room = room;
    r->shape = ShapeOf(room, c_.max_pages, c_.max_chunks, c_.prefix_share);
    if (!prefill()) r->init_at = InitAt(room);
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
    std::string missing = r->aux ? "" : "free metadata slot";
    std::vector<std::vector<int32_t>> items;  // per pool: the KV pages, then each family's
    for (size_t k = 0; k < pools_.size() && missing.empty(); ++k) {
      const size_t n = k == 0 ? r->shape.pages : StateItems(pools_[k], r->shape);
      auto got = pools_[k].alloc->Alloc(room, n, r->shape.contiguous);
      if (!got) {
        missing = "free " + pools_[k].name + (k == 0 ? " pages" : " items");
        break;
      }
      items.push_back(std::move(*got));
    }
    if (!missing.empty()) {
      if (r->aux) slots_->Free(*r->aux).IgnoreError();
      for (size_t k = 0; k < items.size(); ++k) pools_[k].alloc->Free(items[k]);
      Emit("ROOM " + std::to_string(room) + " Failed RESOURCE_EXHAUSTED: chaos peer has no " +
           missing + " for it (" + std::to_string(requests_.size()) + " rooms in flight)");
      return;
    }
    r->pages = std::move(items[0]);
    for (size_t k = 1; k < items.size(); ++k) {
      r->state_flat.insert(r->state_flat.end(), items[k].begin(), items[k].end());
      r->state_counts.push_back(uint32_t(items[k].size()));
      r->state.push_back(std::move(items[k]));
    }
    slot_in_use_[*r->aux] = true;
    if (!prefill()) {
      for (size_t k = 0; k < pools_.size(); ++k) {
        for (int32_t i : Items(*r, k)) CheckFree(pools_[k], i);
      }
      CheckFreeSlot(*r->aux);
      // Decode's own prefix: its cache holds these pages' KV, which pdlib must never write.
      for (size_t b = 0; b < kv().buffers.size(); ++b) {
        for (size_t i = 0; i < r->shape.prefix_pages; ++i) {
          FillPage(kv().At(b, r->pages[i]), kv().item, room, PrefixBufferId(b), uint32_t(i));
        }
      }
      if (r->shape.prefix_pages > 0 && Spoiled(room, c_.corrupt_prefix_one_in, 0xd)) {
        kv().At(0, r->pages[0])[c_.item_bytes / 5] ^= 0x04;
      }
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
    if (r.initialized || Clock::now() < r.init_at) return false;
    if (!r.shape.early_init && st < pdlib::KVPoll::kWaitingForInput) return false;
    r.initialized = true;
    pdlib::ReceiveRequest request;
    request.kv_page_indices = std::span(r.pages).subspan(r.shape.prefix_pages);
    request.aux_index = r.aux;
    request.state = r.state_view();
    request.decode_prefix_len = r.shape.prefix_pages * kPageTokens;
    request.prompt_len = r.shape.prompt_tokens;
    if (pdlib::Status s = r.receiver->Init(request); !s.ok()) {
      Emit("ERROR room " + std::to_string(r.room) + " Init: " + s.ToString());
      r.receiver->Abort("Init() refused: " + s.ToString());
    } else {
      r.handed_over = true;
    }
    return true;
  }

  // The simulated forward pass before each chunk of `r`.
  Clock::duration ChunkComputeTime(const Request& r) const {
    const uint64_t total_ms = Mix(r.room ^ 0x636f6d70ULL) % uint64_t(2 * c_.prefill_ms + 1);
    return milliseconds(int64_t(total_ms / r.shape.chunks));
  }

  // One chunk per pass, its pages filled just before its Send(), as a chunked prefill would.
  // Push sends once decode's TransferInfo is in (WaitingForInput). Pull publishes each chunk as
  // soon as it is computed, decode's TransferInfo or not, as a pull engine does: pdlib gives a
  // room that never publishes no deadline while decode has not come (prefill_core.cc), so an
  // engine that waited for decode here would hold a room forever when decode never comes.
  bool StepSender(Request& r, pdlib::KVPoll st) {
    if (r.chunks_sent == r.shape.chunks) return false;
    if (st < pdlib::KVPoll::kWaitingForInput && !pull()) return false;
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
      // Push: decode's prefix, known now, must be the one decode holds, and only the pages
      // after it go. Pull: every page goes (decode's prefix is checked at Success).
      if (!CheckPrefix(r)) {
        if (pdlib::IsTerminal(r.sender->Poll())) return true;  // failed meanwhile: Finish says
        r.sender->Abort("pdlib-chaos: " + r.bad);
        r.chunks_sent = r.shape.chunks;
        return true;
      }
      if (refused(r.sender->Init(PublishedPages(r.shape, c_.direction), r.aux), "Init")) {
        return true;
      }
      r.next_chunk_at = now + ChunkComputeTime(r);
      return true;
    }
    if (now < r.next_chunk_at) return false;
    r.next_chunk_at = now + ChunkComputeTime(r);
    // Positions [first, first + n) of the prompt: push starts after decode's prefix, pull at
    // the first page. The negative control that ignores decode's prefix sends, in push, the
    // same number of pages from the start of the prompt; in pull it publishes position
    // i - prefix in page i, which is what a decode that ignored its prefix would read.
    const bool ignore_prefix = Spoiled(r.room, c_.ignore_prefix_one_in, 0xf);
    size_t first = ignore_prefix || pull() ? 0 : r.shape.prefix_pages;
    for (size_t c = 0; c < r.chunks_sent; ++c) first += ChunkPages(r.shape, c, c_.direction);
    const size_t n = ChunkPages(r.shape, r.chunks_sent, c_.direction);
    const size_t shift = pull() && ignore_prefix ? r.shape.pages - r.shape.prefix_pages : 0;
    for (size_t b = 0; b < kv().buffers.size(); ++b) {
      for (size_t i = first; i < first + n; ++i) {
        FillPage(kv().At(b, r.pages[i]), c_.item_bytes, r.room, uint32_t(b),
                 uint32_t((i + shift) % r.shape.pages));
      }
    }
    if (r.chunks_sent == 0 && n > 0 && Spoiled(r.room, c_.corrupt_kv_one_in, 0xb)) {
      kv().At(kv().buffers.size() - 1, r.pages[first])[c_.item_bytes / 3] ^= 0x10;
    }
    ++r.chunks_sent;
    const bool last = r.chunks_sent == r.shape.chunks;
    const auto chunk = std::span(r.pages).subspan(first, n);
    if (!last || pools_.size() == 1) {
      refused(r.sender->Send(chunk, last), "Send");
      return true;
    }
    // The state goes with the last chunk: entry k of each family's list holds position k.
    for (size_t k = 1; k < pools_.size(); ++k) {
      Pool& pool = pools_[k];
      const std::vector<int32_t>& items = r.state[k - 1];
      for (size_t b = 0; b < pool.buffers.size(); ++b) {
        for (size_t e = 0; e < items.size(); ++e) {
          FillPage(pool.At(b, items[e]), pool.item, r.room, pool.BufferId(b), uint32_t(e));
        }
      }
    }
    if (Spoiled(r.room, c_.corrupt_state_one_in, 0xe)) {
      Pool& pool = pools_.back();
      pool.At(pool.buffers.size() - 1, r.state.back()[0])[pool.item / 2] ^= 0x20;
    }
    refused(r.sender->SendStates(chunk, true, r.state_view()), "Send");
    return true;
  }

  // Prefill before its first chunk: whether decode_prefix_len() (push: at WaitingForInput) and
  // PagesAfterPrefix() say what the room's decode holds; otherwise r.bad says what they said.
  // Pull: PagesAfterPrefix() is every page of the prompt, known before decode's TransferInfo,
  // and decode's prefix may not be known yet (CheckPulledPrefix checks it at Success).
  bool CheckPrefix(Request& r) const {
    if (!pull() && !CheckDecodePrefix(r)) return false;
    const size_t expected = PublishedPages(r.shape, c_.direction);
    const auto pages = r.sender->PagesAfterPrefix(r.shape.prompt_tokens);
    if (!pages.ok() || *pages != expected) {
      r.bad = "prefix:PagesAfterPrefix(" + std::to_string(r.shape.prompt_tokens) +
              ")=" + (pages.ok() ? std::to_string(*pages) : pages.status().ToString()) +
              ",expected=" + std::to_string(expected);
      return false;
    }
    return true;
  }

  // Whether decode_prefix_len() is the prefix the room's decode holds (r.bad says otherwise).
  static bool CheckDecodePrefix(Request& r) {
    const uint64_t want = r.shape.prefix_pages * kPageTokens;
    const std::optional<uint64_t> prefix = r.sender->decode_prefix_len();
    if (prefix == want) return true;
    r.bad = "prefix:decode_prefix_len=" + (prefix ? std::to_string(*prefix) : "nullopt") +
            ",expected=" + std::to_string(want);
    return false;
  }

  // Decode, pull, after Failed: the pages InvalidPages() leaves out are those whose every read
  // completed, which an engine may keep (recomputing only the others): each must hold its
  // tokens' bytes. Sets *kept to how many were checked; the first wrong one otherwise.
  std::optional<std::string> CheckKept(const Request& r, size_t* kept) const {
    *kept = 0;
    // A room that failed before Init() took its pages: pdlib never had them (InvalidPages() is
    // about Init()'s pages only), so none is kept.
    if (prefill() || !pull() || !c_.verify || !r.receiver || !r.handed_over) return std::nullopt;
    const std::vector<int32_t> invalid = r.receiver->InvalidPages();
    const Pool& kv_pool = kv();
    for (size_t i = r.shape.prefix_pages; i < r.pages.size(); ++i) {
      if (std::find(invalid.begin(), invalid.end(), r.pages[i]) != invalid.end()) continue;
      for (size_t b = 0; b < kv_pool.buffers.size(); ++b) {
        auto bad =
            CheckPage(kv_pool.At(b, r.pages[i]), kv_pool.item, r.room, uint32_t(b), uint32_t(i));
        if (bad) return "kept_page=" + std::to_string(r.pages[i]) + "," + *bad;
      }
      ++*kept;
    }
    return std::nullopt;
  }

  // The items of pool `k` that `r` holds.
  static const std::vector<int32_t>& Items(const Request& r, size_t k) {
    return k == 0 ? r.pages : r.state[k - 1];
  }

  // Decode, after Success: nullopt when every KV byte after the prefix, every state item pdlib
  // pairs up and the aux slot are the request's, and the state items beyond the pairing are
  // untouched.
  std::optional<std::string> Check(const Request& r) const {
    auto slot = aux_->ReadSlot(*r.aux);
    if (!slot.ok()) return "aux.ReadSlot:" + std::string(slot.status().message());
    if (auto bad = CheckAuxSlot(*slot, r.room)) return bad;
    const Pool& kv_pool = kv();
    for (size_t b = 0; b < kv_pool.buffers.size(); ++b) {
      for (size_t i = r.shape.prefix_pages; i < r.pages.size(); ++i) {
        auto bad =
            CheckPage(kv_pool.At(b, r.pages[i]), kv_pool.item, r.room, uint32_t(b), uint32_t(i));
        if (bad) return *bad + ",page=" + std::to_string(r.pages[i]);
      }
    }
    for (size_t k = 1; k < pools_.size(); ++k) {
      const Pool& pool = pools_[k];
      const std::vector<int32_t>& items = r.state[k - 1];
      const size_t paired = PairedItems(pool, r.shape);
      for (size_t b = 0; b < pool.buffers.size(); ++b) {
        for (size_t e = 0; e < items.size(); ++e) {
          const uint8_t* p = pool.At(b, items[e]);
          const std::string where = ",state=" + pool.name + ",item=" + std::to_string(items[e]) +
                                    ",entry=" + std::to_string(e);
          if (e < paired) {
            auto bad = CheckPage(p, pool.item, r.room, pool.BufferId(b), uint32_t(e));
            if (bad) return *bad + where;
          } else if (std::any_of(p, p + pool.item, [](uint8_t x) { return x != kCanary; })) {
            return "unpaired_entry_written,buffer=" + std::to_string(b) + where;
          }
        }
      }
    }
    return std::nullopt;
  }

  // Bytes Check() compares on a Success.
  uint64_t CheckedBytes(const Request& r) const {
    uint64_t bytes = SentPages(r.shape) * kv().buffers.size() * kv().item + AuxSlotBytes();
    for (size_t k = 1; k < pools_.size(); ++k) {
      bytes += r.state[k - 1].size() * pools_[k].buffers.size() * pools_[k].item;
    }
    return bytes;
  }

  void Finish(size_t index, pdlib::KVPoll st) {
    std::unique_ptr<Request> r = std::move(requests_[index]);
    requests_.erase(requests_.begin() + std::ptrdiff_t(index));
    const uint64_t room_id = r->room;
    const std::string room = std::to_string(room_id);
    const std::string prefix = " prefix_pages=" + std::to_string(r->shape.prefix_pages);
    // Pull: every decode rank has read the room, so decode's prefix is known; it must be the one
    // the room's decode holds.
    if (r->bad.empty() && prefill() && pull() && st == pdlib::KVPoll::kSuccess) {
      CheckDecodePrefix(*r);
    }
    size_t kept = 0;
    std::optional<std::string> bad_kept;
    if (r->bad.empty() && st != pdlib::KVPoll::kSuccess) bad_kept = CheckKept(*r, &kept);
    if (kept > 0) Emit("KEPT room=" + room + " pages=" + std::to_string(kept));
    if (!r->bad.empty()) {
      Emit("ROOM " + room + " BadBytes " + r->bad);
    } else if (bad_kept) {
      Emit("ROOM " + room + " BadBytes " + *bad_kept);
    } else if (st != pdlib::KVPoll::kSuccess) {
      Emit("ROOM " + room + " Failed " + r->handle().FailureReason().ToString());
    } else if (prefill()) {
      Emit("ROOM " + room + " Success OK");
    } else if (!c_.verify) {
      Emit("ROOM " + room + " Success OK bytes=0" + prefix);
    } else if (auto bad = Check(*r)) {
      Emit("ROOM " + room + " BadBytes " + *bad);
    } else {
      Emit("ROOM " + room + " Success OK bytes=" + std::to_string(CheckedBytes(*r)) + prefix);
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

  // The engine releases the request: the handle first, then its slot, pages and state.
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
    // Decode's own prefix pages: whatever pdlib did with the request, they hold decode's bytes.
    if (!prefill()) CheckPrefixPages(*r);
    const std::optional<uint32_t> aux = r->aux;
    std::vector<std::vector<int32_t>> items = std::move(r->state);
    items.insert(items.begin(), std::move(r->pages));
    r.reset();

    if (!prefill()) {
      // From here on pdlib must not write to them: the canary shows if it does.
      for (size_t k = 0; k < pools_.size(); ++k) {
        for (size_t i = 0; i < items[k].size(); ++i) {
          Poison(pools_[k], items[k][i]);
          pools_[k].last_room[size_t(items[k][i])] = room_id;
          pools_[k].last_position[size_t(items[k][i])] = uint32_t(i);
        }
      }
      if (!items[0].empty() && Spoiled(room_id, c_.corrupt_free_one_in, 0xc)) {
        kv().At(0, items[0][0])[7] ^= 0x01;
      }
      if (aux) {
        PoisonSlot(*aux);
        last_slot_room_[*aux] = room_id;
      }
    }
    if (prefill() && pull()) {
      // Pull: decode reads these pages, and PagesReusable() said it no longer does. They get
      // bytes of their own (not decode's canary), so that a read after that would put them in
      // decode's copy: bad bytes on a Success or in a page InvalidPages() left out, or a stale
      // write in memory decode took back.
      for (size_t k = 0; k < pools_.size(); ++k) {
        for (int32_t i : items[k]) Poison(pools_[k], i, kPrefillFreed);
      }
      if (aux) PoisonSlot(*aux, kPrefillFreed);
    }
    if (aux) {
      slot_in_use_[*aux] = false;
      slots_->Free(*aux).IgnoreError();
    }
    for (size_t k = 0; k < pools_.size(); ++k) pools_[k].alloc->Free(items[k]);
  }

  Pool& kv() { return pools_.front(); }
  const Pool& kv() const { return pools_.front(); }

  // Decode: the pages and state items and the metadata slots the engine does not lend to pdlib
  // hold a canary byte; a write there is a write after its request was over (a stale or
  // misdirected write). In pull the writes are decode's own reads: one that lands after the
  // request was over (after PagesReusable() said none would) changes the canary the same way.
  void Poison(Pool& pool, int32_t index, uint8_t byte = kCanary) {
    for (size_t b = 0; b < pool.buffers.size(); ++b) {
      std::memset(pool.At(b, index), byte, pool.item);
    }
  }

  // Decode: reports (STALE prefix_page=... line) and restores each page of the request's own
  // prefix that no longer holds decode's bytes: pdlib never had it, so any write there is
  // misdirected or stale. Returns how many were.
  uint64_t CheckPrefixPages(const Request& r) {
    uint64_t broken = 0;
    Pool& pool = kv();
    for (size_t i = 0; i < r.shape.prefix_pages; ++i) {
      std::string first;
      for (size_t b = 0; b < pool.buffers.size(); ++b) {
        uint8_t* p = pool.At(b, r.pages[i]);
        if (auto bad = CheckPage(p, pool.item, r.room, PrefixBufferId(b), uint32_t(i))) {
          if (first.empty()) first = *bad;
          FillPage(p, pool.item, r.room, PrefixBufferId(b), uint32_t(i));
        }
      }
      if (first.empty()) continue;
      ++broken;
      Emit("STALE prefix_page=" + std::to_string(r.pages[i]) + " room=" + std::to_string(r.room) +
           " position=" + std::to_string(i) + " first_wrong=" + first);
    }
    return broken;
  }

  void PoisonSlot(uint32_t slot, uint8_t byte = kCanary) {
    for (int f = 0; f < pdlib::kMetadataFieldCount; ++f) {
      auto row = aux_->Row(pdlib::MetadataField(f), slot);
      std::memset(row.data(), byte, row.size());
    }
  }

  // Reports (STALE line) and restores a free page or state item whose canary was overwritten.
  // Returns true when it was intact.
  bool CheckFree(Pool& pool, int32_t index) {
    std::string first;   // the first overwritten byte
    size_t buffers = 0;  // buffers of this item with one
    bool from_last = true;
    const uint64_t last = pool.last_room[size_t(index)];
    for (size_t b = 0; b < pool.buffers.size(); ++b) {
      const uint8_t* p = pool.At(b, index);
      const uint8_t* end = p + pool.item;
      const uint8_t* bad = std::find_if(p, end, [](uint8_t x) { return x != kCanary; });
      if (bad == end) continue;
      if (buffers++ == 0) {
        first = " buffer=" + std::to_string(b) + " offset=" + std::to_string(bad - p);
      }
      from_last &= last != kNoRoom && !CheckPage(p, pool.item, last, pool.BufferId(b),
                                                 pool.last_position[size_t(index)]);
    }
    if (buffers == 0) return true;
    // The KV pool's line is the one it always was; a state pool's names the pool.
    const std::string what = pool.family ? "pool=" + pool.name + " item=" : "page=";
    Emit("STALE " + what + std::to_string(index) + first + " buffers=" + std::to_string(buffers) +
         " last_room=" + (last == kNoRoom ? std::string("none") : std::to_string(last)) +
         " holds_last_room_bytes=" + (from_last ? "1" : "0"));
    Poison(pool, index);
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

  // Decode: every free page, state item and slot still holds its canary, and the prefix pages
  // of every request held still hold decode's bytes. Returns how many did not.
  uint64_t SweepFree() {
    uint64_t broken = 0;
    if (prefill()) return 0;
    for (Pool& pool : pools_) {
      for (size_t i = 0; i < pool.alloc->capacity(); ++i) {
        if (!pool.alloc->in_use(i) && !CheckFree(pool, int32_t(i))) ++broken;
      }
    }
    for (const auto& r : requests_) broken += CheckPrefixPages(*r);
    for (const auto& r : held_) broken += CheckPrefixPages(*r);
    for (const auto& [room, r] : dropped_) broken += CheckPrefixPages(*r);
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
        << " corruptions_injected=" << m.corruptions_injected
        << " checksum_mismatches=" << m.checksum_mismatches << " aux_free=" << slots_->available()
        << " aux_capacity=" << slots_->capacity() << " pages_free=" << kv().alloc->available()
        << " pages_capacity=" << kv().alloc->capacity();
    size_t state_free = 0, state_capacity = 0;
    for (size_t k = 1; k < pools_.size(); ++k) {
      state_free += pools_[k].alloc->available();
      state_capacity += pools_[k].alloc->capacity();
    }
    out << " state_free=" << state_free << " state_capacity=" << state_capacity
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
  // Prefill, pull: what its memory holds once taken back (never kCanary, so that a late read of
  // it into decode's free memory changes decode's canary).
  static constexpr uint8_t kPrefillFreed = 0x3a;
  static constexpr uint64_t kNoRoom = ~uint64_t{0};

  const PeerConfig c_;
  std::vector<Pool> pools_;  // the KV pool, then one per state family
  std::unique_ptr<pdlib::MetadataBuffers> aux_;
  std::unique_ptr<pdlib::MetadataSlotAllocator> slots_;
  std::vector<bool> slot_in_use_;
  // Decode: the request that last held each metadata slot.
  std::vector<uint64_t> last_slot_room_;
  std::unique_ptr<pdlib::KVManager> manager_;
  std::vector<std::unique_ptr<Request>> requests_;
  // Over, pages not reusable yet: with their handle, or with the handle dropped (by room).
  std::vector<std::unique_ptr<Request>> held_;
  std::map<uint64_t, std::unique_ptr<Request>> dropped_;
  std::string input_;
  bool quit_ = false;
};

// The share as text that parses back to the same double.
std::string FormatShare(double share) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.17g", share);
  return text;
}

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
      {"--corrupt-state-one-in", std::to_string(c.corrupt_state_one_in)},
      {"--corrupt-prefix-one-in", std::to_string(c.corrupt_prefix_one_in)},
      {"--ignore-prefix-one-in", std::to_string(c.ignore_prefix_one_in)},
      {"--prefix-share", FormatShare(c.prefix_share)},
      {"--state-families", StateFamiliesName(c.state_families)},
      {"--max-seconds", std::to_string(c.max_seconds)},
      {"--direction", std::string(pdlib::TransferDirectionName(c.direction))},
      {"--pull-lease-ms", std::to_string(c.pull_lease_ms)},
      {"--checksum", c.checksum == pdlib::KvChecksum::kAll       ? "all"
                     : c.checksum == pdlib::KvChecksum::kSampled ? "sampled"
                                                                 : "off"},
      {"--corrupt-in-flight-one-in", std::to_string(c.corrupt_in_flight_one_in)},
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
