// libFuzzer target for the prefill side of the control plane: hostile decode messages through
// the same path the gRPC server uses (wire bytes -> control::FromProto -> PrefillCore::On*),
// interleaved with the engine's calls (CreateRoom, InitRoom, Send, AbortRoom, ReleaseRoom) on a
// real PrefillCore whose transport (checked_transport.h) traps on any write outside the
// registered regions.
//
// Raw protobuf bytes rarely get past the parser into an interesting state, so the input is read
// as a script, one byte per decision (fuzz_script.h): first a deployment (a planner
// reference-model config: TP/PP sizes on both sides, MLA, layout, heads, state tensors, pool
// sizes), then up to 96 ops. A Register op builds the honest Register a decode rank of that
// deployment would send (the same fields DecodeCore fills), then applies up to four hostile edits
// to the protobuf (ranks, sizes, fingerprint, region lengths and item sizes, added or dropped
// regions, enum values out of range, state shapes). TransferInfos are honest (what decode's planner
// would send) with each field replaced by a hostile value now and then. A few ops are raw frame
// bytes.
//
// Properties: no write outside what both sides registered (the transport traps), no sanitizer
// report, every room whose last chunk was accepted ends (Success or Failed) within 10 s, and
// once every decode stream has ended and every sender is released, the core holds no live room
// and no early TransferInfo.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "fuzz/checked_transport.h"
#include "fuzz/fuzz_script.h"
#include "lib/control/peer_convert.h"
#include "lib/core/prefill_core.h"
#include "lib/core/transfer_layout.h"
#include "lib/proto/pdlib.pb.h"
#include "pdlib/log.h"
#include "pdlib/spi/transport.h"
#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace fuzzing {
namespace {

using planner::SideLayout;
using planner::testing::ModelConfig;

constexpr int kStreams = 3;
constexpr int kMaxOps = 96;
constexpr uint64_t kMaxRoom = 5;

bool g_trace = false;  // CONTROL_FUZZ_LOG: print every op

std::atomic<uint64_t> g_rooms_succeeded{0}, g_rooms_failed{0}, g_registers_accepted{0};

[[noreturn]] void PropertyViolated(const std::string& what) {
  std::fprintf(stderr, "control_fuzz: property violated: %s\n", what.c_str());
  __builtin_trap();
}

// A deployment the planner accepts when nobody lies (powers of two everywhere).
ModelConfig PickConfig(Script& f) {
  ModelConfig c;
  c.mla = f.ConsumeIntegralInRange(0, 3) == 3;
  c.prefill_tp = Pick(f, {1, 2, 4});
  c.decode_tp = Pick(f, {1, 2, 4});
  c.prefill_pp = f.ConsumeIntegralInRange(1, 2);
  c.decode_pp = f.ConsumeBool() ? 1 : c.prefill_pp;
  c.kv_heads = Pick(f, {1, 2, 4, 8});
  c.head_bytes = f.ConsumeIntegralInRange<uint32_t>(1, 4);
  c.mla_bytes = f.ConsumeIntegralInRange<uint32_t>(1, 5);
  c.page_size = Pick<uint32_t>(f, {1, 2, 4, 16});
  c.layout = f.ConsumeBool() ? KVLayout::kHND : KVLayout::kNHD;
  c.stage_layers.clear();
  for (int32_t s = 0; s < c.prefill_pp; ++s)
    c.stage_layers.push_back(f.ConsumeIntegralInRange(1, 2));
  c.aux_item_bytes.clear();
  for (int n = f.ConsumeIntegralInRange(0, 3); n > 0; --n) {
    c.aux_item_bytes.push_back(f.ConsumeIntegralInRange<uint32_t>(1, 16));
  }
  c.kv_pool_pages = f.ConsumeIntegralInRange(1, 8);
  c.state_pool = f.ConsumeIntegralInRange(1, 8);
  c.aux_slots = f.ConsumeIntegralInRange(1, 4);
  planner::testing::AddStateTensors(&c, static_cast<StateType>(f.ConsumeIntegralInRange(0, 3)));
  return c;
}

// The KVArgs an engine rank of `c` would pass (addresses are never dereferenced: the checked
// transport moves nothing).
KVArgs ArgsFor(const ModelConfig& c, const SideLayout& l, bool opaque) {
  KVArgs a;
  uint64_t next = uint64_t{1} << 32;
  auto add = [&](BufferFamily* f, uint64_t item, uint64_t len) {
    f->ptrs.push_back(next);
    f->lens.push_back(len);
    f->item_lens.push_back(item);
    next += (len | 0xFFFF) + 1;
  };
  for (const auto& b : l.kv) add(&a.kv, b.item_bytes, b.buffer_bytes);
  for (const auto& b : l.aux) add(&a.aux, b.item_bytes, b.buffer_bytes);
  for (const auto& s : l.state) {
    add(&a.state, s.item_bytes, s.buffer_bytes);
    a.state_dim_per_tensor.push_back(s.split_dim);
    a.state_item_rows.push_back(s.rows);
    a.state_split_units.push_back(s.split_units);
  }
  a.state_type = l.state.empty() ? StateType::kNone : l.state_type;
  a.state_start = l.state_start;
  a.page_size = l.page_size;
  a.kv_head_num = opaque ? 0 : l.kv_heads;
  a.kv_layout = l.layout;
  a.is_mla = l.is_mla;
  a.parallel = {l.tp_size, l.tp_rank, 1, 0, l.pp_size, l.pp_rank};
  a.prefill_start_layer = l.start_layer;
  a.fingerprint = {c.total_layers(), c.kv_heads, static_cast<int32_t>(c.head_bytes), 1, 1,
                   "fuzz-model"};
  return a;
}

// Records what prefill tells one decode stream; flood-proof (counts only).
class CountingLink final : public DecodeLink {
 public:
  void SendStatus(const TransferStatusMsg& msg) override {
    (msg.status.ok() ? ok_ : failed_).fetch_add(1, std::memory_order_relaxed);
  }
  void SendDrained(const RoomsDrainedMsg& msg) override {
    drained_.fetch_add(msg.rooms.size(), std::memory_order_relaxed);
  }
  void Close(const Status& reason) override {
    (void)reason;
    closed_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> ok_{0}, failed_{0}, drained_{0}, closed_{0};
};

// One decode rank of the deployment, as the stream it opens to prefill.
struct Stream {
  int32_t tp_rank = 0, pp_rank = 0;
  KVArgs args;           // that decode rank's own KVArgs
  PrefillTarget target;  // what it honestly sends this prefill rank
  bool talks = false;    // it sends this prefill rank TransferInfos at all
  uint64_t session = 0;  // registered session
  bool open = false;     // the stream exists (may still be unregistered)
  bool registered = false;
  std::shared_ptr<CountingLink> link;
};

struct EngineRoom {
  std::shared_ptr<RoomState> state;
  int32_t pages_sent = 0;
  bool last_queued = false;
};

// What the last TransferInfo for a room asked for, so that the engine's Send ops match it
// (most of the time) and transfers get as far as writing.
struct RequestShape {
  int32_t pages = 0;
  int32_t states = 0;
};

class Harness {
 public:
  explicit Harness(Script& f) : f_(f) {}
  ~Harness() {
    if (core_) core_->Shutdown();
  }

