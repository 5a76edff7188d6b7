#include "lib/control/peer_client.h"

#include <grpcpp/grpcpp.h>

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

using wire::v1::DecodeToPrefill;
using wire::v1::DecodeToPrefillFrame;
using wire::v1::PrefillToDecodeFrame;

namespace {
class ClientStream;
}  // namespace

struct PeerClient::State {
  PeerClientOptions options;
  std::weak_ptr<DecodeHandler> handler;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<wire::v1::Peer::Stub> stub;

  Mutex mu;
  CondVar ack_cv;
  // Kept alive by this pointer and by the stream's own reference until OnDone.
  std::shared_ptr<ClientStream> stream ABSL_GUARDED_BY(mu);
  std::vector<DecodeToPrefill> pending ABSL_GUARDED_BY(mu);
  bool writing ABSL_GUARDED_BY(mu) = false;
  bool closed ABSL_GUARDED_BY(mu) = false;  // by us
  bool broken ABSL_GUARDED_BY(mu) = false;  // by the peer or the network
  bool hold_released ABSL_GUARDED_BY(mu) = false;
  bool registered ABSL_GUARDED_BY(mu) = false;
  std::optional<RegisterAckMsg> ack ABSL_GUARDED_BY(mu);

  void Enqueue(DecodeToPrefill msg);
  void WriteDone(bool ok);
  void ReadSideEnded();
  void OnAck(RegisterAckMsg ack);
  void OnDone(const grpc::Status& status);
  // With mu held: whether the caller must release the stream's hold now.
  bool TakeHoldRelease() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (hold_released || writing || !(closed || broken)) return false;
    hold_released = true;
    return true;
  }
};

namespace {

class ClientStream final
    : public grpc::ClientBidiReactor<DecodeToPrefillFrame, PrefillToDecodeFrame> {
 public:
  explicit ClientStream(std::shared_ptr<PeerClient::State> state) : state_(std::move(state)) {}

  void Start(std::shared_ptr<ClientStream> self) {
    self_ = std::move(self);
    AttachSecret(state_->options.security, &ctx_);
    state_->stub->async()->Connect(&ctx_, this);
    StartRead(&in_);
    AddHold();  // writes are started from engine threads, outside reactions
    PdlibTsanRelease(this);
    StartCall();
  }

  void Write(std::vector<DecodeToPrefill> batch) {
    out_.Clear();
    for (auto& m : batch) *out_.add_msgs() = std::move(m);
    PdlibTsanRelease(this);
    StartWrite(&out_);
  }

  void Cancel() {
    PdlibTsanRelease(this);
    ctx_.TryCancel();
  }

  void ReleaseHold() {
    PdlibTsanRelease(this);
    RemoveHold();
  }

  void OnReadDone(bool ok) override {
    PdlibTsanAcquire(this);
    if (!ok) return state_->ReadSideEnded();
    for (const auto& msg : in_.msgs()) {
      if (msg.has_register_ack()) {
        state_->OnAck(FromProto(msg.register_ack()));
      } else if (msg.has_status()) {
        auto st = FromProto(msg.status());
        if (!st.ok()) {
          PDLIB_LOG(kWarning, "prefill %s: %s", state_->options.key, st.status().ToString());
          continue;
        }
        // A prefill speaks only for the rank its RegisterAck named: a status for any other rank
        // (which could complete someone else's room) is dropped.
        std::optional<std::pair<int32_t, int32_t>> rank;
        {
          MutexLock lock(&state_->mu);
          if (state_->ack && state_->ack->status.ok()) {
            rank.emplace(state_->ack->prefill_tp_rank, state_->ack->prefill_pp_rank);
          }
        }
        if (!rank || rank->first != st->prefill_tp_rank || rank->second != st->prefill_pp_rank) {
          PDLIB_LOG(kWarning,
                    "prefill %s: dropped a status for room %d from tp %d pp %d: this stream "
                    "registered %s",
                    state_->options.key, st->room, st->prefill_tp_rank, st->prefill_pp_rank,
                    rank ? absl::StrFormat("tp %d pp %d", rank->first, rank->second)
                         : std::string("no rank yet"));
          continue;
        }
        if (auto h = state_->handler.lock()) h->OnStatus(*st);
      } else if (msg.has_drained()) {
        auto drained = FromProto(msg.drained());
        if (!drained.ok()) {
          PDLIB_LOG(kWarning, "prefill %s: %s", state_->options.key, drained.status().ToString());
          continue;
        }
        if (auto h = state_->handler.lock()) h->OnDrained(state_->options.key, *drained);
      } else if (msg.has_read_ready()) {
        auto ready = FromProto(msg.read_ready());
        if (!ready.ok()) {
          PDLIB_LOG(kWarning, "prefill %s: %s", state_->options.key, ready.status().ToString());
          continue;
        }
        // Like a status: only for the rank this stream registered with.
        bool same_rank = false;
        {
          MutexLock lock(&state_->mu);
          same_rank = state_->ack && state_->ack->status.ok() &&
                      state_->ack->prefill_tp_rank == ready->prefill_tp_rank &&
                      state_->ack->prefill_pp_rank == ready->prefill_pp_rank;
        }
        if (!same_rank) {
          PDLIB_LOG(kWarning, "prefill %s: dropped a ReadReady for room %d from tp %d pp %d",
                    state_->options.key, ready->room, ready->prefill_tp_rank,
                    ready->prefill_pp_rank);
          continue;
        }
        if (auto h = state_->handler.lock()) h->OnReadReady(state_->options.key, *ready);
      }
    }
    PdlibTsanRelease(this);
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    PdlibTsanAcquire(this);
    state_->WriteDone(ok);
  }

  void OnDone(const grpc::Status& status) override {
    PdlibTsanAcquire(this);
    state_->OnDone(status);
    // The state owns the channel: never let its last reference drop on a gRPC thread.
    ReleaseLater(std::move(state_));
    self_.reset();  // may destroy this object: nothing after this line
  }

 private:
  std::shared_ptr<PeerClient::State> state_;
  std::shared_ptr<ClientStream> self_;
  grpc::ClientContext ctx_;
  DecodeToPrefillFrame out_;
  PrefillToDecodeFrame in_;
};

}  // namespace

