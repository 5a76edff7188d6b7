// pdlib_planner_peer: one side (prefill or decode) of an end-to-end planner scenario
// (e2e_scenario.h), with every rank of that side as a thread of this process, each with its own
// KVManager over the gRPC control plane and a real backend (ucx by default).
//
//   pdlib_planner_peer --role prefill|decode --scenario NAME --bootstrap-port P
//                      [--backend ucx] [--backend-option k=v]... [--first-room R]
//                      [--corrupt-room R]   (prefill: flip one KV byte of room R)
//                      [--wrong-aux-room R] (prefill: write room R's aux slot as another room's)
//                      [--layerwise SEED]   (prefill: announce layers with SendLayers, random
//                                            chunk sizes and steps from SEED)
//                      [--decode-prefix 1]  (decode holds PrefixPages of each room: it hands
//                                            over the rest, prefill sends only those)
//                      [--direction pull]   (decode reads prefill's published pages; prefill
//                                            publishes odd rooms before decode's TransferInfo)
//                      [--misplace-room R]  (prefill, pull: publish room R's first two pages
//                                            swapped; decode must find the bytes wrong)
//                      [--memory host|cuda] (where the KV and state pools live; cuda: on GPU 0,
//                                            registered as kCuda, mirrored in host memory where
//                                            the pattern is written and checked)
//
// Prefill: rank (tp 0, pp 0) runs the bootstrap server. Every rank fills its pools with the
// scenario's pattern for each room before sending it in `chunks` chunks, then prints
// `READY ...` (after start-up) and `DONE ok=<n> failed=<n>`.
// Decode: every rank receives each room, checks every byte of its pages, aux slot and state
// slots, prints `ROOM <room> <Success|Failed> tp=<r> pp=<r> <reason>`, then `DONE ...`.
// Both then wait for `QUIT` on stdin and exit 0 when every room of every rank succeeded (decode:
// arrived intact), 1 otherwise.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/kv_manager.h"
#include "pdlib/metadata_buffers.h"
#include "test/planner/e2e_scenario.h"
#include "test/support/device_buffer.h"

namespace {

using namespace std::chrono_literals;
using pdlib_e2e::RankShape;
using pdlib_e2e::Scenario;

std::mutex out_mu;
void Emit(const std::string& line) {
  std::lock_guard<std::mutex> lock(out_mu);
  std::cout << line << std::endl;
}

struct Flags {
  std::string role, scenario, backend = "ucx";
  std::map<std::string, std::string> backend_options;
  uint16_t bootstrap_port = 0;
  uint64_t first_room = 1000;
  int64_t corrupt_room = -1;  // prefill: spoil one KV byte of this room (negative control)
  // prefill: write this room's aux slot as if it were room + kWrongRoomOffset's (the decode-side
  // bootstrap_room check, SPEC R4.4, must fail it)
  int64_t wrong_aux_room = -1;
  // prefill: announce every chunk layer by layer (SendLayers), chunk sizes and steps drawn from
  // this seed; 0: Send() whole chunks
  uint64_t layerwise_seed = 0;
  bool cuda = false;           // --memory cuda
  bool decode_prefix = false;  // --decode-prefix 1
  // prefill (negative control): send the first pages of the request instead of those after
  // decode's prefix, as a sender that ignored the prefix would
  bool ignore_prefix = false;
  bool pull = false;           // --direction pull
  int64_t misplace_room = -1;  // prefill, pull: swap the room's first two published pages
};

constexpr uint64_t kWrongRoomOffset = 1000000;

// One rank: its pools, aux slots and manager.
class Rank {
 public:
  Rank(const Scenario& s, const Flags& f, bool decode, int32_t tp, int32_t pp)
      : s_(s), f_(f), decode_(decode) {
    const pdlib_e2e::SideShape& side = decode ? s.decode : s.prefill;
    shape_ = pdlib_e2e::ShapeOf(s, side, tp, pp);
  }

