// A decode rank that lies, against a real prefill KVManager (issue #9): a raw client built on
// the generated Peer stub sends Registers with wrong shapes, TransferInfos with indices out of
// range, protocol violations and floods of rooms nobody created. Each lie must be refused with
// a reason naming the bad value, leave nothing behind (metrics) and leave the manager able to
// serve an honest decode. hostile_prefill_test.cc is the mirror image.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "lib/proto/pdlib.grpc.pb.h"
#include "pdlib/pdlib.h"
#include "pdlib/spi/transport.h"
#include "test/control/hostile_peer_util.h"

using namespace pdlib_hostile;
namespace wire = pdlib::wire::v1;

namespace {

// ---------------------------------------------------------------------------------------------
// A decode rank that speaks the wire protocol directly.

class RawDecode {
 public:
  explicit RawDecode(const std::string& endpoint)
      : stub_(wire::Peer::NewStub(
            grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials()))) {
    ctx_.set_deadline(std::chrono::system_clock::now() + 60s);
    stream_ = stub_->Connect(&ctx_);
  }
  ~RawDecode() { Close(); }

  bool Write(const wire::DecodeToPrefill& msg) {
    wire::DecodeToPrefillFrame frame;
    *frame.add_msgs() = msg;
    return stream_->Write(frame);
  }
  bool WriteFrame(const wire::DecodeToPrefillFrame& frame) { return stream_->Write(frame); }

  // The next message from prefill other than Drained (those are collected in drained());
  // nullopt once the stream has ended.
  std::optional<wire::PrefillToDecode> Next() {
    while (true) {
      while (pending_.empty()) {
        wire::PrefillToDecodeFrame frame;
        if (!stream_->Read(&frame)) return std::nullopt;
        for (auto& m : *frame.mutable_msgs()) pending_.push_back(std::move(m));
      }
      auto m = std::move(pending_.front());
      pending_.pop_front();
      if (!m.has_drained()) return m;
      for (uint64_t room : m.drained().rooms()) drained_.push_back(room);
    }
  }
  // Rooms prefill reported drained so far (as Next() passed them).
  const std::vector<uint64_t>& drained() const { return drained_; }
  // Reads until prefill reports `room` drained (other messages stay queued for Next()); false
  // if the stream ends first.
  bool WaitDrained(uint64_t room) {
    auto seen = [&] { return std::find(drained_.begin(), drained_.end(), room) != drained_.end(); };
    for (size_t scanned = 0;;) {
      for (; scanned < pending_.size(); ++scanned) {
        if (!pending_[scanned].has_drained()) continue;
        for (uint64_t r : pending_[scanned].drained().rooms()) drained_.push_back(r);
      }
      if (seen()) return true;
      wire::PrefillToDecodeFrame frame;
      if (!stream_->Read(&frame)) return false;
      for (auto& m : *frame.mutable_msgs()) pending_.push_back(std::move(m));
    }
  }

  // Reads to the end of the stream; the status prefill finished it with.
  grpc::Status Finish() {
    if (finished_) return status_;
    while (Next()) {
    }
    finished_ = true;
    status_ = stream_->Finish();
    return status_;
  }

  void Close() {
    if (finished_) return;
    ctx_.TryCancel();
    Finish();
  }

 private:
  std::unique_ptr<wire::Peer::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<wire::DecodeToPrefillFrame, wire::PrefillToDecodeFrame>>
      stream_;
  std::deque<wire::PrefillToDecode> pending_;
  std::vector<uint64_t> drained_;
  bool finished_ = false;
  grpc::Status status_;
};

// What an honest decode rank of Options() would send in its Register, with real fake-backend
// endpoint and keys so that prefill can connect.
struct DecodeIdentity {
  Buffers buf;
  std::unique_ptr<pdlib::spi::Transport> fake = std::move(*pdlib::spi::CreateTransport("fake", {}));

