// Opening RDMA devices and setting up RC queue pairs on them: the verbs calls that do not belong
// to the data path. Device selection follows verbs.devices (or nic_names), else the first device
// with an active port; the GID index follows verbs.gid_index, else the first RoCE v2 entry with an
// IPv4-mapped address. Each device gets its own protection domain, completion channel and CQ.
//
// Threads: a Device is immutable after OpenDevices except through the verbs calls on its handles,
// which libibverbs makes thread-safe; the transport's progress thread is the only one that polls
// its CQ and posts to its QPs.
#ifndef PDLIB_BACKENDS_VERBS_VERBS_DEVICE_H_
#define PDLIB_BACKENDS_VERBS_VERBS_DEVICE_H_

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/verbs/verbs_handles.h"
#include "backends/verbs/verbs_options.h"
#include "backends/verbs/verbs_wire.h"
#include "backends/verbs/verbs_wr.h"
#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

struct Device {
  std::string name;  // "rxe0"
  uint8_t port = 1;
  int32_t gid_index = 0;
  std::array<uint8_t, 16> gid{};
  uint16_t lid = 0;
  bool global = false;  // RoCE: packets carry a GRH, peers are addressed by GID
  // Soft-RoCE (rdma_rxe, vendor id 0xffffff), which treats RC retry_cnt 7 as "retry forever"
  // (the spec gives that meaning to rnr_retry 7 only): see RcRetryCount.
  bool soft_roce = false;
  ibv_mtu active_mtu = IBV_MTU_1024;
  WrLimits limits;
  WrLimits read_limits;  // limits with max_sge_rd: an RDMA READ's SGE list is its destination
  // RDMA READ depths, each the device's limit within [1, 255]: what this side's QPs accept as
  // responder (max_qp_rd_atom, set as max_dest_rd_atomic at RTR and sent to the peer) and
  // keep outstanding as requester (max_qp_init_rd_atom, bounding max_rd_atomic at RTS).
  uint32_t responder_depth = 1;
  uint32_t initiator_depth = 1;
  uint32_t sq_depth = 0;  // verbs.sq_depth clamped to the device's max_qp_wr
  uint32_t cq_depth = 0;  // the CQ's real size
  // Teardown runs bottom-up: the CQ, then its channel, the PD, and the context last.
  ContextPtr context;
  PdPtr pd;
  CompChannelPtr channel;
  CqPtr cq;

  std::string label() const { return name + ":" + std::to_string(port); }
};

// Opens the devices `options` selects; errors say what exists when nothing fits.
StatusOr<std::vector<std::unique_ptr<Device>>> OpenDevices(const VerbsOptions& options);

// Names of the RDMA devices present, for messages ("none" when there are none).
std::string ListDeviceNames();

// OK when `device`'s port is ACTIVE now (asked at every connection: a rail whose link went down
// since the transport opened it gets no QP), else why not.
Status PortActive(const Device& device);
// An RC QP on `device` (send queue of device.sq_depth), moved to INIT with remote write and
// read access.
StatusOr<QpPtr> CreateRcQp(Device& device);
// How a peer reaches `qp`, with `psn` as the first sequence number it will send.
QpAddress LocalAddress(const Device& device, const ibv_qp& qp, uint32_t psn);
// The RC retry_cnt set on `device`'s QPs: verbs.retry_cnt, except 6 for 7 on Soft-RoCE, so that
// writes to a dead or fenced peer fail there too instead of being retried forever.
uint8_t RcRetryCount(const Device& device, const VerbsOptions& options);
// INIT -> RTR -> RTS towards `remote`, starting at `local_psn`; responder resources
// device.responder_depth, initiator depth ReadDepth(device.initiator_depth, remote.rd_atomic).
// Errors name the step.
Status ConnectRcQp(ibv_qp* qp, const Device& device, const QpAddress& remote, uint32_t local_psn,
                   const VerbsOptions& options);
// RESET -> INIT on `device`, as CreateRcQp leaves a new QP.
Status MoveToInit(ibv_qp* qp, const Device& device);
// Any state -> RESET (outstanding requests are dropped) -> INIT -> RTR -> RTS again, towards the
// same `remote` from the same `local_psn`: a standby QP whose probe failed (see VerbsTransport).
Status ResetRcQp(ibv_qp* qp, const Device& device, const QpAddress& remote, uint32_t local_psn,
                 const VerbsOptions& options);

// Registers `region` on `device` for local access and remote writes and reads. Host memory uses
// ibv_reg_mr; CUDA memory uses ibv_reg_dmabuf_mr when pdlib is built with CUDA, else (or when
// the dma-buf export fails) ibv_reg_mr through a peer-memory driver (nvidia_peermem).
StatusOr<MrPtr> RegisterRegion(Device& device, const spi::MemoryRegion& region);
// Whether CUDA memory can be registered at all (dma-buf support compiled in, or nvidia_peermem
// loaded).
bool CudaRegistrationPossible();

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_VERBS_VERBS_DEVICE_H_