  pdlib::Status Start() {
    pdlib::KVManagerOptions o;
    o.mode = decode_ ? pdlib::Mode::kDecode : pdlib::Mode::kPrefill;
    o.backend = f_.backend;
    o.backend_options = f_.backend_options;
    o.bootstrap_port = f_.bootstrap_port;
    o.start_bootstrap_server = !decode_ && shape_.tp_rank == 0 && shape_.pp_rank == 0;
    o.liveness_timeout = 2000ms;
    o.connect_timeout = 10000ms;
    o.transfer_timeout = 20000ms;
    o.direction = f_.pull ? pdlib::TransferDirection::kPull : pdlib::TransferDirection::kPush;
    pdlib::KVArgs& a = o.args;
    a.page_size = s_.page_size;
    a.kv_head_num = s_.mla ? 1 : shape_.num_heads;
    a.kv_layout = s_.layout;
    a.is_mla = s_.mla;
    a.parallel = {shape_.tp_size, shape_.tp_rank, 1, 0, shape_.pp_size, shape_.pp_rank};
    a.prefill_start_layer = shape_.start_layer;
    a.fingerprint = {s_.layers, s_.mla ? 1 : s_.heads, static_cast<int32_t>(s_.head_bytes), 1, 1,
                     "e2e"};
    const uint64_t item = pdlib_e2e::KvItemBytes(s_, shape_);
    const int buffers = s_.mla ? shape_.num_layers : 2 * shape_.num_layers;
    kv_.resize(static_cast<size_t>(buffers));
    if (f_.cuda) {
      a.memory_kind = pdlib::MemoryKind::kCuda;
      a.device_id = 0;
    }
    for (auto& b : kv_) {
      b.assign(item * static_cast<uint64_t>(s_.pool_pages), 0);
      a.kv.ptrs.push_back(Register(b, &kv_twins_));
      a.kv.lens.push_back(b.size());
      a.kv.item_lens.push_back(item);
    }
    if (!twin_error_.empty()) return pdlib::Status::FailedPrecondition(twin_error_);
    auto aux = pdlib::MetadataBuffers::Create(static_cast<size_t>(s_.rooms), 0, 0);
    if (!aux.ok()) return aux.status();
    aux_ = std::move(*aux);
    a.aux = aux_->Describe();
    // Every stage of a hybrid model says so, also one that holds no state buffer itself. One
    // family: the shorthand fields; with extra families: KVArgs::state_families.
    pdlib::StateFamily mamba;
    mamba.type = pdlib::StateType::kMamba;
    mamba.start = shape_.state_start;
    for (int32_t i = 0; i < shape_.num_states; ++i) {
      const int32_t g = shape_.state_start + i;
      const uint64_t sitem = pdlib_e2e::StateItemBytes(s_, shape_, g);
      state_.emplace_back(sitem * static_cast<uint64_t>(s_.rooms), 0);
      mamba.buffers.ptrs.push_back(Register(state_.back(), &state_twins_));
      if (!twin_error_.empty()) return pdlib::Status::FailedPrecondition(twin_error_);
      mamba.buffers.lens.push_back(state_.back().size());
      mamba.buffers.item_lens.push_back(sitem);
      const bool split = pdlib_e2e::StateIsSplit(s_, g);
      mamba.dim_per_tensor.push_back(split ? 0 : -1);
      mamba.item_rows.push_back(1);
      mamba.split_units.push_back(split ? s_.state_units : 0);
    }
    if (s_.extra_families == 0) {
      if (pdlib_e2e::StatesTotal(s_) > 0) a.state_type = pdlib::StateType::kMamba;
      if (shape_.num_states > 0) {
        a.state_start = mamba.start;
        a.state = mamba.buffers;
        a.state_dim_per_tensor = mamba.dim_per_tensor;
        a.state_item_rows = mamba.item_rows;
        a.state_split_units = mamba.split_units;
      }
    } else {
      if (pdlib_e2e::StatesTotal(s_) > 0) a.state_families.push_back(mamba);
      for (int32_t k = 0; k < s_.extra_families; ++k) {
        pdlib::StateFamily f;
        f.type = pdlib_e2e::ExtraFamilyType(k);
        f.start = shape_.start_layer;
        extra_base_.push_back(state_.size());
        for (int32_t l = 0; l < shape_.num_layers; ++l) {
          state_.emplace_back(pdlib_e2e::kExtraItemBytes * pdlib_e2e::ExtraFamilyItems(s_, k), 0);
          f.buffers.ptrs.push_back(Register(state_.back(), &state_twins_));
          if (!twin_error_.empty()) return pdlib::Status::FailedPrecondition(twin_error_);
          f.buffers.lens.push_back(state_.back().size());
          f.buffers.item_lens.push_back(pdlib_e2e::kExtraItemBytes);
          f.dim_per_tensor.push_back(-1);
        }
        a.state_families.push_back(std::move(f));
      }
    }
    auto m = pdlib::KVManager::Create(o);
    if (!m.ok()) return m.status();
    manager_ = std::move(*m);
    return pdlib::Status::OK();
  }

