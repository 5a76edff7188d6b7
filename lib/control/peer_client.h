// PeerClient: decode's end of the stream to one prefill rank, as the protocol core's
// PrefillLink. Register() sends the Register message and waits (bounded) for the RegisterAck;
// afterwards TransferInfo and Abort are queued and packed into frames, and TransferStatus
// messages are handed to the DecodeHandler. When the stream breaks, the handler hears
// OnPrefillGone once (unless Close() came first).
//
// Thread-safe. The stream object lives until gRPC is done with it; this object may go first.
#ifndef PDLIB_LIB_CONTROL_PEER_CLIENT_H_
#define PDLIB_LIB_CONTROL_PEER_CLIENT_H_

#include <chrono>
#include <memory>
#include <string>

#include "lib/control/security.h"
#include "lib/core/control_messages.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

struct PeerClientOptions {
  std::string host;
  int32_t port = 0;
  std::string key;  // how the handler names this prefill rank
  std::chrono::milliseconds liveness_timeout{5000};
  std::chrono::milliseconds connect_timeout{5000};  // bounds Register()
  ControlSecurity security;                         // shared secret and TLS (security.h)
};

class PeerClient : public PrefillLink {
 public:
  // Opens the stream (no network wait). Register() must be the first call.
  static StatusOr<std::shared_ptr<PeerClient>> Open(const PeerClientOptions& options,
                                                    std::weak_ptr<DecodeHandler> handler);
  ~PeerClient() override;

  RegisterAckMsg Register(const RegisterMsg& msg) override;
  void SendTransferInfo(const TransferInfoMsg& msg) override;
  void SendAbort(uint64_t room, uint64_t session, const std::string& reason) override;
  void SendPullConnect(const PullConnectMsg& msg) override;
  void SendReadsDone(const ReadsDoneMsg& msg) override;
  void SendHeartbeat(const HeartbeatMsg& msg) override;
  // Ends the stream; the handler is not told. Idempotent.
  void Close() override;
  bool Broken() const override;

  struct State;

 private:
  explicit PeerClient(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_PEER_CLIENT_H_
