// Conversions between the Peer service's wire messages and the plain control messages of
// lib/core/control_messages.h. FromProto validates what a peer can get wrong structurally
// (negative indices, absurd sizes) and says what; range checks against registered buffers are
// the protocol core's job.
#ifndef PDLIB_LIB_CONTROL_PEER_CONVERT_H_
#define PDLIB_LIB_CONTROL_PEER_CONVERT_H_

#include "lib/core/control_messages.h"
#include "lib/proto/pdlib.pb.h"

namespace pdlib {
inline namespace v1 {
namespace control {

void ToProto(const RegisterMsg& in, wire::v1::Register* out);
StatusOr<RegisterMsg> FromProto(const wire::v1::Register& in);

void ToProto(const RegisterAckMsg& in, wire::v1::RegisterAck* out);
RegisterAckMsg FromProto(const wire::v1::RegisterAck& in);

void ToProto(const TransferInfoMsg& in, wire::v1::TransferInfo* out);
// `session` is the stream's registered session, never taken from the message.
StatusOr<TransferInfoMsg> FromProto(const wire::v1::TransferInfo& in, uint64_t session);

void ToProto(const TransferStatusMsg& in, wire::v1::TransferStatus* out);
StatusOr<TransferStatusMsg> FromProto(const wire::v1::TransferStatus& in);

void ToProto(const RoomsDrainedMsg& in, wire::v1::Drained* out);
StatusOr<RoomsDrainedMsg> FromProto(const wire::v1::Drained& in);

// Pull. `session` is the stream's registered session, never taken from the message.
void ToProto(const PullConnectMsg& in, wire::v1::PullConnect* out);
PullConnectMsg FromProto(const wire::v1::PullConnect& in, uint64_t session);
void ToProto(const ReadsDoneMsg& in, wire::v1::ReadsDone* out);
ReadsDoneMsg FromProto(const wire::v1::ReadsDone& in, uint64_t session);
void ToProto(const HeartbeatMsg& in, wire::v1::Heartbeat* out);
StatusOr<HeartbeatMsg> FromProto(const wire::v1::Heartbeat& in, uint64_t session);
void ToProto(const ReadReadyMsg& in, wire::v1::ReadReady* out);
StatusOr<ReadReadyMsg> FromProto(const wire::v1::ReadReady& in);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_PEER_CONVERT_H_