  // Runs every room; returns how many succeeded (decode: arrived intact).
  int Run() {
    int ok = 0;
    for (int32_t i = 0; i < s_.rooms; ++i) {
      const uint64_t room = f_.first_room + static_cast<uint64_t>(i);
      std::string why = decode_ ? Receive(room) : SendRoom(room);
      if (why.empty()) ++ok;
      if (decode_) {
        Emit("ROOM " + std::to_string(room) + (why.empty() ? " Success" : " Failed") +
             " tp=" + std::to_string(shape_.tp_rank) + " pp=" + std::to_string(shape_.pp_rank) +
             " " + (why.empty() ? "OK" : why));
      } else if (!why.empty()) {
        Emit("PREFILL-FAIL room=" + std::to_string(room) + " tp=" + std::to_string(shape_.tp_rank) +
             " pp=" + std::to_string(shape_.pp_rank) + " " + why);
      }
    }
    return ok;
  }

  void Stop() {
    manager_.reset();
    kv_twins_.clear();
    state_twins_.clear();
  }

 private:
  template <typename Handle>
  static pdlib::KVPoll WaitFor(const Handle& h, pdlib::KVPoll at_least,
                               std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      pdlib::KVPoll p = h.Poll();
      if (p >= at_least || p == pdlib::KVPoll::kFailed) return p;
      if (std::chrono::steady_clock::now() > deadline) return p;
      std::this_thread::sleep_for(200us);
    }
  }

  // The address pdlib gets for host buffer `b`: itself, or (--memory cuda) its device twin.
  uint64_t Register(const std::vector<uint8_t>& b,
                    std::vector<std::unique_ptr<pdlib_test::DeviceBuffer>>* twins) {
    if (!f_.cuda) return reinterpret_cast<uint64_t>(b.data());
    std::unique_ptr<pdlib_test::DeviceBuffer> twin;
    if (std::string why = pdlib_test::DeviceBuffer::Allocate(b.size(), &twin); !why.empty()) {
      twin_error_ = why;
      return 0;
    }
    twins->push_back(std::move(twin));
    return reinterpret_cast<uint64_t>(twins->back()->data());
  }

  // --memory cuda: the host buffers' bytes to the pools pdlib reads (prefill) or spoils
  // (decode), or the pools' bytes back for the check. Nothing to do for host pools.
  std::string ToDevice() {
    for (size_t i = 0; i < kv_twins_.size(); ++i) {
      if (std::string why = kv_twins_[i]->Upload(kv_[i].data()); !why.empty()) return why;
    }
    for (size_t i = 0; i < state_twins_.size(); ++i) {
      if (std::string why = state_twins_[i]->Upload(state_[i].data()); !why.empty()) return why;
    }
    return "";
  }
  std::string FromDevice() {
    for (size_t i = 0; i < kv_twins_.size(); ++i) {
      if (std::string why = kv_twins_[i]->Download(kv_[i].data()); !why.empty()) return why;
    }
    for (size_t i = 0; i < state_twins_.size(); ++i) {
      if (std::string why = state_twins_[i]->Download(state_[i].data()); !why.empty()) return why;
    }
    return "";
  }

  uint32_t AuxSlot(uint64_t room) const { return static_cast<uint32_t>(room % s_.rooms); }
  int64_t AuxWord(uint64_t room) const { return static_cast<int64_t>(room * 31 + 7); }

  // Writes the pattern of local KV layers [first, end) into pages [from, to) of the request.
  void FillLayers(uint64_t room, const std::vector<int32_t>& pages, size_t from, size_t to,
                  int32_t first, int32_t end) {
    const uint64_t item = pdlib_e2e::KvItemBytes(s_, shape_);
    for (size_t b = 0; b < kv_.size(); ++b) {
      const int32_t local = static_cast<int32_t>(b % static_cast<size_t>(shape_.num_layers));
      if (local < first || local >= end) continue;
      const int32_t layer = shape_.start_layer + local;
      const int kv = s_.mla ? 0 : static_cast<int>(b / static_cast<size_t>(shape_.num_layers));
      for (size_t p = from; p < to; ++p) {
        uint8_t* page = kv_[b].data() + static_cast<uint64_t>(pages[p]) * item;
        for (uint64_t off = 0; off < item; ++off) {
          page[off] = pdlib_e2e::KvByte(s_, shape_, room, layer, kv, static_cast<int64_t>(p), off);
        }
        if (static_cast<int64_t>(room) == f_.corrupt_room && b + 1 == kv_.size() &&
            p + 1 == pages.size()) {
          page[0] ^= 1;
        }
      }
    }
  }