void PeerClient::State::Enqueue(DecodeToPrefill msg) {
  std::vector<DecodeToPrefill> batch;
  std::shared_ptr<ClientStream> s;
  {
    MutexLock lock(&mu);
    if (closed || broken || stream == nullptr) return;  // the room fails through OnPrefillGone
    pending.push_back(std::move(msg));
    if (writing) return;
    writing = true;
    batch.swap(pending);
    s = stream;
  }
  s->Write(std::move(batch));
}

void PeerClient::State::WriteDone(bool ok) {
  std::vector<DecodeToPrefill> batch;
  std::shared_ptr<ClientStream> s;
  bool release = false;
  {
    MutexLock lock(&mu);
    writing = false;
    if (!ok) broken = true;
    if (!pending.empty() && !closed && !broken) {
      writing = true;
      batch.swap(pending);
    } else {
      pending.clear();
      release = TakeHoldRelease();
    }
    s = stream;
  }
  if (!batch.empty()) s->Write(std::move(batch));
  if (release && s) s->ReleaseHold();
}

void PeerClient::State::ReadSideEnded() {
  std::shared_ptr<ClientStream> s;
  bool release = false;
  {
    MutexLock lock(&mu);
    broken = true;
    release = TakeHoldRelease();
    s = stream;
  }
  if (release && s) s->ReleaseHold();
}

void PeerClient::State::OnAck(RegisterAckMsg msg) {
  MutexLock lock(&mu);
  if (ack) return;  // a second ack is a confused peer; the first one counts
  registered = msg.status.ok();
  ack = std::move(msg);
  ack_cv.SignalAll();
}

void PeerClient::State::OnDone(const grpc::Status& status) {
  bool report = false;
  {
    MutexLock lock(&mu);
    broken = true;
    report = registered && !closed;
    stream.reset();
    if (!ack) {
      ack = RegisterAckMsg{};
      ack->status = Status::Unavailable(absl::StrFormat(
          "prefill %s: stream ended before RegisterAck: %s", options.key, status.error_message()));
    }
    ack_cv.SignalAll();
  }
  if (!report) return;
  if (auto h = handler.lock()) {
    std::string why = status.ok() ? "stream closed by prefill" : status.error_message();
    h->OnPrefillGone(options.key, Status::Unavailable("connection lost: " + why));
  }
}

