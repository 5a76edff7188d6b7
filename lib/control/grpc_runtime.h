// Workarounds for Debian's gRPC 1.51 callback-API runtime, in one place.
//
// gRPC runs callback-API reactions on a process-wide "callback alternative" completion queue
// with its own threads, reference-counted by the channels and servers that use it. When the last
// user goes away, gRPC shuts that queue down; if a new user (a reconnecting channel, a restarted
// server) arrives meanwhile, or the release happens on one of the queue's own threads, gRPC 1.51
// aborts (`grpc_cq_internal_unref ... prior > 0`, a double free under ASan; grpc/grpc#32584).
// pdlib hits exactly that when a prefill peer dies and decode drops its last channel.
#ifndef PDLIB_LIB_CONTROL_GRPC_RUNTIME_H_
#define PDLIB_LIB_CONTROL_GRPC_RUNTIME_H_

#include <memory>

namespace pdlib {
inline namespace v1 {
namespace control {

// Holds one reference to gRPC's callback queue for the life of the process, so it is never shut
// down and restarted. Idempotent; call before creating any callback-API channel or server.
void KeepCallbackQueueAlive();

// Drops `object` on a pdlib thread instead of the caller's: reactions must not destroy a
// channel on one of gRPC's callback threads.
void ReleaseLater(std::shared_ptr<void> object);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_GRPC_RUNTIME_H_
