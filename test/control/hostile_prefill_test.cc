// A prefill rank that lies, against a real decode KVManager (issue #9): a raw Peer service,
// registered with a real bootstrap server, answers Register with refusals, garbage or silence
// and sends TransferStatus for unknown rooms, from ranks that do not write, twice, before Init.
// Decode must not crash, must not report Success wrongly and must fail rooms with a reason.
// hostile_peer_test.cc is the mirror image.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "lib/control/bootstrap_client.h"
#include "lib/control/bootstrap_server.h"
#include "lib/proto/pdlib.grpc.pb.h"
#include "pdlib/pdlib.h"
#include "pdlib/spi/transport.h"
#include "test/control/hostile_peer_util.h"

using namespace pdlib_hostile;
namespace wire = pdlib::wire::v1;

namespace {

using PeerStream = grpc::ServerReaderWriter<wire::PrefillToDecodeFrame, wire::DecodeToPrefillFrame>;

class HostilePrefill final : public wire::Peer::Service {
 public:
  // How it answers a Register: `ack` returned (nullopt: never answers).
  using Answer = std::function<std::optional<wire::RegisterAck>(const wire::Register&)>;

  explicit HostilePrefill(Answer answer) : answer_(std::move(answer)) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
    port_ = static_cast<uint16_t>(port);
    pdlib::control::BootstrapServerOptions bo;
    bo.host = "127.0.0.1";
    bo.port = 0;
    auto bootstrap = pdlib::control::BootstrapServer::Start(bo);
    REQUIRE(bootstrap.ok());
    bootstrap_ = std::move(*bootstrap);
    auto client = pdlib::control::BootstrapClient::Create("127.0.0.1", bootstrap_->port());
    REQUIRE(client.ok());
    pdlib::control::RankRegistration reg;
    reg.host = "127.0.0.1";
    reg.port = port_;
    reg.page_size = 16;
    reg.fingerprint = kFingerprint;
    REQUIRE((*client)->RegisterRank(reg).ok());
  }
  ~HostilePrefill() override {
    Stop();
    bootstrap_->Shutdown();
  }

  // Ends every stream (decode sees the connection break) and stops listening. Idempotent.
  void Stop() {
    if (stopped_) return;
    stopped_ = true;
    server_->Shutdown(std::chrono::system_clock::now() + 1s);
  }

  uint16_t bootstrap_port() const { return static_cast<uint16_t>(bootstrap_->port()); }

  grpc::Status Connect(grpc::ServerContext*, PeerStream* stream) override {
    wire::DecodeToPrefillFrame in;
    while (stream->Read(&in)) {
      for (const auto& msg : in.msgs()) {
        if (msg.has_register_info()) {
          if (auto ack = answer_(msg.register_info())) {
            std::lock_guard lock(mu_);
            wire::PrefillToDecodeFrame out;
            *out.add_msgs()->mutable_register_ack() = *ack;
            stream->Write(out);
            stream_ = stream;
          }
        } else if (msg.has_transfer_info()) {
          std::lock_guard lock(mu_);
          infos_.push_back(msg.transfer_info());
        } else if (msg.has_reads_done()) {
          std::lock_guard lock(mu_);
          reads_done_.push_back(msg.reads_done());
        }
      }
    }
    std::lock_guard lock(mu_);
    if (stream_ == stream) stream_ = nullptr;
    return grpc::Status::OK;
  }

  // Sends `msgs` in one frame on the registered stream; false when there is none.
  bool Send(const std::vector<wire::PrefillToDecode>& msgs) {
    std::lock_guard lock(mu_);
    if (stream_ == nullptr) return false;
    wire::PrefillToDecodeFrame out;
    for (const auto& m : msgs) *out.add_msgs() = m;
    return stream_->Write(out);
  }

  size_t infos() {
    std::lock_guard lock(mu_);
    return infos_.size();
  }

  // The ReadsDone decode sent for `room` (pull), if any.
  std::optional<wire::ReadsDone> ReadsDoneFor(uint64_t room) {
    std::lock_guard lock(mu_);
    for (const auto& d : reads_done_) {
      if (d.room() == room) return d;
    }
    return std::nullopt;
  }

