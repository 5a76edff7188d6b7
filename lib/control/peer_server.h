// PeerServer: the Peer service of one prefill rank (DESIGN "Control plane"). Every decode rank
// that receives KV from this rank opens one bidirectional stream; the stream carries
// Register/RegisterAck once, then TransferInfo and Abort one way and TransferStatus the other,
// and its end is the liveness signal: when it breaks, every room bound to it fails.
//
// Handlers only parse, validate and hand messages to the PrefillHandler; writes are queued and
// packed into frames. Owned by the prefill KVManager; thread-safe.
#ifndef PDLIB_LIB_CONTROL_PEER_SERVER_H_
#define PDLIB_LIB_CONTROL_PEER_SERVER_H_

#include <chrono>
#include <memory>
#include <string>

#include "lib/control/security.h"
#include "lib/core/control_messages.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

struct PeerServerOptions {
  std::string host = "127.0.0.1";
  int32_t port = 0;  // 0 picks a free port
  // Keepalive pings every liveness_timeout / 2; a peer silent for liveness_timeout is dropped.
  std::chrono::milliseconds liveness_timeout{5000};
  ControlSecurity security;  // shared secret and TLS (security.h)
};

class PeerServer {
 public:
  static StatusOr<std::unique_ptr<PeerServer>> Start(const PeerServerOptions& options,
                                                     std::shared_ptr<PrefillHandler> handler);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  // Ends every stream (decode sees them break) and stops listening. Idempotent.
  void Shutdown();
  int32_t port() const;

 private:
  struct Rep;
  explicit PeerServer(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_PEER_SERVER_H_