  // The request's state lists, one per family (mamba first when the model has it, then the
  // extra families), on this rank's side.
  std::vector<std::vector<int32_t>> StateLists(uint64_t room) const {
    std::vector<std::vector<int32_t>> lists;
    if (pdlib_e2e::StatesTotal(s_) > 0) {
      lists.emplace_back();
      if (shape_.num_states > 0) {
        lists.back().push_back(pdlib_e2e::RequestStateSlot(s_, room, decode_));
      }
    }
    for (int32_t k = 0; k < s_.extra_families; ++k) {
      lists.push_back(pdlib_e2e::ExtraIndices(s_, room, k, decode_));
    }
    return lists;
  }
  struct FlatState {
    std::vector<int32_t> indices;
    std::vector<uint32_t> counts;
    pdlib::StateIndices view() const { return {indices, counts}; }
  };
  FlatState Flatten(const std::vector<std::vector<int32_t>>& lists) const {
    FlatState f;
    for (const auto& l : lists) {
      f.indices.insert(f.indices.end(), l.begin(), l.end());
      f.counts.push_back(static_cast<uint32_t>(l.size()));
    }
    // The one-family shorthand takes no counts (and tests that path).
    if (s_.extra_families == 0) f.counts.clear();
    return f;
  }

  // Layer-wise streaming (--layerwise SEED): chunks of random sizes; each chunk's layers are
  // computed (written into the pool) a random number at a time, each step announced with
  // SendLayers, repeats and 0 included. A layer pdlib read before its announcement would reach
  // decode as the poison byte the pages hold until then. Pages [first, end) are sent (first:
  // decode's prefix); none left: one empty last chunk carries aux and state.
  std::string SendLayerwise(pdlib::KVSender& h, uint64_t room, const std::vector<int32_t>& pages,
                            size_t first, const pdlib::StateIndices& state) {
    std::mt19937_64 rng(f_.layerwise_seed * 1000003 + room * 7919 +
                        static_cast<uint64_t>(shape_.tp_rank * 31 + shape_.pp_rank));
    const int32_t layers = h.num_layers();
    if (layers != shape_.num_layers) {
      return "num_layers() " + std::to_string(layers) + ", expected " +
             std::to_string(shape_.num_layers);
    }
    const uint64_t item = pdlib_e2e::KvItemBytes(s_, shape_);
    for (auto& b : kv_) {
      for (int32_t p : pages) std::memset(b.data() + static_cast<uint64_t>(p) * item, 0x5A, item);
    }
    if (first == pages.size()) {
      auto st = h.SendLayersStates({}, layers, true, state);
      return st.ok() ? "" : "SendLayers(empty last chunk): " + st.ToString();
    }
    for (size_t at = first; at < pages.size();) {
      const size_t n = std::uniform_int_distribution<size_t>(1, pages.size() - at)(rng);
      const bool last = at + n == pages.size();
      const auto chunk = std::span<const int32_t>(pages).subspan(at, n);
      int32_t done = 0;
      while (true) {
        const int32_t next = std::min(
            layers, done + std::uniform_int_distribution<int32_t>(0, std::max(1, layers / 2))(rng));
        FillLayers(room, pages, at, at + n, done, next);
        if (std::string why = ToDevice(); !why.empty()) return why;
        auto st = h.SendLayersStates(chunk, next, last,
                                     last && next == layers ? state : pdlib::StateIndices{});
        if (!st.ok()) return "SendLayers(" + std::to_string(next) + "): " + st.ToString();
        done = next;
        if (done == layers) break;
      }
      at += n;
    }
    return "";
  }

  // Sends pages [first, end) in s_.chunks chunks with Send (the last one with the state).
  std::string SendChunks(pdlib::KVSender& h, const std::vector<int32_t>& pages, size_t first,
                         const FlatState& state) {
    const size_t left = pages.size() - first;
    const size_t per_chunk =
        (left + static_cast<size_t>(s_.chunks) - 1) / static_cast<size_t>(s_.chunks);
    for (size_t at = first; at < pages.size(); at += per_chunk) {
      const size_t n = std::min(per_chunk, pages.size() - at);
      const bool last = at + n == pages.size();
      auto st = h.SendStates(std::span<const int32_t>(pages).subspan(at, n), last,
                             last ? state.view() : pdlib::StateIndices{});
      if (!st.ok()) return "Send: " + st.ToString();
    }
    return "";
  }

  // The prefix this room's decode holds, in pages.
  int32_t Prefix(uint64_t room) const {
    return f_.decode_prefix ? pdlib_e2e::PrefixPages(s_, room) : 0;
  }