  wire::DecodeToPrefill Register(uint64_t session) {
    wire::DecodeToPrefill msg;
    wire::Register* r = msg.mutable_register_info();
    r->mutable_decode_rank()->set_tp_size(1);
    r->mutable_decode_rank()->set_dp_size(1);
    r->mutable_decode_rank()->set_pp_size(1);
    r->set_session_id(session);
    auto* fp = r->mutable_fingerprint();
    fp->set_num_layers(kFingerprint.num_layers);
    fp->set_num_kv_heads(kFingerprint.num_kv_heads);
    fp->set_head_dim(kFingerprint.head_dim);
    fp->set_dtype_bytes(kFingerprint.dtype_bytes);
    fp->set_layout_version(kFingerprint.layout_version);
    fp->set_model_name(kFingerprint.model_name);
    fp->set_wire_version(PDLIB_WIRE_VERSION);  // a Register without it is an older pdlib
    r->set_page_size(16);
    r->set_transport("fake");
    auto endpoint = fake->CreateTargetEndpoint();
    REQUIRE(endpoint.ok());
    r->set_transport_endpoint(endpoint->blob.data(), endpoint->blob.size());
    auto add = [&](wire::RegionDesc* d, const std::vector<uint8_t>& b, uint64_t item) {
      pdlib::spi::Blob key;
      REQUIRE(fake->RegisterMemory({b.data(), b.size()}, &key).ok());
      d->set_addr(Buffers::Addr(b));
      d->set_length(b.size());
      d->set_item_len(item);
      d->set_key(key.data(), key.size());
    };
    add(r->add_kv_regions(), buf.k, kPageBytes);
    add(r->add_kv_regions(), buf.v, kPageBytes);
    add(r->add_aux_regions(), buf.aux, kAuxBytes);
    r->set_kv_layout(wire::KV_LAYOUT_HND);
    return msg;
  }
};

wire::DecodeToPrefill Info(uint64_t room, std::vector<int32_t> pages, std::optional<int32_t> aux) {
  wire::DecodeToPrefill msg;
  auto* t = msg.mutable_transfer_info();
  t->set_room(room);
  for (int32_t p : pages) t->add_dst_kv_pages(p);
  if (aux) t->set_aux_index(*aux);
  t->set_required_dst_info_num(1);
  return msg;
}

// A prefill manager with its own bootstrap server, and an honest decode identity.
struct PrefillFixture {
  Buffers buf;
  uint16_t bootstrap = FreePort();
  std::unique_ptr<pdlib::KVManager> prefill;
  DecodeIdentity decode;
  PrefillFixture() {
    pdlib::SetLogLevel(pdlib::LogLevel::kError);  // thousands of refusals would be logged
    auto m = pdlib::KVManager::Create(Options(pdlib::Mode::kPrefill, bootstrap, buf));
    REQUIRE(m.ok());
    prefill = std::move(*m);
  }
  ~PrefillFixture() { pdlib::SetLogLevel(pdlib::LogLevel::kWarning); }

  // A stream whose Register was accepted.
  std::unique_ptr<RawDecode> Registered(uint64_t session) {
    auto raw = std::make_unique<RawDecode>(prefill->endpoint());
    REQUIRE(raw->Write(decode.Register(session)));
    auto ack = raw->Next();
    REQUIRE(ack.has_value());
    REQUIRE(ack->has_register_ack());
    INFO(ack->register_ack().error_message());
    REQUIRE(ack->register_ack().ok());
    return raw;
  }
};

}  // namespace

