// Which NICs ("rails") a rank moves its KV over (issue #31, SPEC R11.6): an explicit list
// (KVArgs::nic_names) when one is given, else the NICs closest to the KV pool's memory, read from
// sysfs. Closest means, in this order:
//   1. the same PCIe switch: the NIC and the memory's PCI device (a GPU) share a PCI bridge
//      below the host bridge ("../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/..." paths with
//      a common 0000:00:01.0 or deeper); among them, the ones sharing a deeper bridge first;
//   2. the same NUMA node (`device/numa_node` of the NIC; the GPU's, or the host pool's node);
//   3. any NIC (nothing is known that makes one closer than another).
// The rails are the NICs of the best tier that has any, ordered by closeness, then by name; the
// others follow in `RailChoice::others`, in the same order (for failover, or a caller that wants
// more than the closest).
//
// Two layers, so that the rules are tested without a machine's sysfs:
// - RankRails: pure; the NICs and the memory as already read (their PCI paths and NUMA nodes).
// - SelectRails: reads a sysfs tree (any root, so tests write fixture trees under a temporary
//   directory, with symlinks as the kernel makes them) and calls RankRails.
// Only NICs backed by a device (a `device` link: PCI or platform) are candidates by topology;
// virtual interfaces (lo, bridges, veths, bonds, rxe's netdev-less devices) are used only when
// named explicitly. No threads, no state: any thread may call these.
#ifndef PDLIB_LIB_RAILS_RAILS_H_
#define PDLIB_LIB_RAILS_RAILS_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace rails {

// Which class of device a backend drives: RDMA devices (/sys/class/infiniband: verbs, UCX over
// rc/dc) or network interfaces (/sys/class/net: UCX over tcp).
enum class NicKind { kRdma, kNet };
std::string_view NicKindName(NicKind kind);

// Where the KV pool lives: host memory on a NUMA node (-1: unknown), or the memory of a PCI
// device (a GPU), named by its PCI address.
struct MemoryLocation {
  static MemoryLocation Host(int numa_node) { return {numa_node, ""}; }
  // "0000:03:00.0"; the domain may have 4 to 8 hex digits ("00000000:03:00.0", as nvidia-smi
  // prints it) or be left out ("03:00.0").
  static MemoryLocation Pci(std::string address) { return {-1, std::move(address)}; }

  int numa_node = -1;       // host memory only
  std::string pci_address;  // empty: host memory
};

// How close a rail is to the memory.
enum class Affinity {
  kExplicit,        // named by the caller
  kSamePcieSwitch,  // shares a PCI bridge with the memory's device
  kSameNuma,        // on the memory's NUMA node
  kAny,             // nothing known makes it closer
};
std::string_view AffinityName(Affinity affinity);

struct Rail {
  std::string name;  // as the backend takes it: "mlx5_0", "mlx5_0:1", "eth1"
  Affinity affinity = Affinity::kAny;
  std::string pci_address;  // the NIC's PCI function; empty when it has none (virtual, platform)
  int numa_node = -1;       // -1: unknown
};

struct RailChoice {
  std::vector<Rail> rails;   // what to use, closest first
  std::vector<Rail> others;  // every other candidate, closest first
};

// --- The pure part ---

// One NIC as read from sysfs. `pci_path` is the chain of PCI devices from the host bridge down
// to the NIC's function: {"pci0000:00", "0000:00:01.0", "0000:01:00.0", ...}; empty when the NIC
// is not on PCI.
struct NicTopology {
  std::string name;
  std::vector<std::string> pci_path;
  int numa_node = -1;
};

// The memory as read from sysfs: the PCI chain of its device (empty for host memory) and its
// NUMA node (-1: unknown).
struct MemoryTopology {
  std::vector<std::string> pci_path;
  int numa_node = -1;
};

// The rails among `nics` for memory at `memory` (rules at the top of this file). Deterministic:
// the same input gives the same order whatever the order of `nics`. Names must be distinct.
RailChoice RankRails(const MemoryTopology& memory, std::vector<NicTopology> nics);

// --- Reading sysfs ---

struct RailQuery {
  std::string sysfs_root = "/sys";
  MemoryLocation memory{};
  NicKind kind = NicKind::kRdma;
  // KVArgs::nic_names: when not empty, these are the rails, in this order (affinity kExplicit).
  // Each must name a device of `kind` under sysfs_root ("NAME", or "NAME:PORT" for an RDMA
  // device, PORT one of its ports); a device named twice (with any ports) is refused.
  std::vector<std::string> explicit_names{};
};

// The rails for `query`. Errors (each names the file or the entry at fault):
// - InvalidArgument: an explicit name that is malformed or repeated, a malformed PCI address;
// - NotFound: an explicit name that is not a device of that kind, an RDMA port the device does
//   not have, a PCI address with no device under sysfs_root, a sysfs_root without the class
//   directory needed for an explicit list;
// - DataLoss: a numa_node file whose contents are not a NUMA node (an integer in [-1, 4095]).
// A missing or unreadable numa_node file means "unknown" (-1), not an error: platforms without
// NUMA information have none. No NIC at all is an empty choice, not an error.
StatusOr<RailChoice> SelectRails(const RailQuery& query);

// The PCI address in canonical form ("0000:03:00.0", lowercase), or InvalidArgument.
StatusOr<std::string> NormalizePciAddress(std::string_view address);

}  // namespace rails
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_RAILS_RAILS_H_