  std::string SendRoom(uint64_t room) {
    const auto pages = pdlib_e2e::RequestPages(s_, room, false);
    // Fill this rank's share of the model for the request (layer-wise: as announced). Prefill
    // computes the whole prompt, prefix included; only the pages after decode's prefix leave.
    if (f_.layerwise_seed == 0) FillLayers(room, pages, 0, pages.size(), 0, shape_.num_layers);
    const int32_t slot = pdlib_e2e::RequestStateSlot(s_, room, false);
    for (int32_t i = 0; i < shape_.num_states; ++i) {
      const int32_t g = shape_.state_start + i;
      const uint64_t sitem = pdlib_e2e::StateItemBytes(s_, shape_, g);
      uint8_t* p = state_[static_cast<size_t>(i)].data() + static_cast<uint64_t>(slot) * sitem;
      for (uint64_t off = 0; off < sitem; ++off) {
        p[off] = pdlib_e2e::StateByte(s_, shape_, room, g, off);
      }
    }
    for (int32_t k = 0; k < s_.extra_families; ++k) {
      const auto idx = pdlib_e2e::ExtraIndices(s_, room, k, false);
      for (int32_t l = 0; l < shape_.num_layers; ++l) {
        auto& buf = state_[extra_base_[static_cast<size_t>(k)] + static_cast<size_t>(l)];
        for (size_t e = 0; e < idx.size(); ++e) {
          for (uint64_t off = 0; off < pdlib_e2e::kExtraItemBytes; ++off) {
            buf[static_cast<uint64_t>(idx[e]) * pdlib_e2e::kExtraItemBytes + off] =
                pdlib_e2e::ExtraByte(room, k, shape_.start_layer + l, e, off);
          }
        }
      }
    }
    // Layer-wise, the KV follows each announcement (SendLayerwise); state goes now.
    if (std::string why = ToDevice(); !why.empty()) return why;
    const uint32_t aux = AuxSlot(room);
    aux_->bootstrap_room(aux)[0] =
        static_cast<int64_t>(room) == f_.wrong_aux_room ? room + kWrongRoomOffset : room;
    aux_->output_ids(aux)[0] = static_cast<int32_t>(AuxWord(room));

    auto sender = manager_->CreateSender(room);
    if (!sender.ok()) return "CreateSender: " + sender.status().ToString();
    auto& h = **sender;
    if (f_.pull) return PublishRoom(h, room, pages, aux);
    if (WaitFor(h, pdlib::KVPoll::kWaitingForInput, 20s) != pdlib::KVPoll::kWaitingForInput) {
      return "waiting for TransferInfo: " + h.FailureReason().ToString();
    }
    // Every prefill rank, dummies included, learns decode's prefix.
    const uint64_t want_prefix = static_cast<uint64_t>(Prefix(room)) * s_.page_size;
    const std::optional<uint64_t> prefix = h.decode_prefix_len();
    if (!prefix || *prefix != want_prefix) {
      return "decode_prefix_len() " + (prefix ? std::to_string(*prefix) : std::string("nullopt")) +
             ", decode holds " + std::to_string(want_prefix);
    }
    auto to_send = h.PagesAfterPrefix(pages.size() * s_.page_size);
    if (!to_send.ok()) return "PagesAfterPrefix: " + to_send.status().ToString();
    const size_t first = static_cast<size_t>(Prefix(room));
    if (*to_send != pages.size() - first) {
      return "PagesAfterPrefix " + std::to_string(*to_send) + ", expected " +
             std::to_string(pages.size() - first);
    }
    if (auto st = h.Init(*to_send, aux); !st.ok()) return "Init: " + st.ToString();
    const FlatState state = Flatten(StateLists(room));
    if (f_.layerwise_seed != 0) {
      if (std::string why = SendLayerwise(h, room, pages, first, state.view()); !why.empty()) {
        return why;
      }
    } else if (first == pages.size()) {
      // Decode holds every page: one empty last chunk moves aux and state.
      if (auto st = h.SendStates({}, true, state.view()); !st.ok()) return "Send: " + st.ToString();
    }
    if (f_.ignore_prefix) {
      // The negative control: the right number of pages, taken from the start of the request.
      std::vector<int32_t> wrong(pages.begin(), pages.end() - static_cast<std::ptrdiff_t>(first));
      if (first == pages.size())
        return WaitFor(h, pdlib::KVPoll::kSuccess, 20s) == pdlib::KVPoll::kSuccess
                   ? ""
                   : "transfer failed";
      auto st = h.SendStates(wrong, true, state.view());
      if (!st.ok()) return "Send: " + st.ToString();
      return WaitFor(h, pdlib::KVPoll::kSuccess, 20s) == pdlib::KVPoll::kSuccess
                 ? ""
                 : "transfer: " + h.FailureReason().ToString();
    }
    if (f_.layerwise_seed == 0) {
      if (std::string why = SendChunks(h, pages, first, state); !why.empty()) return why;
    }
    if (WaitFor(h, pdlib::KVPoll::kSuccess, 20s) != pdlib::KVPoll::kSuccess) {
      return "transfer: " + h.FailureReason().ToString();
    }
    return "";
  }