TEST_CASE("hostile decode: Registers with wrong shapes are refused naming both values") {
  PrefillFixture fx;
  struct Case {
    const char* what;
    std::function<void(wire::Register*)> lie;
    std::string expected;  // in the RegisterAck's error_message
  };
  const std::vector<Case> cases = {
      {"fingerprint", [](wire::Register* r) { r->mutable_fingerprint()->set_num_layers(3); },
       "model fingerprint mismatch (decode's value first): num_layers 3 vs"},
      {"model name", [](wire::Register* r) { r->mutable_fingerprint()->set_model_name("other"); },
       "model_name 'other' vs"},
      {"wire version", [](wire::Register* r) { r->mutable_fingerprint()->set_wire_version(1); },
       "wire_version 1 vs " + std::to_string(PDLIB_WIRE_VERSION)},
      {"kv element type", [](wire::Register* r) { r->mutable_fingerprint()->set_kv_dtype("int8"); },
       "kv_dtype 'int8' vs ''"},
      {"a long engine tag is cut in the message",
       [](wire::Register* r) { r->mutable_fingerprint()->set_engine_tag(std::string(5000, 'x')); },
       "engine_tag '" + std::string(64, 'x') + "...' vs ''"},
      {"page size", [](wire::Register* r) { r->set_page_size(32); },
       "page size mismatch: decode 32, prefill 16"},
      {"transport", [](wire::Register* r) { r->set_transport("ucx"); },
       "transport mismatch: decode uses 'ucx', prefill uses 'fake'"},
      {"opaque vs heads", [](wire::Register* r) { r->set_kv_head_num(4); },
       "kv_head_num is 0 on prefill and 4 on decode"},
      {"MLA", [](wire::Register* r) { r->set_is_mla(true); },
       "MLA mismatch: prefill not MLA, decode MLA"},
      {"a state family with buffers nobody registered",
       [](wire::Register* r) {
         auto* f = r->add_state_families();
         f->set_type(wire::STATE_TYPE_MAMBA);
         f->set_count(3);
       },
       "state families cover 3 of 0 state buffers"},
      {"a state family prefill does not have",
       [](wire::Register* r) { r->add_state_families()->set_type(wire::STATE_TYPE_SWA_RING); },
       "state type mismatch: prefill none, decode swa_ring"},
      {"endpoint", [](wire::Register* r) { r->set_transport_endpoint("garbage"); },
       "connecting to decode's endpoint"},
      {"state shapes", [](wire::Register* r) { r->add_state_item_rows(3); },
       "state_item_rows has 1 entries for 0 state buffers"},
  };
  for (const Case& c : cases) {
    INFO("lie: " << c.what);
    RawDecode raw(fx.prefill->endpoint());
    wire::DecodeToPrefill msg = fx.decode.Register(7);
    c.lie(msg.mutable_register_info());
    REQUIRE(raw.Write(msg));
    auto ack = raw.Next();
    REQUIRE(ack.has_value());
    REQUIRE(ack->has_register_ack());
    CHECK_FALSE(ack->register_ack().ok());
    INFO("error_message: " << ack->register_ack().error_message());
    CHECK(Contains(ack->register_ack().error_message(), c.expected));
    CHECK(raw.Finish().ok());  // prefill closes the stream after the refusal
    CHECK(fx.prefill->metrics().connections == 0);
  }
  ExpectHealthy(*fx.prefill, fx.bootstrap, 1);
}

