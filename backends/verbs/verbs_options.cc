#include "backends/verbs/verbs_options.h"

#include <cctype>
#include <charconv>
#include <string_view>

#include "backends/common/backend_options.h"
#include "lib/rails/rails.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

StatusOr<std::vector<DeviceSpec>> ParseDeviceList(const std::string& text) {
  std::vector<DeviceSpec> out;
  std::string_view rest = text;
  while (true) {
    const size_t comma = rest.find(',');
    std::string_view item = Trim(rest.substr(0, comma));
    if (item.empty()) {
      return Status::InvalidArgument("verbs: device list '" + text + "' has an empty entry");
    }
    DeviceSpec spec;
    if (size_t colon = item.find(':'); colon != std::string_view::npos) {
      std::string_view port = item.substr(colon + 1);
      unsigned value = 0;
      auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
      if (ec != std::errc() || p != port.data() + port.size() || value < 1 || value > 255) {
        return Status::InvalidArgument("verbs: device '" + std::string(item) +
                                       "' has a bad port (expected NAME or NAME:PORT, PORT 1-255)");
      }
      spec.port = static_cast<uint8_t>(value);
      item = item.substr(0, colon);
    }
    if (item.empty()) {
      return Status::InvalidArgument("verbs: device list '" + text + "' has an entry with no name");
    }
    spec.name = std::string(item);
    out.push_back(std::move(spec));
    if (out.size() > kMaxDevices) {
      return Status::InvalidArgument("verbs: device list '" + text + "' names more than " +
                                     std::to_string(kMaxDevices) + " devices");
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return out;
}

StatusOr<VerbsOptions> ParseVerbsOptions(const spi::TransportOptions& options) {
  VerbsOptions out;
  bool devices_set = false;
  // Every number takes a binary unit ("64k"), as before the toolkit.
  constexpr auto kUnits = toolkit::Units::kBinary;
  toolkit::OptionParser parser("verbs");
  parser.On("verbs.devices", [&](const std::string&, const std::string& value) {
    auto devices = ParseDeviceList(value);
    if (!devices.ok()) return devices.status();
    out.devices = std::move(*devices);
    devices_set = true;
    return Status::OK();
  });
  parser.On("verbs.gid_index", [&](const std::string& key, const std::string& value) {
    if (value == "auto") {
      out.gid_index = -1;
      return Status::OK();
    }
    auto n = toolkit::ParseNumber("verbs", key, value, 0, 65535, kUnits);
    if (n.ok()) out.gid_index = static_cast<int32_t>(*n);
    return n.status();
  });
  parser.Number("verbs.sq_depth", &out.sq_depth, 2, 1u << 20, kUnits);
  parser.Number("verbs.cq_depth", &out.cq_depth, 2, 1u << 22, kUnits);
  parser.Number("verbs.signal_every", &out.signal_every, 1, 1u << 20, kUnits);
  parser.Number("verbs.max_sge", &out.max_sge, 1, 1024, kUnits);
  parser.Number("verbs.max_message_bytes", &out.max_message_bytes, 1, 0xffffffffu, kUnits);
  parser.Number("verbs.max_chain", &out.max_chain, 1, 4096, kUnits);
  parser.Number("verbs.busy_poll_us", &out.busy_poll_us, 0, 1000000, kUnits);
  parser.Number("verbs.timeout", &out.timeout, 1, 31, kUnits);
  parser.Number("verbs.retry_cnt", &out.retry_cnt, 0, 7, kUnits);
  parser.Number("verbs.traffic_class", &out.traffic_class, 0, 255, kUnits);
  parser.Number("verbs.rail_stall_ms", &out.rail_stall_ms, 0, 3600000, kUnits);
  parser.Number("verbs.rail_retry_ms", &out.rail_retry_ms, 0, 3600000, kUnits);
  parser.On("verbs.sysfs_root", [&](const std::string&, const std::string& value) {
    if (value.empty()) return Status::InvalidArgument("verbs: verbs.sysfs_root is empty");
    out.sysfs_root = value;
    return Status::OK();
  });
  if (Status s = parser.Parse(options.options); !s.ok()) return s;
  if (!devices_set && !options.nic_names.empty()) {
    std::string joined;
    for (const std::string& nic : options.nic_names) joined += (joined.empty() ? "" : ",") + nic;
    auto devices = ParseDeviceList(joined);
    if (!devices.ok()) return devices.status().WithPrefix("nic_names");
    out.devices = std::move(*devices);
  }
  if (out.signal_every > out.sq_depth) out.signal_every = out.sq_depth;
  if (out.cq_depth < out.sq_depth) {
    return Status::InvalidArgument("verbs: verbs.cq_depth=" + std::to_string(out.cq_depth) +
                                   " is below verbs.sq_depth=" + std::to_string(out.sq_depth) +
                                   ": one QP could then fill the completion queue alone");
  }
  return out;
}

StatusOr<std::vector<DeviceSpec>> DevicesByTopology(const VerbsOptions& options,
                                                    const spi::TransportOptions& transport,
                                                    std::string* why) {
  rails::RailQuery query;
  query.sysfs_root = options.sysfs_root;
  query.kind = rails::NicKind::kRdma;
  query.memory = transport.memory_pci_address.empty()
                     ? rails::MemoryLocation::Host(transport.memory_numa_node)
                     : rails::MemoryLocation::Pci(transport.memory_pci_address);
  auto choice = rails::SelectRails(query);
  if (!choice.ok()) return choice.status().WithPrefix("verbs: choosing devices by topology");
  std::vector<DeviceSpec> devices;
  std::string chosen;
  for (const rails::Rail& rail : choice->rails) {
    devices.push_back(DeviceSpec{rail.name, 0});
    chosen += (chosen.empty() ? "" : ", ") + rail.name + " (" +
              std::string(rails::AffinityName(rail.affinity)) + ")";
  }
  if (why != nullptr) {
    *why = devices.empty() ? "no RDMA device on PCI under " + options.sysfs_root
                           : "closest to the KV pool: " + chosen;
  }
  return devices;
}

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib
