#include "lib/rails/rails.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <system_error>
#include <tuple>

namespace pdlib {
inline namespace v1 {
namespace rails {
namespace {

namespace fs = std::filesystem;

// Linux caps NUMA nodes at 2^CONFIG_NODES_SHIFT <= 1024; 4096 leaves room without accepting
// garbage.
constexpr int kMaxNumaNode = 4095;
// IB_DEVICE_NAME_MAX; interface names are shorter still (IFNAMSIZ).
constexpr size_t kMaxDeviceName = 64;

bool IsHex(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isxdigit(static_cast<unsigned char>(c)) != 0;
  });
}

// "0000:01:00.0" (a domain of 4 to 8 hex digits, as sysfs names PCI functions).
bool IsPciFunction(std::string_view s) {
  const size_t dot = s.rfind('.');
  if (dot == std::string_view::npos || s.size() - dot != 2) return false;
  const char fn = s[dot + 1];
  if (fn < '0' || fn > '7') return false;
  const std::string_view head = s.substr(0, dot);  // DDDD:BB:DD
  const size_t c2 = head.rfind(':');
  if (c2 == std::string_view::npos) return false;
  const size_t c1 = head.rfind(':', c2 - 1);
  if (c1 == std::string_view::npos || c2 == 0) return false;
  const std::string_view domain = head.substr(0, c1), bus = head.substr(c1 + 1, c2 - c1 - 1),
                         dev = head.substr(c2 + 1);
  return IsHex(domain) && domain.size() >= 4 && domain.size() <= 8 && IsHex(bus) &&
         bus.size() == 2 && IsHex(dev) && dev.size() == 2;
}

// "pci0000:00": a PCI host bridge (root complex).
bool IsPciHostBridge(std::string_view s) {
  if (!s.starts_with("pci")) return false;
  s.remove_prefix(3);
  const size_t colon = s.find(':');
  return colon != std::string_view::npos && colon >= 4 && IsHex(s.substr(0, colon)) &&
         s.size() - colon - 1 == 2 && IsHex(s.substr(colon + 1));
}

std::string Quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

// The contents of a small sysfs file, without the trailing newline; nullopt when it cannot be
// read (missing, a directory, no permission).
std::optional<std::string> ReadSmallFile(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string text;
  char buf[256];
  in.read(buf, sizeof(buf));
  text.assign(buf, static_cast<size_t>(in.gcount()));
  if (in.bad()) return std::nullopt;
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

// The NUMA node in `path` (a sysfs numa_node file): -1 when the file is missing or unreadable,
// or holds -1; DataLoss when it holds something else than a node number.
StatusOr<int> ReadNumaNode(const fs::path& path) {
  const std::optional<std::string> text = ReadSmallFile(path);
  if (!text) return -1;
  int node = 0;
  const char* end = text->data() + text->size();
  auto [p, ec] = std::from_chars(text->data(), end, node);
  if (text->empty() || ec != std::errc() || p != end || node < -1 || node > kMaxNumaNode) {
    std::error_code path_ec;
    const fs::path real = fs::weakly_canonical(path, path_ec);  // the device's own directory
    return Status::DataLoss((path_ec ? path : real).string() + " holds " +
                            Quoted(text->substr(0, 40)) + ", not a NUMA node (an integer in [-1, " +
                            std::to_string(kMaxNumaNode) + "])");
  }
  return node;
}

// The PCI chain of the device whose sysfs directory (or a link to it) is `dir`: the components
// of its real path under <root>/devices from the host bridge down, {"pci0000:00",
// "0000:00:01.0", ...}. Empty when it is not a PCI device (virtual, platform) or the path cannot
// be resolved.
std::vector<std::string> PciPathOf(const fs::path& root, const fs::path& dir) {
  std::error_code ec;
  const fs::path devices = fs::canonical(root / "devices", ec);
  if (ec) return {};
  const fs::path real = fs::canonical(dir, ec);
  if (ec) return {};
  const fs::path rel = real.lexically_relative(devices);
  if (rel.empty() || *rel.begin() == "..") return {};
  std::vector<std::string> chain;
  for (const fs::path& part : rel) {
    const std::string s = part.string();
    if (chain.empty()) {
      if (!IsPciHostBridge(s)) return {};
    } else if (!IsPciFunction(s) && !IsPciHostBridge(s)) {
      break;  // below the last PCI function (e.g. ".../0000:01:00.0/net/eth0")
    }
    chain.push_back(s);
  }
  // A chain of only the host bridge names no device.
  if (chain.size() < 2 || !IsPciFunction(chain.back())) return {};
  return chain;
}

// How many PCI bridges the two devices share below the host bridge: the length of the common
// prefix of their chains, not counting host bridges nor either device itself.
int SharedBridges(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  if (a.empty() || b.empty()) return 0;
  const size_t limit = std::min(a.size(), b.size()) - 1;  // never the devices themselves
  int shared = 0;
  for (size_t i = 0; i < limit && a[i] == b[i]; ++i) {
    if (IsPciFunction(a[i])) ++shared;
  }
  return shared;
}

std::string_view ClassDir(NicKind kind) { return kind == NicKind::kRdma ? "infiniband" : "net"; }

// A device name as sysfs could hold it: 1 to 64 printable characters, no '/', not "." or "..".
bool IsValidDeviceName(std::string_view name) {
  if (name.empty() || name.size() > kMaxDeviceName || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isgraph(static_cast<unsigned char>(c)) != 0 && c != '/' && c != ':' && c != ',';
  });
}

// The names of the entries of `dir`, sorted; empty when it does not exist.
std::vector<std::string> ListDir(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string JoinNames(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// One NIC's topology from <root>/class/<kind>/<name>; `has_device` false for a virtual one.
struct ReadNic {
  NicTopology topology;
  bool has_device = false;
};

StatusOr<ReadNic> ReadNicTopology(const fs::path& root, NicKind kind, const std::string& name) {
  ReadNic nic;
  nic.topology.name = name;
  const fs::path device = root / "class" / ClassDir(kind) / name / "device";
  std::error_code ec;
  nic.has_device = fs::exists(device, ec);
  if (!nic.has_device) return nic;
  nic.topology.pci_path = PciPathOf(root, device);
  StatusOr<int> numa = ReadNumaNode(device / "numa_node");
  if (numa.ok() && *numa == -1 && !nic.topology.pci_path.empty()) {
    // A device below its PCI function (virtio-net: ".../0000:00:05.0/virtio1") has no node of
    // its own: the function's.
    fs::path function = root / "devices";
    for (const std::string& part : nic.topology.pci_path) function /= part;
    numa = ReadNumaNode(function / "numa_node");
  }
  if (!numa.ok()) return numa.status();
  nic.topology.numa_node = *numa;
  return nic;
}

Rail MakeRail(const NicTopology& nic, Affinity affinity) {
  Rail rail;
  rail.name = nic.name;
  rail.affinity = affinity;
  rail.pci_address = nic.pci_path.empty() ? "" : nic.pci_path.back();
  rail.numa_node = nic.numa_node;
  return rail;
}

}  // namespace

std::string_view NicKindName(NicKind kind) {
  return kind == NicKind::kRdma ? "RDMA device" : "network interface";
}

std::string_view AffinityName(Affinity affinity) {
  switch (affinity) {
    case Affinity::kExplicit: return "explicit";
    case Affinity::kSamePcieSwitch: return "same PCIe switch";
    case Affinity::kSameNuma: return "same NUMA node";
    case Affinity::kAny: return "any";
  }
  return "?";
}

StatusOr<std::string> NormalizePciAddress(std::string_view address) {
  std::string s;
  for (char c : address) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // Without a domain: domain 0.
  if (std::count(s.begin(), s.end(), ':') == 1) s = "0000:" + s;
  const size_t colon = s.find(':');
  std::string domain = colon == std::string::npos ? "" : s.substr(0, colon);
  // nvidia-smi prints 8 domain digits; sysfs 4 (more only for domains above 0xffff).
  while (domain.size() > 4 && domain[0] == '0') domain.erase(0, 1);
  if (colon != std::string::npos) s = domain + s.substr(colon);
  if (!IsPciFunction(s)) {
    return Status::InvalidArgument("PCI address " + Quoted(address) +
                                   " is not [DOMAIN:]BUS:DEVICE.FUNCTION (e.g. 0000:03:00.0)");
  }
  return s;
}

RailChoice RankRails(const MemoryTopology& memory, std::vector<NicTopology> nics) {
  struct Ranked {
    Affinity affinity;
    int shared_bridges;
    const NicTopology* nic;
  };
  std::vector<Ranked> ranked;
  ranked.reserve(nics.size());
  for (const NicTopology& nic : nics) {
    const int shared = SharedBridges(memory.pci_path, nic.pci_path);
    Affinity affinity = Affinity::kAny;
    if (shared > 0) {
      affinity = Affinity::kSamePcieSwitch;
    } else if (memory.numa_node >= 0 && nic.numa_node == memory.numa_node) {
      affinity = Affinity::kSameNuma;
    }
    ranked.push_back({affinity, shared, &nic});
  }
  // Closest tier first; inside the switch tier the deeper shared bridge first; then by name.
  std::sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    return std::tuple(a.affinity, -a.shared_bridges, std::string_view(a.nic->name)) <
           std::tuple(b.affinity, -b.shared_bridges, std::string_view(b.nic->name));
  });
  RailChoice choice;
  for (const Ranked& r : ranked) {
    Rail rail = MakeRail(*r.nic, r.affinity);
    const bool best_tier = r.affinity == ranked.front().affinity;
    (best_tier ? choice.rails : choice.others).push_back(std::move(rail));
  }
  return choice;
}

StatusOr<RailChoice> SelectRails(const RailQuery& query) {
  const fs::path root = query.sysfs_root.empty() ? fs::path("/sys") : fs::path(query.sysfs_root);

  // The memory.
  MemoryTopology memory;
  if (!query.memory.pci_address.empty()) {
    StatusOr<std::string> address = NormalizePciAddress(query.memory.pci_address);
    if (!address.ok()) return address.status().WithPrefix("KV pool memory");
    const fs::path dir = root / "bus" / "pci" / "devices" / *address;
    std::error_code ec;
    if (!fs::exists(dir, ec)) {
      return Status::NotFound("KV pool memory: no PCI device " + *address + " under " +
                              (root / "bus" / "pci" / "devices").string());
    }
    memory.pci_path = PciPathOf(root, dir);
    StatusOr<int> numa = ReadNumaNode(dir / "numa_node");
    if (!numa.ok()) return numa.status();
    memory.numa_node = *numa;
  } else {
    if (query.memory.numa_node < -1 || query.memory.numa_node > kMaxNumaNode) {
      return Status::InvalidArgument("KV pool memory: NUMA node " +
                                     std::to_string(query.memory.numa_node) + " is not in [-1, " +
                                     std::to_string(kMaxNumaNode) + "]");
    }
    memory.numa_node = query.memory.numa_node;
  }

  // Every device of the kind that has a `device` link: the candidates by topology.
  const fs::path class_dir = root / "class" / ClassDir(query.kind);
  const std::vector<std::string> present = ListDir(class_dir);
  std::vector<NicTopology> candidates;
  for (const std::string& name : present) {
    StatusOr<ReadNic> nic = ReadNicTopology(root, query.kind, name);
    if (!nic.ok()) return nic.status();
    if (nic->has_device) candidates.push_back(std::move(nic->topology));
  }
  if (query.explicit_names.empty()) return RankRails(memory, std::move(candidates));

  // The explicit list: each entry checked, in the caller's order.
  RailChoice choice;
  std::set<std::string, std::less<>> seen_devices;
  for (const std::string& entry : query.explicit_names) {
    std::string_view name = entry;
    std::string_view port;
    if (const size_t colon = name.find(':'); colon != std::string_view::npos) {
      port = name.substr(colon + 1);
      name = name.substr(0, colon);
      if (query.kind != NicKind::kRdma) {
        return Status::InvalidArgument("nic_names: " + Quoted(entry) +
                                       ": a network interface takes no port (NAME only)");
      }
      unsigned value = 0;
      auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
      if (port.empty() || ec != std::errc() || p != port.data() + port.size() || value < 1 ||
          value > 255) {
        return Status::InvalidArgument("nic_names: " + Quoted(entry) +
                                       " has a bad port (expected NAME or NAME:PORT, PORT 1-255)");
      }
    }
    if (!IsValidDeviceName(name)) {
      return Status::InvalidArgument(
          "nic_names: " + Quoted(entry) +
          " is not a device name (1 to 64 printable characters, no '/', ',' or ':', not . or ..)");
    }
    // One rail per device: a second port of one NIC shares its PCIe link.
    if (!seen_devices.insert(std::string(name)).second) {
      return Status::InvalidArgument("nic_names: " + Quoted(entry) + " names device " +
                                     Quoted(name) + " a second time");
    }
    const std::string device(name);
    if (std::find(present.begin(), present.end(), device) == present.end()) {
      return Status::NotFound("nic_names: " + Quoted(device) + " is not an " +
                              std::string(NicKindName(query.kind)) + " under " +
                              class_dir.string() + " (there: " + JoinNames(present) + ")");
    }
    if (!port.empty()) {
      const fs::path ports = class_dir / device / "ports";
      std::error_code ec;
      if (!fs::is_directory(ports / std::string(port), ec)) {
        return Status::NotFound("nic_names: " + Quoted(device) + " has no port " +
                                std::string(port) + " (ports: " + JoinNames(ListDir(ports)) + ")");
      }
    }
    StatusOr<ReadNic> nic = ReadNicTopology(root, query.kind, device);
    if (!nic.ok()) return nic.status();
    Rail rail = MakeRail(nic->topology, Affinity::kExplicit);
    rail.name = entry;
    choice.rails.push_back(std::move(rail));
  }
  // The rest, ranked, for failover.
  std::set<std::string> named;
  for (const Rail& rail : choice.rails) named.insert(rail.name.substr(0, rail.name.find(':')));
  std::erase_if(candidates, [&](const NicTopology& nic) { return named.count(nic.name) > 0; });
  RailChoice rest = RankRails(memory, std::move(candidates));
  choice.others = std::move(rest.rails);
  choice.others.insert(choice.others.end(), std::make_move_iterator(rest.others.begin()),
                       std::make_move_iterator(rest.others.end()));
  return choice;
}

}  // namespace rails
}  // namespace v1
}  // namespace pdlib