 private:
  Answer answer_;
  std::unique_ptr<grpc::Server> server_;
  bool stopped_ = false;
  uint16_t port_ = 0;
  std::unique_ptr<pdlib::control::BootstrapServer> bootstrap_;
  std::mutex mu_;
  PeerStream* stream_ = nullptr;
  std::vector<wire::TransferInfo> infos_;
  std::vector<wire::ReadsDone> reads_done_;
};

// The RegisterAck an honest prefill of Options() would send: rank (0, 0), both layers.
wire::RegisterAck GoodAck() {
  wire::RegisterAck ack;
  ack.set_ok(true);
  ack.set_stage_num_layers(2);
  return ack;
}

wire::PrefillToDecode Status(uint64_t room, wire::TransferResult result, int32_t tp_rank = 0,
                             int32_t pp_rank = 0, std::string reason = "") {
  wire::PrefillToDecode m;
  auto* s = m.mutable_status();
  s->set_room(room);
  s->set_result(result);
  s->set_prefill_tp_rank(tp_rank);
  s->set_prefill_pp_rank(pp_rank);
  if (result == wire::TRANSFER_RESULT_FAILED) s->set_error_code(13);
  s->set_reason(reason);
  return m;
}

struct DecodeFixture {
  Buffers buf;
  std::unique_ptr<pdlib::KVManager> decode;
  explicit DecodeFixture(uint16_t bootstrap_port) {
    pdlib::SetLogLevel(pdlib::LogLevel::kError);
    auto m = pdlib::KVManager::Create(Options(pdlib::Mode::kDecode, bootstrap_port, buf));
    REQUIRE(m.ok());
    decode = std::move(*m);
  }
  ~DecodeFixture() { pdlib::SetLogLevel(pdlib::LogLevel::kWarning); }
};

}  // namespace

TEST_CASE("hostile prefill: refused, garbage or missing RegisterAcks fail the room with a reason") {
  struct Case {
    const char* what;
    HostilePrefill::Answer answer;
    std::string expected;  // in the receiver's FailureReason
  };
  const std::vector<Case> cases = {
      {"refused",
       [](const wire::Register&) {
         wire::RegisterAck ack;
         ack.set_error_code(9);
         ack.set_error_message("go away 42");
         return std::optional(ack);
       },
       "go away 42"},
      {"code out of range",
       [](const wire::Register&) {
         wire::RegisterAck ack;
         ack.set_error_code(424242);
         ack.set_error_message("strange");
         return std::optional(ack);
       },
       "strange"},
      {"layers nobody sends",
       [](const wire::Register&) {
         wire::RegisterAck ack = GoodAck();
         ack.set_stage_num_layers(-7);
         return std::optional(ack);
       },
       "layer"},
      {"silent", [](const wire::Register&) { return std::optional<wire::RegisterAck>(); },
       "no RegisterAck within 2000 ms"},
  };
  for (const Case& c : cases) {
    INFO("prefill: " << c.what);
    HostilePrefill prefill(c.answer);
    DecodeFixture fx(prefill.bootstrap_port());
    auto receiver = fx.decode->CreateReceiver({"127.0.0.1", prefill.bootstrap_port()}, 50);
    REQUIRE(receiver.ok());
    REQUIRE(WaitFor([&] { return (*receiver)->Poll() == KVPoll::kFailed; }));
    INFO("reason: " << (*receiver)->FailureReason().ToString());
    CHECK(Contains((*receiver)->FailureReason().message(), c.expected));
    CHECK(fx.decode->metrics().rooms_succeeded == 0);
  }
}