TEST_CASE("hostile decode: malformed Registers and protocol violations end the stream") {
  PrefillFixture fx;
  struct Case {
    const char* what;
    std::function<std::vector<wire::DecodeToPrefill>(DecodeIdentity&)> msgs;
    std::string expected;  // in the gRPC status prefill finishes the stream with ("": any)
  };
  auto reg = [](std::function<void(wire::Register*)> lie) {
    return [lie](DecodeIdentity& d) {
      auto msg = d.Register(9);
      lie(msg.mutable_register_info());
      return std::vector{msg};
    };
  };
  const std::vector<Case> cases = {
      {"kv_layout out of range",
       reg([](wire::Register* r) { r->set_kv_layout(wire::KVLayout(7)); }),
       "Register: kv_layout 7"},
      {"state_type out of range",
       reg([](wire::Register* r) { r->set_state_type(wire::StateType(9)); }),
       "Register: state_type 9"},
      {"negative start layer", reg([](wire::Register* r) { r->set_start_layer(-1); }),
       "start_layer -1"},
      // Wire version 3 (issue #27): state families, and no version-2 state fields.
      {"a wire-2 state_start", reg([](wire::Register* r) { r->set_state_start(2); }),
       "are wire version 2 fields"},
      {"a state family of type none",
       reg([](wire::Register* r) { r->add_state_families()->set_count(0); }),
       "Register: state family 0 has state type 0"},
      {"a state family with negative count", reg([](wire::Register* r) {
         auto* f = r->add_state_families();
         f->set_type(wire::STATE_TYPE_SWA);
         f->set_count(-1);
       }),
       "state family 0 starts at 0 with -1 buffers"},

      {"item_len 0", reg([](wire::Register* r) { r->mutable_kv_regions(1)->set_item_len(0); }),
       "kv region 1 is malformed"},
      {"item_len > length",
       reg([](wire::Register* r) { r->mutable_aux_regions(0)->set_item_len(1 << 20); }),
       "aux region 0 is malformed"},
      {"address overflow",
       reg([](wire::Register* r) { r->mutable_kv_regions(0)->set_addr(UINT64_MAX - 10); }),
       "kv region 0 is malformed (addr 0xfffffffffffffff5"},
      {"too many regions", reg([](wire::Register* r) {
         for (int i = 0; i < (1 << 14); ++i) *r->add_kv_regions() = r->kv_regions(0);
       }),
       "Register: 16386 kv regions (at most 16384)"},
      {"TransferInfo before Register",
       [](DecodeIdentity&) { return std::vector{Info(1, {1}, std::nullopt)}; },
       "TransferInfo before Register"},
      {"Abort before Register",
       [](DecodeIdentity&) {
         wire::DecodeToPrefill m;
         m.mutable_abort()->set_room(1);
         return std::vector{m};
       },
       "Abort before Register"},
      {"empty message", [](DecodeIdentity&) { return std::vector{wire::DecodeToPrefill()}; },
       "empty or unknown message"},
      {"Register twice",
       [](DecodeIdentity& d) {
         return std::vector{d.Register(11), d.Register(11)};
       },
       "Register sent twice"},
  };
  for (const Case& c : cases) {
    INFO("violation: " << c.what);
    RawDecode raw(fx.prefill->endpoint());
    for (const auto& m : c.msgs(fx.decode)) REQUIRE(raw.Write(m));
    grpc::Status st = raw.Finish();
    INFO("status: " << st.error_message());
    if (!c.expected.empty()) {
      CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(Contains(st.error_message(), c.expected));
    }
    CHECK(WaitFor([&] { return fx.prefill->metrics().connections == 0; }));
  }
  ExpectHealthy(*fx.prefill, fx.bootstrap, 2);
}

TEST_CASE("hostile decode: free text that is not UTF-8 is carried, not a broken stream") {
  // Reasons and names are proto `bytes`: an engine's Abort("\xff\xfe") must not end the stream
  // (a proto3 `string` that is not UTF-8 would fail the whole frame and every room on it).
  PrefillFixture fx;
  auto raw = fx.Registered(12);
  wire::DecodeToPrefill m;
  m.mutable_abort()->set_room(1);
  m.mutable_abort()->set_reason("\xff\xfe");
  REQUIRE(raw->Write(m));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(fx.prefill->metrics().connections == 1);
}

