#include "lib/control/peer_server.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <vector>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/base/tsan.h"
#include "lib/control/grpc_runtime.h"
#include "lib/control/net_address.h"
#include "lib/control/peer_convert.h"
#include "lib/proto/pdlib.grpc.pb.h"

namespace pdlib {
inline namespace v1 {
namespace control {
namespace {

using wire::v1::DecodeToPrefillFrame;
using wire::v1::PrefillToDecode;
using wire::v1::PrefillToDecodeFrame;

class PeerStream;

// The write half of one stream, shared with the protocol core as its DecodeLink. It outlives
// the stream object: after the stream is done, messages are dropped.
class StreamWriter final : public DecodeLink {
 public:
  explicit StreamWriter(PeerStream* stream) : stream_(stream) {}
  void SendStatus(const TransferStatusMsg& msg) override;
  void SendDrained(const RoomsDrainedMsg& msg) override;
  void SendReadReady(const ReadReadyMsg& msg) override;
  void Close(const Status& reason) override;
  void Enqueue(PrefillToDecode msg);
  // Puts the RegisterAck first on the stream and opens it: until then what the core sends (it
  // may send as soon as OnRegister installed this link) waits, so the ack is always first.
  void EnqueueAck(PrefillToDecode ack);
  // Called by the stream when a write finished: starts the next frame or the pending finish.
  void WriteDone(bool ok);
  // No more writes; finish the call once the write in flight (if any) is done.
  void RequestFinish(grpc::Status status);
  void Detach();

 private:
  Mutex mu_;
  PeerStream* stream_ ABSL_GUARDED_BY(mu_);
  std::vector<PrefillToDecode> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool gated_ ABSL_GUARDED_BY(mu_) = true;  // no RegisterAck queued yet
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

class PeerStream final
    : public grpc::ServerBidiReactor<DecodeToPrefillFrame, PrefillToDecodeFrame> {
 public:
  PeerStream(std::shared_ptr<PrefillHandler> handler, std::string peer)
      : handler_(std::move(handler)),
        peer_(std::move(peer)),
        writer_(std::make_shared<StreamWriter>(this)) {
    PdlibTsanRelease(this);
    StartRead(&in_);
  }

  // Only the writer calls these, one write at a time.
  void Write(std::vector<PrefillToDecode> batch) {
    out_.Clear();
    for (auto& m : batch) *out_.add_msgs() = std::move(m);
    PdlibTsanRelease(this);
    StartWrite(&out_);
  }

  void FinishCall(const grpc::Status& status) {
    PdlibTsanRelease(this);
    Finish(status);
  }

  void OnReadDone(bool ok) override {
    PdlibTsanAcquire(this);
    if (!ok) return EndOfStream("stream closed");
    for (const auto& msg : in_.msgs()) {
      if (Status s = Dispatch(msg); !s.ok())
        PDLIB_LOG(kWarning, "peer %s: %s", peer_, s.ToString());
      if (finishing_) return;  // no more reads: the call is being finished
    }
    PdlibTsanRelease(this);
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    PdlibTsanAcquire(this);
    writer_->WriteDone(ok);
  }

  void OnCancel() override { PdlibTsanAcquire(this); }

  void OnDone() override {
    PdlibTsanAcquire(this);
    writer_->Detach();
    if (registered_ && !gone_reported_) {
      handler_->OnDecodeGone(session_, writer_.get(),
                             Status::Unavailable(absl::StrFormat(
                                 "decode session %d at %s: stream ended", session_, peer_)));
    }
    delete this;
  }

 private:
  Status Dispatch(const wire::v1::DecodeToPrefill& msg) {
    switch (msg.msg_case()) {
      case wire::v1::DecodeToPrefill::kRegisterInfo: {
        if (registered_) return Refuse(Status::FailedPrecondition("Register sent twice"));
        auto reg = FromProto(msg.register_info());
        if (!reg.ok()) return Refuse(reg.status());
        RegisterAckMsg ack = handler_->OnRegister(*reg, writer_);
        PrefillToDecode out;
        ToProto(ack, out.mutable_register_ack());
        writer_->EnqueueAck(std::move(out));
        if (!ack.status.ok()) {
          finishing_ = true;
          writer_->RequestFinish(grpc::Status::OK);  // the ack says why
          return ack.status;
        }
        registered_ = true;
        session_ = reg->session;
        tp_rank_ = ack.prefill_tp_rank;
        pp_rank_ = ack.prefill_pp_rank;
        return Status::OK();
      }
      case wire::v1::DecodeToPrefill::kTransferInfo: {
        if (!registered_) return Refuse(Status::FailedPrecondition("TransferInfo before Register"));
        auto info = FromProto(msg.transfer_info(), session_);
        if (!info.ok()) {
          // Decode hears why, from this rank; the prefill room (if the engine made one) fails
          // now rather than waiting out bootstrap_timeout.
          writer_->SendStatus({msg.transfer_info().room(), tp_rank_, pp_rank_, info.status(), {}});
          handler_->OnAbort(msg.transfer_info().room(), session_,
                            "its TransferInfo was refused: " + info.status().ToString());
          return info.status();
        }
        handler_->OnTransferInfo(*info);
        return Status::OK();
      }
      case wire::v1::DecodeToPrefill::kAbort: {
        if (!registered_) return Refuse(Status::FailedPrecondition("Abort before Register"));
        std::string reason = msg.abort().reason().substr(0, 4096);
        handler_->OnAbort(msg.abort().room(), session_, reason);
        return Status::OK();
      }
      case wire::v1::DecodeToPrefill::kPullConnect: {
        if (!registered_) return Refuse(Status::FailedPrecondition("PullConnect before Register"));
        handler_->OnPullConnect(FromProto(msg.pull_connect(), session_));
        return Status::OK();
      }
      case wire::v1::DecodeToPrefill::kReadsDone: {
        if (!registered_) return Refuse(Status::FailedPrecondition("ReadsDone before Register"));
        handler_->OnReadsDone(FromProto(msg.reads_done(), session_));
        return Status::OK();
      }
      case wire::v1::DecodeToPrefill::kHeartbeat: {
        if (!registered_) return Refuse(Status::FailedPrecondition("Heartbeat before Register"));
        auto beat = FromProto(msg.heartbeat(), session_);
        if (!beat.ok()) return beat.status();
        handler_->OnHeartbeat(*beat);
        return Status::OK();
      }
      default: return Refuse(Status::InvalidArgument("empty or unknown message"));
    }
  }

  // A protocol violation ends the stream; after registration the core is told too.
  Status Refuse(Status why) {
    finishing_ = true;
    if (registered_) {
      gone_reported_ = true;
      handler_->OnDecodeGone(session_, writer_.get(), why);
    }
    writer_->RequestFinish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(why.message())));
    return why;
  }

  void EndOfStream(const char* what) {
    finishing_ = true;
    if (registered_ && !gone_reported_) {
      gone_reported_ = true;
      handler_->OnDecodeGone(session_, writer_.get(),
                             Status::Unavailable(absl::StrFormat("decode session %d at %s: %s",
                                                                 session_, peer_, what)));
    }
    writer_->RequestFinish(grpc::Status::OK);
  }

  const std::shared_ptr<PrefillHandler> handler_;
  const std::string peer_;
  const std::shared_ptr<StreamWriter> writer_;
  DecodeToPrefillFrame in_;
  PrefillToDecodeFrame out_;
  // Touched only by reactions, which gRPC serialises for reads; OnDone comes last.
  bool registered_ = false;
  int32_t tp_rank_ = 0, pp_rank_ = 0;  // this prefill rank, as its RegisterAck said
  bool finishing_ = false;
  bool gone_reported_ = false;
  uint64_t session_ = 0;
};

void StreamWriter::SendStatus(const TransferStatusMsg& msg) {
  PrefillToDecode out;
  ToProto(msg, out.mutable_status());
  Enqueue(std::move(out));
}

void StreamWriter::SendDrained(const RoomsDrainedMsg& msg) {
  PrefillToDecode out;
  ToProto(msg, out.mutable_drained());
  Enqueue(std::move(out));
}

void StreamWriter::SendReadReady(const ReadReadyMsg& msg) {
  PrefillToDecode out;
  ToProto(msg, out.mutable_read_ready());
  Enqueue(std::move(out));
}

void StreamWriter::Close(const Status& reason) {
  // The decode side hears the message as the stream's end ("connection lost: ...").
  RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(reason.message())));
}

void StreamWriter::EnqueueAck(PrefillToDecode ack) {
  std::vector<PrefillToDecode> batch;
  PeerStream* stream = nullptr;
  {
    MutexLock lock(&mu_);
    if (stream_ == nullptr || finished_ || finish_requested_) return;
    pending_.insert(pending_.begin(), std::move(ack));
    gated_ = false;
    if (writing_) return;
    writing_ = true;
    batch.swap(pending_);
    stream = stream_;
  }
  stream->Write(std::move(batch));
}

void StreamWriter::Enqueue(PrefillToDecode msg) {
  std::vector<PrefillToDecode> batch;
  PeerStream* stream = nullptr;
  {
    MutexLock lock(&mu_);
    if (stream_ == nullptr || finished_ || finish_requested_) return;
    pending_.push_back(std::move(msg));
    if (writing_ || gated_) return;  // WriteDone (or EnqueueAck) packs it into the next frame
    writing_ = true;
    batch.swap(pending_);
    stream = stream_;
  }
  // Outside the lock: a reaction may run inline.
  stream->Write(std::move(batch));
}

void StreamWriter::WriteDone(bool ok) {
  std::vector<PrefillToDecode> batch;
  PeerStream* stream = nullptr;
  bool finish = false;
  grpc::Status status;
  {
    MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) pending_.clear();  // the stream is broken; the read side reports it
    if (!pending_.empty() && !finish_requested_ && stream_ != nullptr) {
      writing_ = true;
      batch.swap(pending_);
      stream = stream_;
    } else if (finish_requested_ && !finished_ && stream_ != nullptr) {
      finished_ = true;
      finish = true;
      stream = stream_;
      status = finish_status_;
    }
  }
  if (!batch.empty()) stream->Write(std::move(batch));
  if (finish) stream->FinishCall(status);
}