TEST_CASE("hostile prefill: statuses for unknown rooms, wrong ranks, duplicates, before Init") {
  HostilePrefill prefill([](const wire::Register&) { return std::optional(GoodAck()); });
  DecodeFixture fx(prefill.bootstrap_port());
  const pdlib::BootstrapAddress addr{"127.0.0.1", prefill.bootstrap_port()};
  auto receiver = fx.decode->CreateReceiver(addr, 60);
  REQUIRE(receiver.ok());
  REQUIRE(WaitFor([&] { return (*receiver)->Poll() == KVPoll::kWaitingForInput; }));
  // Statuses are handled in order: a failure for a sentinel room marks when a frame is done.
  uint64_t sentinel = 1000;
  auto handled = [&](std::vector<wire::PrefillToDecode> msgs) {
    auto r = fx.decode->CreateReceiver(addr, ++sentinel);
    REQUIRE(r.ok());
    REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kWaitingForInput; }));
    msgs.push_back(Status(sentinel, wire::TRANSFER_RESULT_FAILED, 0, 0, "sentinel"));
    REQUIRE(prefill.Send(msgs));
    REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
  };
  // Before Init, for unknown rooms, without a result, empty: none of them may count.
  handled({Status(60, wire::TRANSFER_RESULT_SUCCESS), Status(61, wire::TRANSFER_RESULT_SUCCESS),
           Status(UINT64_MAX, wire::TRANSFER_RESULT_FAILED, 0, 0, "who?"),
           Status(60, wire::TRANSFER_RESULT_UNSPECIFIED), wire::PrefillToDecode()});
  CHECK((*receiver)->Poll() == KVPoll::kWaitingForInput);
  std::vector<int32_t> dst = {1, 2};
  REQUIRE((*receiver)->Init(dst, 0).ok());
  REQUIRE(WaitFor([&] { return prefill.infos() == 1; }));
  // From ranks that do not write to this decode rank (only prefill (tp 0, pp 0) does).
  handled({Status(60, wire::TRANSFER_RESULT_SUCCESS, 3, 0),
           Status(60, wire::TRANSFER_RESULT_SUCCESS, 0, 5),
           Status(60, wire::TRANSFER_RESULT_SUCCESS, -1, -1),
           Status(60, wire::TRANSFER_RESULT_UNSPECIFIED)});
  CHECK((*receiver)->Poll() == KVPoll::kTransferring);
  // The right rank, twice: one Success; a later failure cannot undo it.
  REQUIRE(prefill.Send({Status(60, wire::TRANSFER_RESULT_SUCCESS),
                        Status(60, wire::TRANSFER_RESULT_SUCCESS),
                        Status(60, wire::TRANSFER_RESULT_FAILED, 0, 0, "too late")}));
  REQUIRE(WaitFor([&] { return (*receiver)->Poll() == KVPoll::kSuccess; }));
  handled({});
  CHECK((*receiver)->Poll() == KVPoll::kSuccess);
  CHECK(fx.decode->metrics().rooms_succeeded == 1);
  // A failure names the prefill rank and keeps the prefill's reason.
  auto second = fx.decode->CreateReceiver(addr, 62);
  REQUIRE(second.ok());
  REQUIRE((*second)->Init(dst, 1).ok());
  REQUIRE(WaitFor([&] { return prefill.infos() == 2; }));
  REQUIRE(prefill.Send({Status(62, wire::TRANSFER_RESULT_FAILED, 0, 0, "disk on fire")}));
  REQUIRE(WaitFor([&] { return (*second)->Poll() == KVPoll::kFailed; }));
  CHECK(Contains((*second)->FailureReason().message(), "prefill tp rank 0"));
  CHECK(Contains((*second)->FailureReason().message(), "disk on fire"));
  // The prefill goes away: a room in flight fails with the reason, none is left behind.
  auto third = fx.decode->CreateReceiver(addr, 63);
  REQUIRE(third.ok());
  REQUIRE((*third)->Init(dst, 2).ok());
  REQUIRE(WaitFor([&] { return prefill.infos() == 3; }));
  receiver->reset();
  second->reset();
  prefill.Stop();
  REQUIRE(WaitFor([&] { return (*third)->Poll() == KVPoll::kFailed; }));
  CHECK(Contains((*third)->FailureReason().message(), "connection lost"));
  third->reset();
  auto m = fx.decode->metrics();
  CHECK(m.live_rooms == 0);
  CHECK(m.rooms_succeeded == 1);
  CHECK(m.rooms_failed == 2 + (sentinel - 1000));
}