TEST_CASE("hostile decode: TransferInfo fields out of range fail the room with the value named") {
  PrefillFixture fx;
  auto raw = fx.Registered(21);
  struct Case {
    const char* what;
    std::function<void(wire::TransferInfo*)> lie;
    std::string expected;  // in the TransferStatus reason and the sender's FailureReason
  };
  const std::vector<Case> cases = {
      {"page past the end", [](wire::TransferInfo* t) { t->set_dst_kv_pages(1, 64); },
       "kv page index 64 (position 1) out of range [0, 64) on decode"},
      {"negative page", [](wire::TransferInfo* t) { t->set_dst_kv_pages(0, -1); },
       "kv page index -1 (position 0) out of range [0, 64) on decode"},
      {"most negative page", [](wire::TransferInfo* t) { t->set_dst_kv_pages(2, INT32_MIN); },
       "kv page index -2147483648 (position 2) out of range"},
      {"repeated page", [](wire::TransferInfo* t) { t->set_dst_kv_pages(2, 3); },
       "decode kv page index 3 appears more than once"},
      {"aux past the end", [](wire::TransferInfo* t) { t->set_aux_index(8); },
       "aux index 8 out of range [0, 8) on decode"},
      {"negative aux", [](wire::TransferInfo* t) { t->set_aux_index(-3); },
       "aux index -3 is negative"},
      {"state without state buffers", [](wire::TransferInfo* t) { t->add_dst_state_indices(0); },
       "state indices sent but decode has no state buffers"},
      {"state counts that add up to more",
       [](wire::TransferInfo* t) { t->add_dst_state_counts(2); },
       "TransferInfo state counts add up to 2 for 0 state indices"},
      {"state counts for families decode never registered",
       [](wire::TransferInfo* t) { t->add_dst_state_counts(0); },
       "TransferInfo has state indices for 1 families, decode registered 0"},
      {"a prefix that is not whole pages",
       [](wire::TransferInfo* t) { t->set_decode_prefix_len(3); },
       "decode_prefix_len 3 is not a multiple of page_size"},
      {"required 0", [](wire::TransferInfo* t) { t->set_required_dst_info_num(0); },
       "required_dst_info_num 0, but this prefill rank expects 1"},
      {"required huge", [](wire::TransferInfo* t) { t->set_required_dst_info_num(UINT32_MAX); },
       "required_dst_info_num 4294967295, but this prefill rank expects 1"},
      {"dummy to a writer", [](wire::TransferInfo* t) { t->set_is_dummy(true); },
       "a dummy TransferInfo, but this prefill rank writes to that decode rank"},
  };
  uint64_t room = 100;
  for (const Case& c : cases) {
    INFO("lie: " << c.what);
    ++room;
    auto sender = fx.prefill->CreateSender(room);
    REQUIRE(sender.ok());
    wire::DecodeToPrefill msg = Info(room, {3, 4, 5}, 1);
    c.lie(msg.mutable_transfer_info());
    REQUIRE(raw->Write(msg));
    auto status = raw->Next();
    REQUIRE(status.has_value());
    REQUIRE(status->has_status());
    CHECK(status->status().room() == room);
    CHECK(status->status().result() == wire::TRANSFER_RESULT_FAILED);
    INFO("reason: " << status->status().reason());
    CHECK(Contains(status->status().reason(), c.expected));
    // Refused by the core or already by the stream (peer_server.cc): either way the sender
    // fails at once with the reason, instead of waiting out bootstrap_timeout.
    REQUIRE(WaitFor([&] { return (*sender)->Poll() == KVPoll::kFailed; }));
    // Nothing was written for a refused TransferInfo: prefill says so, so that decode may reuse
    // the pages at once (the page-reuse rule, kv_manager.h).
    REQUIRE(raw->WaitDrained(room));
    CHECK(Contains((*sender)->FailureReason().message(), c.expected));
  }
  // A second TransferInfo for a room from the same session, and a late one from another
  // session once the room has all it expects (chunks index into them: frozen once complete).
  ++room;
  auto sender = fx.prefill->CreateSender(room);
  REQUIRE(sender.ok());
  REQUIRE(raw->Write(Info(room, {1, 2}, std::nullopt)));
  REQUIRE(WaitFor([&] { return (*sender)->Poll() == KVPoll::kWaitingForInput; }));
  auto other = fx.Registered(22);
  REQUIRE(other->Write(Info(room, {}, std::nullopt)));
  auto late = other->Next();
  REQUIRE(late.has_value());
  INFO("late: " << late->status().reason());
  CHECK(Contains(late->status().reason(),
                 "TransferInfo from session 22 after all 1 expected ones arrived"));
  REQUIRE(raw->Write(Info(room, {1, 2}, std::nullopt)));
  bool saw_duplicate = false;
  while (auto m = raw->Next()) {
    if (m->has_status() &&
        Contains(m->status().reason(), "duplicate TransferInfo from session 21")) {
      saw_duplicate = true;
      break;
    }
  }
  CHECK(saw_duplicate);
  CHECK((*sender)->Poll() == KVPoll::kFailed);
  // Everything cleaned up once the handles are gone.
  sender->reset();
  raw->Close();
  other->Close();
  CHECK(WaitFor([&] { return fx.prefill->metrics().connections == 0; }));
  ExpectHealthy(*fx.prefill, fx.bootstrap, 3);
  auto m = fx.prefill->metrics();
  CHECK(m.live_rooms == 0);
  CHECK(m.bootstrap_queue_size == 0);
}