  // Pull: prefill publishes every page of the prompt (decode reads those after its prefix),
  // odd rooms at once (before decode's TransferInfo can have come), even ones after it.
  std::string PublishRoom(pdlib::KVSender& h, uint64_t room, std::vector<int32_t> pages,
                          uint32_t aux) {
    if (room % 2 == 0 &&
        WaitFor(h, pdlib::KVPoll::kWaitingForInput, 20s) != pdlib::KVPoll::kWaitingForInput) {
      return "waiting for TransferInfo: " + h.FailureReason().ToString();
    }
    if (static_cast<int64_t>(room) == f_.misplace_room && pages.size() >= 2) {
      std::swap(pages[0], pages[1]);  // the negative control: decode reads the wrong pages
    }
    if (auto st = h.Init(pages.size(), aux); !st.ok()) return "Init: " + st.ToString();
    const FlatState state = Flatten(StateLists(room));
    if (f_.layerwise_seed != 0) {
      if (std::string why = SendLayerwise(h, room, pages, 0, state.view()); !why.empty()) {
        return why;
      }
    } else if (std::string why = SendChunks(h, pages, 0, state); !why.empty()) {
      return why;
    }
    if (WaitFor(h, pdlib::KVPoll::kSuccess, 20s) != pdlib::KVPoll::kSuccess) {
      return "transfer: " + h.FailureReason().ToString();
    }
    // Every prefill rank, dummies included, learned decode's prefix (once decode came).
    const uint64_t want_prefix = static_cast<uint64_t>(Prefix(room)) * s_.page_size;
    const std::optional<uint64_t> prefix = h.decode_prefix_len();
    if (!prefix || *prefix != want_prefix) {
      return "decode_prefix_len() " + (prefix ? std::to_string(*prefix) : std::string("nullopt")) +
             ", decode holds " + std::to_string(want_prefix);
    }
    if (!h.PagesReusable()) return "Success but the pages are not reusable";
    return "";
  }