namespace {

// A pulling prefill's RegisterAck: prefill described with regions and an endpoint of a real fake
// transport (so decode can connect and import them), shaped like the decode fixture's memory.
struct PullAck {
  std::unique_ptr<pdlib::spi::Transport> transport;
  Buffers buf;
  wire::RegisterAck ack = GoodAck();
  PullAck() {
    auto t = pdlib::spi::CreateTransport("fake", {});
    REQUIRE(t.ok());
    transport = std::move(*t);
    wire::Register* src = ack.mutable_source();
    src->set_direction(wire::TRANSFER_DIRECTION_PULL);
    src->set_transport("fake");
    src->set_page_size(16);
    src->mutable_decode_rank()->set_tp_size(1);
    src->mutable_decode_rank()->set_pp_size(1);
    src->mutable_decode_rank()->set_dp_size(1);
    auto* fp = src->mutable_fingerprint();
    fp->set_num_layers(kFingerprint.num_layers);
    fp->set_num_kv_heads(kFingerprint.num_kv_heads);
    fp->set_head_dim(kFingerprint.head_dim);
    fp->set_dtype_bytes(kFingerprint.dtype_bytes);
    fp->set_layout_version(kFingerprint.layout_version);
    fp->set_model_name(kFingerprint.model_name);
    fp->set_wire_version(PDLIB_WIRE_VERSION);
    auto endpoint = transport->CreateTargetEndpoint();
    REQUIRE(endpoint.ok());
    src->set_transport_endpoint(endpoint->blob.data(), endpoint->blob.size());
    auto add = [&](google::protobuf::RepeatedPtrField<wire::RegionDesc>* out,
                   std::vector<uint8_t>& mem, uint64_t item) {
      pdlib::spi::Blob key;
      REQUIRE(transport->RegisterMemory({mem.data(), mem.size()}, &key).ok());
      auto* r = out->Add();
      r->set_addr(Buffers::Addr(mem));
      r->set_length(mem.size());
      r->set_item_len(item);
      r->set_key(key.data(), key.size());
    };
    add(src->mutable_kv_regions(), buf.k, kPageBytes);
    add(src->mutable_kv_regions(), buf.v, kPageBytes);
    add(src->mutable_aux_regions(), buf.aux, kAuxBytes);
    ack.set_lease_ms(30000);
  }
};

wire::PrefillToDecode Ready(uint64_t room, std::vector<int32_t> pages, uint64_t offset, bool last,
                            int32_t layer_begin = 0, int32_t layer_end = 1, int32_t tp_rank = 0) {
  wire::PrefillToDecode m;
  auto* r = m.mutable_read_ready();
  r->set_room(room);
  r->set_prefill_tp_rank(tp_rank);
  r->mutable_src_pages()->Add(pages.begin(), pages.end());
  r->set_src_offset(offset);
  r->set_last(last);
  r->set_layer_begin(layer_begin);
  r->set_layer_end(layer_end);
  if (last) r->set_aux_index(1);
  return m;
}

pdlib::KVManagerOptions PullOptions(uint16_t bootstrap_port, Buffers& b) {
  pdlib::KVManagerOptions o = Options(pdlib::Mode::kDecode, bootstrap_port, b);
  o.direction = pdlib::TransferDirection::kPull;
  return o;
}

}  // namespace