TEST_CASE("hostile decode: a flood of rooms nobody created stays bounded and is dropped") {
  PrefillFixture fx;
  auto raw = fx.Registered(31);
  // 100k TransferInfos for rooms without a sender, 1000 to a frame: the first 65536 wait for
  // their sender (a bounded table), every further one is refused at once.
  constexpr int kRooms = 100000, kHeld = 1 << 16;
  constexpr uint64_t kFirst = 1000000;
  for (int f = 0; f < kRooms / 1000; ++f) {
    wire::DecodeToPrefillFrame frame;
    for (int i = 0; i < 1000; ++i) *frame.add_msgs() = Info(kFirst + f * 1000 + i, {1}, 0);
    REQUIRE(raw->WriteFrame(frame));
  }
  int refused = 0;
  while (refused < kRooms - kHeld) {
    auto m = raw->Next();
    REQUIRE(m.has_value());
    REQUIRE(m->has_status());
    REQUIRE(m->status().result() == wire::TRANSFER_RESULT_FAILED);
    REQUIRE(m->status().room() >= kFirst + kHeld);
    if (refused == 0) {
      CHECK(Contains(m->status().reason(),
                     "waiting for their sender on this prefill rank are at their limit (65536 "
                     "rooms"));
    }
    ++refused;
  }
  CHECK(fx.prefill->metrics().bootstrap_queue_size == kHeld);
  // A held room whose sender appears now gets its TransferInfo; an aborted one fails at once.
  wire::DecodeToPrefill abort;
  abort.mutable_abort()->set_room(kFirst + 1);
  abort.mutable_abort()->set_reason("changed my mind");
  REQUIRE(raw->Write(abort));
  for (uint64_t r = 0; r < 1000; ++r) {  // Aborts for rooms that never existed
    abort.mutable_abort()->set_room(9000000 + r);
    REQUIRE(raw->Write(abort));
  }
  // A message prefill answers at once, so that every Abort above has been handled.
  REQUIRE(raw->Write(Info(5, {1}, -1)));
  auto sync = raw->Next();
  REQUIRE(sync.has_value());
  CHECK(Contains(sync->status().reason(), "aux index -1 is negative"));
  auto aborted = fx.prefill->CreateSender(kFirst + 1);
  REQUIRE(aborted.ok());
  REQUIRE(WaitFor([&] { return (*aborted)->Poll() == KVPoll::kFailed; }));
  CHECK(Contains((*aborted)->FailureReason().message(), "changed my mind"));
  auto held = fx.prefill->CreateSender(kFirst + 2);
  REQUIRE(held.ok());
  CHECK(WaitFor([&] { return (*held)->Poll() == KVPoll::kWaitingForInput; }));
  // The decode stream goes away: every TransferInfo it left behind is dropped.
  raw->Close();
  CHECK(WaitFor([&] { return fx.prefill->metrics().bootstrap_queue_size == 0; }));
  CHECK(WaitFor([&] { return (*held)->Poll() == KVPoll::kFailed; }));
  aborted->reset();
  held->reset();
  ExpectHealthy(*fx.prefill, fx.bootstrap, 4);
  auto m = fx.prefill->metrics();
  CHECK(m.live_rooms == 0);
  CHECK(m.bootstrap_queue_size == 0);
}

TEST_CASE("hostile decode: TransferInfos with huge page lists are held up to a byte limit") {
  PrefillFixture fx;
  auto raw = fx.Registered(32);
  // 20 rooms without a sender, 1M page indices each (4 MiB held per room): 15 fit under the
  // 64 MiB limit, the other 5 are refused at once.
  constexpr int kRooms = 20, kHeld = 15;
  constexpr uint64_t kFirst = 2000000;
  const std::vector<int32_t> pages(1 << 20, 1);
  for (int i = 0; i < kRooms; ++i) REQUIRE(raw->Write(Info(kFirst + i, pages, 0)));
  for (int refused = 0; refused < kRooms - kHeld; ++refused) {
    auto m = raw->Next();
    REQUIRE(m.has_value());
    REQUIRE(m->has_status());
    CHECK(m->status().room() >= kFirst + kHeld);
    CHECK(Contains(m->status().reason(), "67108864 bytes)"));
  }
  CHECK(fx.prefill->metrics().bootstrap_queue_size == kHeld);
  raw->Close();
  CHECK(WaitFor([&] { return fx.prefill->metrics().bootstrap_queue_size == 0; }));
  ExpectHealthy(*fx.prefill, fx.bootstrap, 4);
}
