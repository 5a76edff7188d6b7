// The UCX backend's settings: parsed from TransportOptions::options (KVManagerOptions::
// backend_options) and the environment. Pure: the environment is passed in as a lookup function,
// so precedence and defaults are unit-tested without touching the process environment.
//
// Backend options (all optional):
//   ucx.tls                  UCX_TLS for this transport ("shm", "tcp", "rc_verbs,sm", ...)
//   ucx.net_devices          UCX_NET_DEVICES ("lo", "mlx5_0:1", ...); TransportOptions::nic_names
//                            is used when this is absent
//   ucx.config.<NAME>        any other UCX variable, without the UCX_ prefix
//                            ("ucx.config.TCP_TX_SEG_SIZE" = "64k")
//   ucx.max_inflight_bytes   bytes posted per endpoint and not yet completed (window)
//   ucx.max_inflight_read_bytes  bytes an "am" read has requested per endpoint and not yet
//                            received (the read window: it covers a round trip to the target's
//                            handler and back, where the write window covers a local send)
//   ucx.chunk_bytes          longest single put, get or "am" read request; longer ops are split
//   ucx.busy_poll_us         how long the progress thread spins before it sleeps on the fds
//   ucx.stall_timeout_ms     a peer with outstanding writes and no completion for this long is
//                            declared dead (bounds every wait, also where UCX cannot detect a
//                            dead peer, e.g. shared memory inside one process); 0 disables
//   ucx.flush                "ep" (default) or "worker": how a batch waits for remote completion
//                            of its puts
//   ucx.data_path            "auto" (default), "am" or "put": how writes into this process's
//                            memory travel when it is the target (decode). "am": pdlib's own
//                            active messages, applied by this process after it checked the
//                            address and the sender (a fence drops a cut-off sender's data);
//                            "put": UCX puts (RDMA writes; or emulated by UCX with its own active
//                            messages, or memcpy by the peer into UCX-allocated shared memory).
//                            "auto": "am" unless the context has an RDMA transport (rc/dc), where
//                            puts are one-sided NIC writes. Memory that a peer can map (a pool UCX
//                            allocated, with posix/sysv; any memory with xpmem) and CUDA memory
//                            are always written with puts. See backends/ucx/README.md.
//   ucx.am_chunk_bytes       longest single active message on the "am" path, a write's or a read
//                            reply's (default 32k: one shared-memory segment of pdlib's default
//                            size holds it whole)
//   ucx.rails                network devices, one rail each ("eth0,eth1", "mlx5_0:1,mlx5_1:1"):
//                            every connection gets a worker and an endpoint per rail (rail r's
//                            UCP context has UCX_NET_DEVICES = the r-th device) and pdlib stripes
//                            each batch's "am" traffic (writes, read requests and their replies)
//                            over them, whole ops at a time, to the rail with the most room;
//                            puts and gets, flushes and remote keys use rail 0. Both sides must
//                            list their rails in the same order (rail r talks to rail r; with
//                            different counts, the fewer are used). Not with ucx.net_devices;
//                            takes precedence over TransportOptions::nic_names. Unset: one rail
//                            (UCX's own choice among ucx.net_devices). At most kMaxRails.
//                            "auto": the NICs closest to the KV pool (same PCIe switch, else the
//                            same NUMA node; lib/rails, read from sysfs): network interfaces when
//                            ucx.tls is tcp (and shared memory) only, else RDMA devices (port 1);
//                            nic_names, when given, are the rails. An error when none is found.
//   ucx.sysfs_root           where ucx.rails=auto reads the topology (default /sys; for tests)
//   ucx.rail_stall_ms        with ucx.rails: a rail that carries work (bytes in its windows, or
//                            batches awaiting an ack that sent messages on it) and on which
//                            nothing completed or arrived for this long (a probe is sent on it
//                            halfway) is down: the batches that used it fail with the rail's
//                            name, the others go on over the remaining rails (default 3000;
//                            0: never, a rail's stall is then the connection's). Rail 0 carries
//                            puts and the close handshake: its death fails the connection.
//   ucx.rail_retry_ms        how often a down rail is probed on a fresh endpoint; it rejoins the
//                            stripe when the probe comes back (default 1000)
//
// Precedence for a UCX variable: a backend option > the environment (UCX_<NAME>, read by UCX
// itself) > pdlib's default (UcxDefaults()). pdlib never overrides what the user exported.
#ifndef PDLIB_BACKENDS_UCX_UCX_OPTIONS_H_
#define PDLIB_BACKENDS_UCX_UCX_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "backends/common/backend_options.h"
#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {

// A UCX setting pdlib makes unless the user made a related one (in the environment or as a
// backend option). UCX 1.13 matches a transport's setting by its name inside the transport's own
// table ("TX_SEG_SIZE" for UCX_TCP_TX_SEG_SIZE, "MM_SEG_SIZE" for UCX_POSIX_/UCX_SYSV_SEG_SIZE)
// when it is passed to ucp_config_modify, hence `key` and `user_vars` differ.
struct UcxDefault {
  const char* key;  // passed to ucp_config_modify
  const char* value;
  const char* user_vars;  // comma-separated names (no UCX_ prefix) that mean "the user chose"
  const char* why;
};
std::span<const UcxDefault> UcxDefaults();

enum class FlushMode { kEndpoint, kWorker };
enum class DataPath { kAuto, kAm, kPut };

struct UcxOptions {
  // Applied to this transport's context with ucp_config_modify: NAME (no UCX_ prefix) -> value.
  std::map<std::string, std::string> ucx_config;
  uint64_t max_inflight_bytes = 0;
  uint64_t max_inflight_read_bytes = 0;
  uint64_t chunk_bytes = 0;
  uint32_t busy_poll_us = 0;
  uint32_t stall_timeout_ms = 0;
  FlushMode flush = FlushMode::kEndpoint;
  DataPath data_path = DataPath::kAuto;
  uint64_t am_chunk_bytes = 0;
  // ucx.rails: one device per rail; empty: one rail, as UCX chooses. rails[0] is also the main
  // context's NET_DEVICES (ucx_config).
  std::vector<std::string> rails;
  uint32_t rail_stall_ms = 0;
  uint32_t rail_retry_ms = 0;
};

inline constexpr size_t kMaxRails = 8;

// ucx.rails=auto (see above): the rails for memory at options.memory_*, with UCX_TLS `tls`, read
// under `sysfs_root`.
StatusOr<std::vector<std::string>> AutoRails(const spi::TransportOptions& options,
                                             const std::string& tls, const std::string& sysfs_root);

// The settings of rail `rail`'s context: `options` with UCX_NET_DEVICES = that rail's device.
UcxOptions RailOptions(const UcxOptions& options, size_t rail);

// Returns the value of an environment variable or null (getenv's contract).
using EnvLookup = std::function<const char*(const char* name)>;

// Parses and checks the "ucx.*" options (keys without that prefix belong to others and are
// ignored; an unknown "ucx.*" key is an error, so typos do not pass silently).
StatusOr<UcxOptions> ParseUcxOptions(const spi::TransportOptions& options,
                                     const EnvLookup& getenv_fn);

// "4M", "64k", "1g", "12345" -> bytes (binary units, as UCX spells them); the toolkit's.
using toolkit::ParseByteSize;

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_OPTIONS_H_