TEST_CASE("hostile prefill, pull: ReadReady out of range or out of turn fails the room, no read") {
  PullAck pull;
  std::atomic<int> pulling_registers{0};  // checked on this thread: Catch is not thread-safe
  HostilePrefill prefill([&](const wire::Register& reg) {
    if (reg.direction() == wire::TRANSFER_DIRECTION_PULL) pulling_registers.fetch_add(1);
    return std::optional(pull.ack);
  });
  pdlib::SetLogLevel(pdlib::LogLevel::kError);
  Buffers buf;
  auto decode = pdlib::KVManager::Create(PullOptions(prefill.bootstrap_port(), buf));
  REQUIRE(decode.ok());
  const pdlib::BootstrapAddress addr{"127.0.0.1", prefill.bootstrap_port()};
  const std::vector<int32_t> dst = {1, 2};
  struct Case {
    const char* what;
    wire::PrefillToDecode msg;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"pages past the request", Ready(70, {3}, 5, false), "published prompt pages [5, 6)"},
      {"a last chunk that ends early", Ready(71, {3}, 0, true), "as the last chunk"},
      {"layers prefill does not hold", Ready(72, {3}, 0, false, 0, 9), "published layers [0, 9)"},
      {"a page outside prefill's pool", Ready(73, {4096}, 0, false), "4096"},
  };
  uint64_t infos = 0;
  for (const Case& c : cases) {
    INFO("ReadReady: " << c.what);
    const uint64_t room = c.msg.read_ready().room();
    auto r = (*decode)->CreateReceiver(addr, room);
    REQUIRE(r.ok());
    REQUIRE((*r)->Init(dst, 0).ok());
    ++infos;
    if (!WaitFor([&] { return prefill.infos() == infos; })) {
      FAIL("no TransferInfo; receiver " << pdlib::KVPollName((*r)->Poll()) << " "
                                        << (*r)->FailureReason().ToString());
    }
    REQUIRE(prefill.Send({c.msg}));
    REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
    INFO("reason: " << (*r)->FailureReason().ToString());
    CHECK(Contains((*r)->FailureReason().message(), c.expected));
    // Nothing was posted: the pages are free, and prefill hears that the reads are over.
    CHECK(WaitFor([&] { return (*r)->PagesReusable(); }));
    REQUIRE(WaitFor([&] { return prefill.ReadsDoneFor(room).has_value(); }));
    CHECK(!prefill.ReadsDoneFor(room)->ok());
  }
  // A room decode does not know, and a rank that does not write here.
  REQUIRE(prefill.Send({Ready(999, {1}, 0, true)}));
  REQUIRE(WaitFor([&] { return prefill.ReadsDoneFor(999).has_value(); }));
  CHECK(Contains(prefill.ReadsDoneFor(999)->reason(), "room 999 is not live"));
  auto r = (*decode)->CreateReceiver(addr, 80);
  REQUIRE(r.ok());
  REQUIRE((*r)->Init(dst, 0).ok());
  ++infos;
  REQUIRE(WaitFor([&] { return prefill.infos() == infos; }));
  // Another rank's ReadReady is dropped; a success before the reads is ignored.
  REQUIRE(prefill.Send(
      {Ready(80, {3, 4}, 0, true, 0, 1, 5), Status(80, wire::TRANSFER_RESULT_SUCCESS)}));
  std::this_thread::sleep_for(200ms);
  CHECK((*r)->Poll() == KVPoll::kTransferring);
  CHECK(!prefill.ReadsDoneFor(80).has_value());
  // The honest sequence: published, read (fake), reported, confirmed.
  REQUIRE(prefill.Send({Ready(80, {3, 4}, 0, true)}));
  REQUIRE(WaitFor([&] { return prefill.ReadsDoneFor(80).has_value(); }));
  CHECK(prefill.ReadsDoneFor(80)->ok());
  CHECK((*r)->Poll() == KVPoll::kTransferring);  // not before prefill confirms
  REQUIRE(prefill.Send({Status(80, wire::TRANSFER_RESULT_SUCCESS)}));
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kSuccess; }));
  CHECK((*decode)->metrics().rooms_succeeded == 1);
  CHECK(pulling_registers.load() >= 1);  // decode said it pulls
  pdlib::SetLogLevel(pdlib::LogLevel::kWarning);
}

TEST_CASE("hostile prefill, pull: an ack without prefill's description is refused") {
  HostilePrefill prefill([](const wire::Register&) { return std::optional(GoodAck()); });
  Buffers buf;
  auto decode = pdlib::KVManager::Create(PullOptions(prefill.bootstrap_port(), buf));
  REQUIRE(decode.ok());
  auto r = (*decode)->CreateReceiver({"127.0.0.1", prefill.bootstrap_port()}, 90);
  REQUIRE(r.ok());
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
  CHECK(Contains((*r)->FailureReason().message(), "does not describe prefill's pages"));
}