  bool Setup();
  void Run();

 private:
  void DoRegister(Stream& s);
  void DoTransferInfo(Stream& s);
  void DoRawFrame(Stream& s);
  void Send(Stream& s, const wire::v1::DecodeToPrefill& msg);
  void Dispatch(Stream& s, const wire::v1::DecodeToPrefill& msg);
  void EndStream(Stream& s, const Status& why);
  void EngineOp();
  void Settle();
  void Finish();
  std::vector<int32_t> Indices(int32_t pool, int32_t count);
  int32_t MaybeHostileIndex(int32_t honest, int32_t pool);

  Script& f_;
  ModelConfig c_;
  bool opaque_ = false;
  SideLayout prefill_;
  std::shared_ptr<PrefillCore> core_;
  Stream streams_[kStreams];
  std::map<uint64_t, EngineRoom> rooms_;
  std::map<uint64_t, RequestShape> shapes_;
};

bool Harness::Setup() {
  c_ = PickConfig(f_);
  opaque_ = !c_.mla && c_.prefill_tp == c_.decode_tp && c_.prefill_pp == 1 && f_.ConsumeBool();
  const int32_t tp = f_.ConsumeIntegralInRange(0, c_.prefill_tp - 1);
  const int32_t pp = f_.ConsumeIntegralInRange(0, c_.prefill_pp - 1);
  prefill_ = planner::testing::MakeLayout(c_, true, tp, pp);
  KVManagerOptions o;
  o.mode = Mode::kPrefill;
  o.backend = kCheckedTransportName;
  o.args = ArgsFor(c_, prefill_, opaque_);
  o.transfer_workers = f_.ConsumeIntegralInRange(1, 2);
  o.failure_injection_prob = 0;
  if (Hostile(f_)) o.backend_options[kFailEveryOtherOption] = "1";
  auto transport = spi::CreateTransport(o.backend, {0, {}, o.backend_options, o.mode});
  if (!transport.ok()) PropertyViolated(transport.status().ToString());
  auto core = PrefillCore::Create(o, std::move(*transport));
  if (!core.ok()) return false;  // a config the planner refuses on its own: uninteresting
  core_ = std::move(*core);
  for (int i = 0; i < kStreams; ++i) {
    Stream& s = streams_[i];
    s.tp_rank = f_.ConsumeIntegralInRange(0, c_.decode_tp - 1);
    s.pp_rank = f_.ConsumeIntegralInRange(0, c_.decode_pp - 1);
    s.args = ArgsFor(c_, planner::testing::MakeLayout(c_, false, s.tp_rank, s.pp_rank), opaque_);
    auto layout = PlannerLayout(s.args, "decode");
    if (!layout.ok()) continue;
    auto targets =
        PrefillTargetsFor(*layout, s.args.kv_head_num, s.args.is_mla, c_.prefill_tp, c_.prefill_pp);
    if (!targets.ok()) continue;
    for (const PrefillTarget& t : *targets) {
      if (t.rank == planner::RankId{tp, pp}) {
        s.target = t;
        s.talks = true;
      }
    }
  }
  return true;
}

int32_t Harness::MaybeHostileIndex(int32_t honest, int32_t pool) {
  if (!Hostile(f_)) return honest;
  return Pick(f_, {pool, pool + 1, -1, INT32_MIN, INT32_MAX, 0, honest});
}

// `count` distinct indices in [0, pool) (as many as fit), each hostile now and then.
std::vector<int32_t> Harness::Indices(int32_t pool, int32_t count) {
  std::vector<int32_t> all(static_cast<size_t>(std::max(pool, 0)));
  std::iota(all.begin(), all.end(), 0);
  std::vector<int32_t> out;
  for (int32_t i = 0; i < count && i < pool; ++i) {
    std::swap(all[i], all[f_.ConsumeIntegralInRange(i, pool - 1)]);
    out.push_back(MaybeHostileIndex(all[i], pool));
  }
  if (Hostile(f_, 16) && !out.empty()) out.push_back(out.front());  // a repeated index
  return out;
}

void Harness::DoRegister(Stream& s) {
  if (s.open) EndStream(s, Status::Unavailable("stream replaced"));
  s.open = true;
  s.link = std::make_shared<CountingLink>();
  // What DecodeCore::EnsureConnected sends, built from that rank's KVArgs.
  RegisterMsg m;
  m.session = f_.ConsumeIntegralInRange<uint64_t>(1, 3);
  m.fingerprint = s.args.fingerprint;
  m.page_size = s.args.page_size;
  m.parallel = s.args.parallel;
  m.transport = kCheckedTransportName;
  m.endpoint = {1, 2};
  for (auto [family, out] : {std::pair{&s.args.kv, &m.kv}, std::pair{&s.args.aux, &m.aux},
                             std::pair{&s.args.state, &m.state}}) {
    for (size_t i = 0; i < family->size(); ++i) {
      out->push_back({family->ptrs[i], family->lens[i], family->item_lens[i], {9}});
    }
  }
  auto layout = PlannerLayout(s.args, "decode");
  if (!layout.ok()) return;  // the harness builds valid layouts; nothing to register otherwise
  FillRegisterLayout(s.args, *layout, &m);
  wire::v1::DecodeToPrefill msg;
  wire::v1::Register* r = msg.mutable_register_info();
  control::ToProto(m, r);
  for (int n = f_.ConsumeIntegralInRange(0, 4); n > 0; --n) {
    auto region = [&](google::protobuf::RepeatedPtrField<wire::v1::RegionDesc>* rs) {
      if (rs->empty()) return static_cast<wire::v1::RegionDesc*>(nullptr);
      return rs->Mutable(f_.ConsumeIntegralInRange(0, rs->size() - 1));
    };
    auto family = [&]() {
      switch (f_.ConsumeIntegralInRange(0, 2)) {
        case 0: return r->mutable_kv_regions();
        case 1: return r->mutable_aux_regions();
        default: return r->mutable_state_regions();
      }
    };
    wire::v1::RankInfo* rank = r->mutable_decode_rank();
    wire::v1::ModelFingerprint* fp = r->mutable_fingerprint();
    switch (f_.ConsumeIntegralInRange(0, 24)) {
      case 0: rank->set_tp_rank(HostileInt(f_, rank->tp_rank())); break;
      case 1: rank->set_tp_size(HostileInt(f_, rank->tp_size())); break;
      case 2: rank->set_pp_rank(HostileInt(f_, rank->pp_rank())); break;
      case 3: rank->set_pp_size(HostileInt(f_, rank->pp_size())); break;
      case 4: fp->set_num_layers(HostileInt(f_, fp->num_layers())); break;
      case 5: fp->set_num_kv_heads(HostileInt(f_, fp->num_kv_heads())); break;
      case 6: r->set_page_size(static_cast<uint32_t>(HostileU64(f_, r->page_size()))); break;
      case 7: r->set_transport(f_.ConsumeBool() ? "fake" : ""); break;
      case 8:
        r->set_transport_endpoint(std::string(1, static_cast<char>(kRefusedBlobMarker)));
        break;
      case 9:
        if (auto* d = region(family())) d->set_length(HostileU64(f_, d->length()));
        break;
      case 10:
        if (auto* d = region(family())) d->set_item_len(HostileU64(f_, d->item_len()));
        break;
      case 11:
        if (auto* d = region(family())) d->set_addr(HostileU64(f_, d->addr()));
        break;
      case 12:
        if (auto* d = region(family())) d->set_key(std::string(1, char(kRefusedBlobMarker)));
        break;
      case 13: {  // one region more (a copy of the first, or an empty one)
        auto* rs = family();
        auto* d = rs->Add();
        if (rs->size() > 1) *d = rs->Get(0);
        break;
      }
      case 14: {
        auto* rs = family();
        if (!rs->empty()) rs->RemoveLast();
        break;
      }
      case 15: r->set_state_type(static_cast<wire::v1::StateType>(HostileInt(f_, 1))); break;
      case 16: r->set_kv_head_num(HostileInt(f_, r->kv_head_num())); break;
      case 17: r->set_kv_layout(static_cast<wire::v1::KVLayout>(HostileInt(f_, 1))); break;
      case 18: r->set_is_mla(!r->is_mla()); break;
      case 19: r->set_start_layer(HostileInt(f_, r->start_layer())); break;
      case 20: {
        // Wire version 3's state families: a kind, a start and a count that may lie.
        auto* fam = r->mutable_state_families()->Add();
        fam->set_type(static_cast<wire::v1::StateType>(HostileInt(f_, 2)));
        fam->set_start(HostileInt(f_, 0));
        fam->set_count(HostileInt(f_, 1));
        if (f_.ConsumeBool()) r->set_state_start(HostileInt(f_, r->state_start()));
        break;
      }
      case 21: {
        auto* v = r->mutable_state_dim_per_tensor();
        if (v->empty() || f_.ConsumeBool()) {
          v->Add(HostileInt(f_, 0));
        } else {
          v->Set(f_.ConsumeIntegralInRange(0, v->size() - 1), HostileInt(f_, 0));
        }
        break;
      }
      case 22: {
        auto* v = r->mutable_state_item_rows();
        if (v->empty() || f_.ConsumeBool()) {
          v->Add(HostileU64(f_, 1));
        } else {
          v->Set(f_.ConsumeIntegralInRange(0, v->size() - 1), HostileU64(f_, 1));
        }
        break;
      }
      case 23: {
        auto* v = r->mutable_state_split_units();
        if (v->empty() || f_.ConsumeBool()) {
          v->Add(HostileU64(f_, 4));
        } else {
          v->Set(f_.ConsumeIntegralInRange(0, v->size() - 1), HostileU64(f_, 4));
        }
        break;
      }
      default: fp->set_head_dim(HostileInt(f_, fp->head_dim())); break;
    }
  }
  Send(s, msg);
}

void Harness::DoTransferInfo(Stream& s) {
  wire::v1::DecodeToPrefill msg;
  wire::v1::TransferInfo* t = msg.mutable_transfer_info();
  t->set_room(Hostile(f_, 32) ? f_.ConsumeIntegral<uint64_t>()
                              : f_.ConsumeIntegralInRange<uint64_t>(1, kMaxRoom));
  const bool dummy = s.talks && s.target.dummy;
  if (!dummy) {
    const int32_t pool = c_.kv_pool_pages;
    for (int32_t p : Indices(pool, f_.ConsumeIntegralInRange(0, pool))) t->add_dst_kv_pages(p);
    if (!c_.aux_item_bytes.empty() && f_.ConsumeBool()) {
      t->set_aux_index(
          MaybeHostileIndex(f_.ConsumeIntegralInRange(0, c_.aux_slots - 1), c_.aux_slots));
    }
    // One count per decode state family (wire version 3), every real TransferInfo of a model
    // with state; hostile runs drop or add one.
    if (!s.args.state.empty()) {
      const int32_t n = !f_.ConsumeBool()                    ? 0
                        : c_.state_type == StateType::kMamba ? 1
                                                             : t->dst_kv_pages_size();
      for (int32_t i : Indices(c_.state_pool, n)) t->add_dst_state_indices(i);
      t->add_dst_state_counts(static_cast<uint32_t>(t->dst_state_indices_size()));
      if (Hostile(f_)) t->add_dst_state_counts(static_cast<uint32_t>(HostileInt(f_, 1)));
    }
    if (Hostile(f_, 32)) t->set_decode_prefix_len(static_cast<uint64_t>(HostileInt(f_, 0)));
  }
  t->set_required_dst_info_num(s.talks ? s.target.required_dst_info_num : 1);
  t->set_is_dummy(dummy);
  if (Hostile(f_)) {
    t->set_required_dst_info_num(Pick<uint32_t>(f_, {0, 1, 2, 3, 4, 5, UINT32_MAX}));
  }
  if (Hostile(f_)) t->set_is_dummy(!t->is_dummy());
  if (Hostile(f_, 32)) t->set_decode_tp_rank(HostileInt(f_, s.tp_rank));
  if (!t->is_dummy()) shapes_[t->room()] = {t->dst_kv_pages_size(), t->dst_state_indices_size()};
  Send(s, msg);
}

void Harness::DoRawFrame(Stream& s) {
  wire::v1::DecodeToPrefillFrame frame;
  const std::string bytes = f_.ConsumeBytesAsString(f_.ConsumeIntegralInRange(0, 96));
  if (!frame.ParseFromString(bytes)) return;
  for (const auto& msg : frame.msgs()) {
    Dispatch(s, msg);
    if (!s.open) return;
  }
}

// Through the wire format, as the gRPC stream carries it.
void Harness::Send(Stream& s, const wire::v1::DecodeToPrefill& msg) {
  wire::v1::DecodeToPrefillFrame frame;
  *frame.add_msgs() = msg;
  std::string bytes;
  if (!frame.SerializeToString(&bytes)) PropertyViolated("serializing a frame failed");
  wire::v1::DecodeToPrefillFrame parsed;
  // A string field that is not UTF-8 (an Abort reason) serializes but does not parse: gRPC
  // then fails the read and the stream ends, as here.
  if (!parsed.ParseFromString(bytes)) return EndStream(s, Status::Internal("frame does not parse"));
  for (const auto& m : parsed.msgs()) Dispatch(s, m);
}

// What PeerStream::Dispatch does with one message (lib/control/peer_server.cc).
void Harness::Dispatch(Stream& s, const wire::v1::DecodeToPrefill& msg) {
  if (!s.open) return;
  switch (msg.msg_case()) {
    case wire::v1::DecodeToPrefill::kRegisterInfo: {
      if (s.registered) return EndStream(s, Status::FailedPrecondition("Register sent twice"));
      auto reg = control::FromProto(msg.register_info());
      if (!reg.ok()) return EndStream(s, reg.status());
      RegisterAckMsg ack = core_->OnRegister(*reg, s.link);
      if (!ack.status.ok()) return EndStream(s, ack.status);
      g_registers_accepted.fetch_add(1, std::memory_order_relaxed);
      s.registered = true;
      s.session = reg->session;
      return;
    }
    case wire::v1::DecodeToPrefill::kTransferInfo: {
      if (!s.registered) return EndStream(s, Status::FailedPrecondition("TransferInfo first"));
      auto info = control::FromProto(msg.transfer_info(), s.session);
      if (!info.ok()) return s.link->SendStatus({msg.transfer_info().room(), 0, 0, info.status()});
      return core_->OnTransferInfo(*info);
    }
    case wire::v1::DecodeToPrefill::kAbort:
      if (!s.registered) return EndStream(s, Status::FailedPrecondition("Abort first"));
      return core_->OnAbort(msg.abort().room(), s.session, msg.abort().reason().substr(0, 4096));
    case wire::v1::DecodeToPrefill::kPullConnect:
      if (!s.registered) return EndStream(s, Status::FailedPrecondition("PullConnect first"));
      return core_->OnPullConnect(control::FromProto(msg.pull_connect(), s.session));
    case wire::v1::DecodeToPrefill::kReadsDone:
      if (!s.registered) return EndStream(s, Status::FailedPrecondition("ReadsDone first"));
      return core_->OnReadsDone(control::FromProto(msg.reads_done(), s.session));
    case wire::v1::DecodeToPrefill::kHeartbeat: {
      if (!s.registered) return EndStream(s, Status::FailedPrecondition("Heartbeat first"));
      auto beat = control::FromProto(msg.heartbeat(), s.session);
      if (beat.ok()) core_->OnHeartbeat(*beat);
      return;
    }
    default: return EndStream(s, Status::InvalidArgument("empty or unknown message"));
  }
}

void Harness::EndStream(Stream& s, const Status& why) {
  if (s.registered) core_->OnDecodeGone(s.session, s.link.get(), why);
  s.registered = false;
  s.open = false;
}

void Harness::EngineOp() {
  const uint64_t id = f_.ConsumeIntegralInRange<uint64_t>(1, kMaxRoom);
  auto it = rooms_.find(id);
  switch (f_.ConsumeIntegralInRange(0, 4)) {
    case 0: {
      if (it != rooms_.end()) return;
      auto state = core_->CreateRoom(id);
      if (state.ok()) rooms_[id] = {*state, 0, false};
      return;
    }
    case 1: {
      std::optional<uint32_t> aux;
      if (!c_.aux_item_bytes.empty() && f_.ConsumeBool()) {
        aux = static_cast<uint32_t>(f_.ConsumeIntegralInRange(0, c_.aux_slots));
      }
      (void)core_->InitRoom(id, f_.ConsumeIntegralInRange<uint64_t>(0, c_.kv_pool_pages + 1), aux);
      return;
    }
    case 2: {
      // Honest: the next chunk of what decode asked for, the last one carrying the state
      // indices; hostile now and then: any count, any flag.
      const int32_t pool = c_.kv_pool_pages;
      const RequestShape shape = shapes_[id];
      const int32_t remaining = shape.pages - (it != rooms_.end() ? it->second.pages_sent : 0);
      int32_t count = 0;
      bool last = false;
      if (remaining >= 0 && !Hostile(f_)) {
        count = f_.ConsumeIntegralInRange(0, remaining);
        last = count == remaining;
      } else {
        count = f_.ConsumeIntegralInRange(0, pool);
        last = f_.ConsumeBool();
      }
      std::vector<int32_t> pages = Indices(pool, count);
      std::vector<int32_t> state;
      if (last && !prefill_.state.empty() && (shape.states > 0 || Hostile(f_))) {
        state =
            Indices(c_.state_pool, Hostile(f_) ? f_.ConsumeIntegralInRange(0, 3) : shape.states);
      }
      // Layer-wise now and then (issue #17): some layers first, any count when hostile; the
      // chunk counts once its every layer is announced (what Send() does).
      const int32_t layers = core_->num_layers();
      if (f_.ConsumeBool()) {
        const int32_t some = Hostile(f_) ? f_.ConsumeIntegralInRange(-1, layers + 1)
                                         : f_.ConsumeIntegralInRange(0, layers);
        if (some != layers) (void)core_->SendLayers(id, pages, some, last, {state, {}});
      }
      if (core_->SendLayers(id, pages, layers, last, {state, {}}).ok() && it != rooms_.end()) {
        it->second.pages_sent += static_cast<int32_t>(pages.size());
        it->second.last_queued |= last;
      }
      return;
    }
    case 3: core_->AbortRoom(id, "engine abort"); return;
    default:
      if (it == rooms_.end()) return;
      core_->ReleaseRoom(id, it->second.state.get());
      rooms_.erase(it);
      return;
  }
}

// Every room whose last chunk was accepted must end: its writes were planned or refused.
void Harness::Settle() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (auto& [id, room] : rooms_) {
    if (!room.last_queued) continue;
    while (!IsTerminal(room.state->Poll())) {
      if (std::chrono::steady_clock::now() > deadline) {
        PropertyViolated("room " + std::to_string(id) + " stuck in state " +
                         std::string(KVPollName(room.state->Poll())) +
                         " 10 s after its last chunk was accepted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void Harness::Finish() {
  Settle();
  for (Stream& s : streams_) EndStream(s, Status::Unavailable("decode went away"));
  for (auto& [id, room] : rooms_) {
    (room.state->Poll() == KVPoll::kSuccess ? g_rooms_succeeded : g_rooms_failed)
        .fetch_add(IsTerminal(room.state->Poll()) ? 1 : 0, std::memory_order_relaxed);
    core_->ReleaseRoom(id, room.state.get());
  }
  rooms_.clear();
  KVManagerMetrics m = core_->metrics();
  if (m.live_rooms != 0 || m.bootstrap_queue_size != 0 || m.connections != 0) {
    PropertyViolated("after every stream ended and every sender was released: live_rooms " +
                     std::to_string(m.live_rooms) + ", bootstrap_queue_size " +
                     std::to_string(m.bootstrap_queue_size) + ", connections " +
                     std::to_string(m.connections));
  }
}

void Harness::Run() {
  for (int op = 0; op < kMaxOps && f_.remaining_bytes() > 0; ++op) {
    const int stream = f_.ConsumeIntegralInRange(0, kStreams - 1);
    const int kind = f_.ConsumeIntegralInRange(0, 15);
    if (g_trace) std::fprintf(stderr, "control_fuzz: op %d kind %d stream %d\n", op, kind, stream);
    Stream& s = streams_[stream];
    switch (kind) {
      case 0:
      case 1: DoRegister(s); break;
      case 2:
      case 3:
      case 4:
      case 5: DoTransferInfo(s); break;
      case 6: {
        wire::v1::DecodeToPrefill msg;
        msg.mutable_abort()->set_room(f_.ConsumeIntegralInRange<uint64_t>(1, kMaxRoom));
        msg.mutable_abort()->set_reason(f_.ConsumeBytesAsString(f_.ConsumeIntegralInRange(0, 16)));
        Send(s, msg);
        break;
      }
      case 7: EndStream(s, Status::Unavailable("stream broke")); break;
      case 8: DoRawFrame(s); break;
      case 9: Settle(); break;
      default: EngineOp(); break;
    }
  }
  Finish();
}

void PrintStats() {
  const CheckedTransportStats& t = GlobalCheckedTransportStats();
  std::fprintf(stderr,
               "control_fuzz: %llu Registers accepted, %llu rooms succeeded, %llu failed; %llu "
               "batches, %llu writes, %llu bytes planned\n",
               static_cast<unsigned long long>(g_registers_accepted.load()),
               static_cast<unsigned long long>(g_rooms_succeeded.load()),
               static_cast<unsigned long long>(g_rooms_failed.load()),
               static_cast<unsigned long long>(t.batches.load()),
               static_cast<unsigned long long>(t.writes.load()),
               static_cast<unsigned long long>(t.bytes.load()));
}

}  // namespace
}  // namespace fuzzing
}  // namespace v1
}  // namespace pdlib

// The fuzz project builds the registry without built-in backends: only the checked transport.
namespace pdlib {
inline namespace v1 {
namespace internal {
void RegisterBuiltinBackends() {}
std::vector<std::string> BuiltinBackendNames() { return {}; }
}  // namespace internal
}  // namespace v1
}  // namespace pdlib

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace pdlib;
  // CONTROL_FUZZ_LOG=1: the core's log lines (to see why a run's rooms failed).
  fuzzing::g_trace = std::getenv("CONTROL_FUZZ_LOG") != nullptr;
  SetLogLevel(fuzzing::g_trace ? LogLevel::kDebug : LogLevel::kOff);
  // Hostile Abort reasons that are not UTF-8 make protobuf log every parse failure.
  if (!fuzzing::g_trace) google::protobuf::SetLogHandler(nullptr);
  if (Status s = fuzzing::RegisterCheckedTransport(); !s.ok()) {
    std::fprintf(stderr, "control_fuzz: %s\n", s.ToString().c_str());
    std::abort();
  }
  std::atexit(fuzzing::PrintStats);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pdlib::fuzzing::Script f(data, size);
  pdlib::fuzzing::Harness h(f);
  if (h.Setup()) h.Run();
  return 0;
}