StatusOr<std::shared_ptr<PeerClient>> PeerClient::Open(const PeerClientOptions& options,
                                                       std::weak_ptr<DecodeHandler> handler) {
  if (options.host.empty() || options.port <= 0 || options.port > 65535) {
    return Status::InvalidArgument(
        absl::StrFormat("prefill address '%s' is not host:port", options.key));
  }
  KeepCallbackQueueAlive();
  auto state = std::make_shared<State>();
  state->options = options;
  state->handler = std::move(handler);
  const int half = static_cast<int>(options.liveness_timeout.count() / 2);
  grpc::ChannelArguments args;
  // A channel of its own: after a prefill restart the next connection never reuses a stale
  // subchannel (SPEC R6.2).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, half);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, half);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  auto creds = MakeChannelCredentials(options.security);
  if (!creds.ok()) return creds.status().WithPrefix("connecting to prefill " + options.key);
  state->channel =
      grpc::CreateCustomChannel(JoinHostPort(options.host, options.port), *creds, args);
  state->stub = wire::v1::Peer::NewStub(state->channel);
  auto stream = std::make_shared<ClientStream>(state);
  {
    MutexLock lock(&state->mu);
    state->stream = stream;
  }
  stream->Start(stream);
  return std::shared_ptr<PeerClient>(new PeerClient(std::move(state)));
}

PeerClient::PeerClient(std::shared_ptr<State> state) : state_(std::move(state)) {}

PeerClient::~PeerClient() { Close(); }

RegisterAckMsg PeerClient::Register(const RegisterMsg& msg) {
  DecodeToPrefill out;
  ToProto(msg, out.mutable_register_info());
  state_->Enqueue(std::move(out));
  const auto deadline = std::chrono::steady_clock::now() + state_->options.connect_timeout;
  RegisterAckMsg ack;
  bool timed_out = false;
  {
    MutexLock lock(&state_->mu);
    while (!state_->ack && !state_->closed) {
      auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      state_->ack_cv.WaitFor(&state_->mu, left);
    }
    if (state_->ack) {
      ack = *state_->ack;
    } else {
      timed_out = true;
    }
  }
  if (timed_out) {
    Close();
    ack.status = Status::DeadlineExceeded(absl::StrFormat("prefill %s: no RegisterAck within %d ms",
                                                          state_->options.key,
                                                          state_->options.connect_timeout.count()));
  }
  if (!ack.status.ok()) Close();
  return ack;
}

void PeerClient::SendTransferInfo(const TransferInfoMsg& msg) {
  DecodeToPrefill out;
  ToProto(msg, out.mutable_transfer_info());
  state_->Enqueue(std::move(out));
}

bool PeerClient::Broken() const {
  MutexLock lock(&state_->mu);
  return state_->broken;
}

void PeerClient::SendAbort(uint64_t room, uint64_t session, const std::string& reason) {
  DecodeToPrefill out;
  out.mutable_abort()->set_room(room);
  out.mutable_abort()->set_reason(reason);
  state_->Enqueue(std::move(out));
}

void PeerClient::SendPullConnect(const PullConnectMsg& msg) {
  DecodeToPrefill out;
  ToProto(msg, out.mutable_pull_connect());
  state_->Enqueue(std::move(out));
}

void PeerClient::SendReadsDone(const ReadsDoneMsg& msg) {
  DecodeToPrefill out;
  ToProto(msg, out.mutable_reads_done());
  state_->Enqueue(std::move(out));
}

void PeerClient::SendHeartbeat(const HeartbeatMsg& msg) {
  DecodeToPrefill out;
  ToProto(msg, out.mutable_heartbeat());
  state_->Enqueue(std::move(out));
}

void PeerClient::Close() {
  std::shared_ptr<ClientStream> s;
  bool release = false;
  {
    MutexLock lock(&state_->mu);
    if (state_->closed) return;
    state_->closed = true;
    state_->pending.clear();
    release = state_->TakeHoldRelease();
    s = state_->stream;
    state_->ack_cv.SignalAll();
  }
  if (s) {
    s->Cancel();
    if (release) s->ReleaseHold();
  }
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
