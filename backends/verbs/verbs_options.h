// The verbs backend's settings, parsed from TransportOptions (KVManagerOptions::backend_options
// and nic_names). Pure: no device is touched, so every rule is unit-tested on any host.
//
// Backend options (all optional):
//   verbs.devices            comma-separated devices to use, each NAME or NAME:PORT
//                            ("mlx5_0,mlx5_1", "rxe0:1"); TransportOptions::nic_names is used
//                            when this is absent; default: the RDMA devices closest to the KV
//                            pool (same PCIe switch, else same NUMA node; lib/rails, read from
//                            sysfs), each on its first active port, else (no device is on PCI:
//                            Soft-RoCE) the first device with an active port.
//                            Several devices: every region is registered on each, one RC QP per
//                            peer per device, and the layers (local regions) are spread over them.
//   verbs.gid_index          GID table index for RoCE; default "auto": the first RoCE v2 entry
//                            holding an IPv4-mapped address, else the first RoCE v2 entry, else 0
//                            (InfiniBand ports address by LID and ignore it)
//   verbs.sq_depth           send-queue depth of each QP, in work requests (default 512): the
//                            bound on writes in flight per QP; clamped to the device's max_qp_wr
//   verbs.cq_depth           completion-queue depth per device (default 16384); also bounds the
//                            work requests in flight over all QPs of the device, so that even a
//                            failing QP, which completes every request, cannot overrun it
//   verbs.signal_every       request a completion at least every N work requests (default 32);
//                            the last request of each batch is always signalled
//   verbs.max_sge            scatter-gather entries per work request (default: the device's
//                            max_sge); lower it to test or to trade gathers for requests
//   verbs.max_message_bytes  longest RDMA WRITE (default: the device's max_msg_sz); longer
//                            writes are split
//   verbs.max_chain          work requests handed to one ibv_post_send call (default 64)
//   verbs.busy_poll_us       how long the progress thread polls the CQs before it sleeps on the
//                            completion channels (default 20)
//   verbs.timeout            RC local ACK timeout exponent: 4.096 us * 2^N (default 14, ~67 ms)
//   verbs.retry_cnt          RC transport retries before a write fails (default 7): with
//                            verbs.timeout this bounds how long a dead or fenced peer takes to
//                            be noticed (~0.5 s at the defaults). Soft-RoCE (rxe) would retry
//                            forever at 7, so 7 is used as 6 there
//   verbs.traffic_class      IP traffic class / DSCP<<2 of RoCE packets (default 0)
//   verbs.rail_stall_ms      a QP with requests outstanding and no completion for this long
//                            fails as a dead rail (default 3000; 0: never)
//   verbs.rail_retry_ms      a rail (device) whose QP failed while others lived is probed
//                            through its standby QP this often (default 1000) and rejoins when a
//                            probe is answered; new connections leave it out for this long
//   verbs.sysfs_root         where the topology is read (default /sys; tests point it at a tree)
#ifndef PDLIB_BACKENDS_VERBS_VERBS_OPTIONS_H_
#define PDLIB_BACKENDS_VERBS_VERBS_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

// At most this many devices per transport (and QPs per peer): the blobs are sized by it.
inline constexpr uint32_t kMaxDevices = 16;

struct DeviceSpec {
  std::string name;
  uint8_t port = 0;  // 0: the first active port
};

struct VerbsOptions {
  std::vector<DeviceSpec> devices;  // empty: the first device with an active port
  int32_t gid_index = -1;           // -1: auto
  uint32_t sq_depth = 512;
  uint32_t cq_depth = 16384;
  uint32_t signal_every = 32;
  uint32_t max_sge = 0;            // 0: the device's
  uint64_t max_message_bytes = 0;  // 0: the device's
  uint32_t max_chain = 64;
  uint32_t busy_poll_us = 20;
  uint8_t timeout = 14;
  uint8_t retry_cnt = 7;
  uint8_t traffic_class = 0;
  uint32_t rail_stall_ms = 3000;
  uint32_t rail_retry_ms = 1000;
  std::string sysfs_root = "/sys";
};

// Parses and checks the "verbs.*" options; keys without that prefix belong to others and are
// ignored; an unknown "verbs.*" key is an error, so typos do not pass silently.
StatusOr<VerbsOptions> ParseVerbsOptions(const spi::TransportOptions& options);

// The devices to use when neither verbs.devices nor nic_names names them: the RDMA devices
// lib/rails ranks closest to the KV pool (options.memory_*), read under options' sysfs_root;
// empty when none is on PCI (the caller then takes the first device with an active port).
// `why` gets one line saying what was chosen and how close it is, for the log.
StatusOr<std::vector<DeviceSpec>> DevicesByTopology(const VerbsOptions& options,
                                                    const spi::TransportOptions& transport,
                                                    std::string* why);

// "mlx5_0,mlx5_1:2" -> devices; errors name the bad entry.
StatusOr<std::vector<DeviceSpec>> ParseDeviceList(const std::string& text);

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_VERBS_VERBS_OPTIONS_H_