  std::string Receive(uint64_t room) {
    const auto all_pages = pdlib_e2e::RequestPages(s_, room, true);
    const size_t first = static_cast<size_t>(Prefix(room));
    // Decode holds pages [0, first) of the request already: it hands over the rest.
    const std::vector<int32_t> pages(all_pages.begin() + static_cast<std::ptrdiff_t>(first),
                                     all_pages.end());
    const uint32_t aux = AuxSlot(room);
    // Spoil what is about to arrive, so stale bytes from an earlier room cannot pass, and so
    // that a write anywhere else shows.
    constexpr uint8_t kSpoil = 0xA5;
    for (auto& b : kv_) std::memset(b.data(), kSpoil, b.size());
    for (auto& b : state_) std::memset(b.data(), kSpoil, b.size());
    if (std::string why = ToDevice(); !why.empty()) return why;
    aux_->bootstrap_room(aux)[0] = ~uint64_t{0};
    aux_->output_ids(aux)[0] = -1;

    auto receiver = manager_->CreateReceiver({"127.0.0.1", f_.bootstrap_port}, room);
    if (!receiver.ok()) return "CreateReceiver: " + receiver.status().ToString();
    auto& h = **receiver;
    const std::vector<std::vector<int32_t>> lists = StateLists(room);
    const FlatState state = Flatten(lists);
    if (WaitFor(h, pdlib::KVPoll::kWaitingForInput, 20s) == pdlib::KVPoll::kFailed) {
      return "bootstrap: " + h.FailureReason().ToString();
    }
    pdlib::ReceiveRequest request;
    request.kv_page_indices = pages;
    request.aux_index = aux;
    request.state = state.view();
    request.decode_prefix_len = first * s_.page_size;
    request.prompt_len = all_pages.size() * s_.page_size;
    if (auto st = h.Init(request); !st.ok()) return "Init: " + st.ToString();
    if (WaitFor(h, pdlib::KVPoll::kSuccess, 20s) != pdlib::KVPoll::kSuccess) {
      // Whether pdlib gives the pages back (within 5 s) after the failure, for the tests.
      const auto until = std::chrono::steady_clock::now() + 5s;
      while (!h.PagesReusable() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(1ms);
      }
      return "transfer: " + h.FailureReason().ToString() +
             (h.PagesReusable() ? " [pages reusable]" : " [pages held]");
    }
    if (std::string why = FromDevice(); !why.empty()) return why;
    // Every byte of every pool page, layer and K/V this rank owns: the pages handed over hold
    // the model's bytes for their positions (after the prefix), every other page (the prefix's
    // included) still holds the spoil byte.
    const uint64_t item = pdlib_e2e::KvItemBytes(s_, shape_);
    std::vector<int64_t> position(static_cast<size_t>(s_.pool_pages), -1);
    for (size_t k = 0; k < pages.size(); ++k) {
      position[static_cast<size_t>(pages[k])] = static_cast<int64_t>(first + k);
    }
    for (size_t b = 0; b < kv_.size(); ++b) {
      const int32_t layer = shape_.start_layer + static_cast<int32_t>(b % shape_.num_layers);
      const int kv = s_.mla ? 0 : static_cast<int>(b / static_cast<size_t>(shape_.num_layers));
      for (int32_t q = 0; q < s_.pool_pages; ++q) {
        const uint8_t* page = kv_[b].data() + static_cast<uint64_t>(q) * item;
        const int64_t pos = position[static_cast<size_t>(q)];
        for (uint64_t off = 0; off < item; ++off) {
          const uint8_t want =
              pos < 0 ? kSpoil : pdlib_e2e::KvByte(s_, shape_, room, layer, kv, pos, off);
          if (page[off] != want) {
            return std::string(pos < 0 ? "written-outside kv" : "bad-byte kv") +
                   " layer=" + std::to_string(layer) + " kv=" + std::to_string(kv) +
                   " pool_page=" + std::to_string(q) + " page=" + std::to_string(pos) +
                   " offset=" + std::to_string(off) + " got=" + std::to_string(page[off]) +
                   " want=" + std::to_string(want);
          }
        }
      }
    }
    const int32_t slot = pdlib_e2e::RequestStateSlot(s_, room, true);
    for (int32_t i = 0; i < shape_.num_states; ++i) {
      const int32_t g = shape_.state_start + i;
      const uint64_t sitem = pdlib_e2e::StateItemBytes(s_, shape_, g);
      const auto& buf = state_[static_cast<size_t>(i)];
      for (uint64_t off = 0; off < buf.size(); ++off) {
        const bool mine = off / sitem == static_cast<uint64_t>(slot);
        const uint8_t want = mine ? pdlib_e2e::StateByte(s_, shape_, room, g, off % sitem) : kSpoil;
        if (buf[off] != want) {
          return std::string(mine ? "bad-byte" : "written-outside") +
                 " state=" + std::to_string(g) + " offset=" + std::to_string(off);
        }
      }
    }
    for (int32_t k = 0; k < s_.extra_families; ++k) {
      const auto idx = pdlib_e2e::ExtraIndices(s_, room, k, true);
      for (int32_t l = 0; l < shape_.num_layers; ++l) {
        const auto& buf = state_[extra_base_[static_cast<size_t>(k)] + static_cast<size_t>(l)];
        for (uint64_t it = 0; it < buf.size() / pdlib_e2e::kExtraItemBytes; ++it) {
          int64_t entry = -1;
          for (size_t e = 0; e < idx.size(); ++e) {
            if (static_cast<uint64_t>(idx[e]) == it) entry = static_cast<int64_t>(e);
          }
          for (uint64_t off = 0; off < pdlib_e2e::kExtraItemBytes; ++off) {
            const uint8_t want = entry < 0 ? kSpoil
                                           : pdlib_e2e::ExtraByte(room, k, shape_.start_layer + l,
                                                                  static_cast<size_t>(entry), off);
            const uint8_t got = buf[it * pdlib_e2e::kExtraItemBytes + off];
            if (got != want) {
              return std::string(entry < 0 ? "written-outside" : "bad-byte") + " " +
                     std::string(pdlib::StateTypeName(pdlib_e2e::ExtraFamilyType(k))) +
                     " layer=" + std::to_string(shape_.start_layer + l) +
                     " item=" + std::to_string(it) + " offset=" + std::to_string(off);
            }
          }
        }
      }
    }
    if (aux_->output_ids(aux)[0] != AuxWord(room)) {
      return "bad aux output id " + std::to_string(aux_->output_ids(aux)[0]);
    }
    return "";
  }