void StreamWriter::RequestFinish(grpc::Status status) {
  PeerStream* stream = nullptr;
  {
    MutexLock lock(&mu_);
    if (finish_requested_) return;
    finish_requested_ = true;
    finish_status_ = status;
    if (writing_ || finished_ || stream_ == nullptr) return;  // WriteDone finishes
    finished_ = true;
    stream = stream_;
  }
  stream->FinishCall(status);
}

void StreamWriter::Detach() {
  MutexLock lock(&mu_);
  stream_ = nullptr;
  pending_.clear();
}

// Ends a stream whose peer failed authentication before anything reaches the handler.
class RejectedStream final
    : public grpc::ServerBidiReactor<DecodeToPrefillFrame, PrefillToDecodeFrame> {
 public:
  explicit RejectedStream(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

class PeerServiceImpl final : public wire::v1::Peer::CallbackService {
 public:
  PeerServiceImpl(std::shared_ptr<PrefillHandler> handler, ControlSecurity security)
      : handler_(std::move(handler)), security_(std::move(security)) {}
  grpc::ServerBidiReactor<DecodeToPrefillFrame, PrefillToDecodeFrame>* Connect(
      grpc::CallbackServerContext* ctx) override {
    if (grpc::Status auth = CheckSecret(security_, *ctx); !auth.ok()) {
      PDLIB_LOG(kWarning, "peer %s: refused: %s", ctx->peer(), auth.error_message());
      return new RejectedStream(std::move(auth));
    }
    return new PeerStream(handler_, ctx->peer());
  }

 private:
  std::shared_ptr<PrefillHandler> handler_;
  const ControlSecurity security_;
};

}  // namespace

struct PeerServer::Rep {
  std::unique_ptr<PeerServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  int32_t port = 0;
  std::once_flag shutdown_once;
};

StatusOr<std::unique_ptr<PeerServer>> PeerServer::Start(const PeerServerOptions& options,
                                                        std::shared_ptr<PrefillHandler> handler) {
  if (options.host.empty()) return Status::InvalidArgument("peer server: empty listen host");
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument(
        absl::StrFormat("peer server: port %d out of range", options.port));
  }
  KeepCallbackQueueAlive();
  auto rep = std::make_unique<Rep>();
  auto creds = MakeServerCredentials(options.security);
  if (!creds.ok()) return creds.status().WithPrefix("peer server");
  rep->service = std::make_unique<PeerServiceImpl>(std::move(handler), options.security);
  const int half = static_cast<int>(options.liveness_timeout.count() / 2);
  grpc::ServerBuilder builder;
  std::string address = JoinHostPort(options.host, options.port);
  builder.AddListeningPort(address, *creds, &rep->port);
  builder.RegisterService(rep->service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Keepalive: a silent decode is dropped after about liveness_timeout; decode pings as often.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, half);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, half);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, half / 4);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  rep->server = builder.BuildAndStart();
  if (rep->server == nullptr || rep->port == 0) {
    return Status::Unavailable("peer server: cannot listen on " + address +
                               " (address in use or not local?)");
  }
  return std::unique_ptr<PeerServer>(new PeerServer(std::move(rep)));
}

PeerServer::PeerServer(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

PeerServer::~PeerServer() { Shutdown(); }

void PeerServer::Shutdown() {
  std::call_once(rep_->shutdown_once, [this] {
    // Cancels every stream at once (decode sees them break), then waits for the reactors.
    rep_->server->Shutdown(std::chrono::system_clock::now());
    rep_->server->Wait();
  });
}

int32_t PeerServer::port() const { return rep_->port; }

}  // namespace control
}  // namespace v1
}  // namespace pdlib
