// The verbs backend's blobs, as they travel in the control plane's Register / RegisterAck
// messages. Pure encode/decode: every field that comes from a peer is checked here before any of
// it reaches a verbs call, and each error names the field, its value and the allowed range.
//
//   endpoint blob (target -> initiator, in Register): the target's RC QPs, one per device
//   reply blob (initiator -> target, in RegisterAck): the initiator's QPs, one per target QP;
//                RC QPs are connected from both ends, which is what the reply is for
//   key blob (per registered region): the region's rkey on each of the owner's devices
//
// Layout, little-endian: u32 magic, u16 version, u16 count, then `count` fixed-size entries.
// A QP entry: u32 qp_num, u32 psn, u16 lid, u8 mtu (enum ibv_mtu), u8 flags (bit 0: global,
// i.e. RoCE / GRH needed), u8 port, u8 rd_atomic (version 2), 2 reserved zero bytes, 16-byte
// GID. A key entry: u32 rkey.
#ifndef PDLIB_BACKENDS_VERBS_VERBS_WIRE_H_
#define PDLIB_BACKENDS_VERBS_VERBS_WIRE_H_

#include <array>
#include <cstdint>
#include <vector>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

inline constexpr uint32_t kEndpointMagic = 0x45564450;  // "PDVE"
inline constexpr uint32_t kReplyMagic = 0x52564450;     // "PDVR"
inline constexpr uint32_t kKeyMagic = 0x4b564450;       // "PDVK"
// Version 2: QP entries carry rd_atomic (RDMA reads, issue #29). Version 3: an entry of all zero
// bytes is a device (rail) without a QP, its port not ACTIVE when the connection was made.
inline constexpr uint16_t kWireVersion = 3;

// How the peer reaches one RC QP.
struct QpAddress {
  uint32_t qp_num = 0;  // 24 bits
  uint32_t psn = 0;     // 24 bits: the first packet sequence number the QP sends
  uint16_t lid = 0;     // InfiniBand: the port's LID; RoCE: 0
  uint8_t mtu = 0;      // enum ibv_mtu: 1 (256 bytes) .. 5 (4096 bytes)
  bool global = false;  // RoCE (or a routed IB fabric): address by GID with a GRH
  uint8_t port = 0;
  // The responder resources (max_dest_rd_atomic) the QP was given: how many RDMA reads the
  // peer's side of the pair may have outstanding on it. 1 .. 255.
  uint8_t rd_atomic = 1;
  std::array<uint8_t, 16> gid{};
  friend bool operator==(const QpAddress&, const QpAddress&) = default;
  // The entry of a rail that has no QP in this connection (encoded as zero bytes).
  static QpAddress Absent() {
    QpAddress none;
    none.rd_atomic = 0;
    return none;
  }
  bool absent() const { return qp_num == 0; }
};

spi::Blob EncodeQpAddresses(uint32_t magic, const std::vector<QpAddress>& qps);
// `what` names the blob in errors ("endpoint", "reply").
StatusOr<std::vector<QpAddress>> DecodeQpAddresses(const spi::Blob& blob, uint32_t magic,
                                                   const char* what);

spi::Blob EncodeKeys(const std::vector<uint32_t>& rkeys);
StatusOr<std::vector<uint32_t>> DecodeKeys(const spi::Blob& blob);

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_VERBS_VERBS_WIRE_H_