  const Scenario s_;
  const Flags f_;
  const bool decode_;
  std::vector<std::unique_ptr<pdlib_test::DeviceBuffer>> kv_twins_, state_twins_;  // --memory cuda
  std::string twin_error_;
  RankShape shape_;
  std::vector<std::vector<uint8_t>> kv_;
  std::vector<std::vector<uint8_t>> state_;  // mamba buffers, then each extra family's
  std::vector<size_t> extra_base_;           // state_ index of extra family k's first buffer
  std::unique_ptr<pdlib::MetadataBuffers> aux_;
  std::unique_ptr<pdlib::KVManager> manager_;
};

int Usage(const std::string& why) {
  std::cerr << "pdlib_planner_peer: " << why
            << "\nusage: pdlib_planner_peer --role prefill|decode --scenario NAME "
               "--bootstrap-port P [--backend B] [--backend-option k=v]... [--first-room R] "
               "[--corrupt-room R] [--wrong-aux-room R] [--layerwise SEED] [--memory host|cuda] "
               "[--decode-prefix 1] [--direction push|pull] [--misplace-room R]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (i + 1 >= argc) return Usage("missing value for " + arg);
    std::string v = argv[++i];
    if (arg == "--role") {
      f.role = v;
    } else if (arg == "--scenario") {
      f.scenario = v;
    } else if (arg == "--backend") {
      f.backend = v;
    } else if (arg == "--backend-option") {
      size_t eq = v.find('=');
      if (eq == std::string::npos) return Usage("--backend-option wants key=value");
      f.backend_options[v.substr(0, eq)] = v.substr(eq + 1);
    } else if (arg == "--bootstrap-port") {
      f.bootstrap_port = static_cast<uint16_t>(std::stoi(v));
    } else if (arg == "--corrupt-room") {
      f.corrupt_room = std::stoll(v);
    } else if (arg == "--wrong-aux-room") {
      f.wrong_aux_room = std::stoll(v);
    } else if (arg == "--layerwise") {
      f.layerwise_seed = std::stoull(v);
    } else if (arg == "--memory") {
      if (v != "host" && v != "cuda") return Usage("--memory host|cuda, not '" + v + "'");
      f.cuda = v == "cuda";
    } else if (arg == "--decode-prefix") {
      f.decode_prefix = v == "1";
    } else if (arg == "--ignore-prefix") {
      f.ignore_prefix = v == "1";
    } else if (arg == "--direction") {
      if (v != "push" && v != "pull") return Usage("--direction push|pull, not '" + v + "'");
      f.pull = v == "pull";
    } else if (arg == "--misplace-room") {
      f.misplace_room = std::stoll(v);
    } else if (arg == "--first-room") {
      f.first_room = std::stoull(v);
    } else {
      return Usage("unknown flag " + arg);
    }
  }
  if (f.role != "prefill" && f.role != "decode") return Usage("--role prefill|decode");
  if (f.bootstrap_port == 0) return Usage("--bootstrap-port is required");
  auto scenario = pdlib_e2e::FindScenario(f.scenario);
  if (!scenario) return Usage("unknown scenario '" + f.scenario + "'");
  const bool decode = f.role == "decode";
  const pdlib_e2e::SideShape side = decode ? scenario->decode : scenario->prefill;

  // The rank that runs the bootstrap server starts first.
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int32_t pp = 0; pp < side.pp; ++pp) {
    for (int32_t tp = 0; tp < side.tp; ++tp) {
      ranks.push_back(std::make_unique<Rank>(*scenario, f, decode, tp, pp));
      if (auto s = ranks.back()->Start(); !s.ok()) {
        Emit("ERROR starting rank tp " + std::to_string(tp) + " pp " + std::to_string(pp) + ": " +
             s.ToString());
        return 1;
      }
    }
  }
  Emit("READY role=" + f.role + " ranks=" + std::to_string(ranks.size()));
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (auto& r : ranks) threads.emplace_back([&, rank = r.get()] { ok += rank->Run(); });
  for (auto& t : threads) t.join();
  const int total = scenario->rooms * static_cast<int>(ranks.size());
  Emit("DONE ok=" + std::to_string(ok.load()) + " failed=" + std::to_string(total - ok.load()));
  // Keep every connection up until the test says so: prefill ranks that write nothing (dummies)
  // finish after decode already has every byte.
  std::string line;
  while (std::getline(std::cin, line) && line != "QUIT") {
  }
  for (auto& r : ranks) r->Stop();
  return ok.load() == total ? 0 : 1;
}
