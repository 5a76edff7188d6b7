#include "backends/verbs/verbs_options.h"

#include <cctype>
#include <charconv>
#include <string_view>

namespace pdlib {
inline namespace v1 {
namespace verbs {
namespace {

constexpr std::string_view kPrefix = "verbs.";

StatusOr<uint64_t> ParseNumber(const std::string& key, const std::string& text, uint64_t min,
                               uint64_t max) {
  uint64_t value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(begin, end, value);
  int shift = 0;
  if (ec == std::errc() && p != begin && p != end) {  // a binary unit: 64k, 4M, 1g
    switch (std::tolower(static_cast<unsigned char>(*p))) {
      case 'k': shift = 10; break;
      case 'm': shift = 20; break;
      case 'g': shift = 30; break;
      default: shift = -1;
    }
    ++p;
  }
  if (ec != std::errc() || p == begin || p != end || shift < 0 ||
      (shift > 0 && value > (max >> shift)) || (value << shift) < min || (value << shift) > max) {
    return Status::InvalidArgument("verbs: option " + key + "='" + text + "' is not a number in [" +
                                   std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return value << shift;
}

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
  for (const auto& [key, value] : options.options) {
    if (key.compare(0, kPrefix.size(), kPrefix) != 0) continue;
    auto number = [&](uint64_t min, uint64_t max) { return ParseNumber(key, value, min, max); };
    StatusOr<uint64_t> n = uint64_t{0};
    if (key == "verbs.devices") {
      auto devices = ParseDeviceList(value);
      if (!devices.ok()) return devices.status();
      out.devices = std::move(*devices);
      devices_set = true;
    } else if (key == "verbs.gid_index") {
      if (value == "auto") {
        out.gid_index = -1;
      } else if ((n = number(0, 65535)).ok()) {
        out.gid_index = static_cast<int32_t>(*n);
      }
    } else if (key == "verbs.sq_depth") {
      if ((n = number(2, 1u << 20)).ok()) out.sq_depth = static_cast<uint32_t>(*n);
    } else if (key == "verbs.cq_depth") {
      if ((n = number(2, 1u << 22)).ok()) out.cq_depth = static_cast<uint32_t>(*n);
    } else if (key == "verbs.signal_every") {
      if ((n = number(1, 1u << 20)).ok()) out.signal_every = static_cast<uint32_t>(*n);
    } else if (key == "verbs.max_sge") {
      if ((n = number(1, 1024)).ok()) out.max_sge = static_cast<uint32_t>(*n);
    } else if (key == "verbs.max_message_bytes") {
      if ((n = number(1, 0xffffffffu)).ok()) out.max_message_bytes = *n;
    } else if (key == "verbs.max_chain") {
      if ((n = number(1, 4096)).ok()) out.max_chain = static_cast<uint32_t>(*n);
    } else if (key == "verbs.busy_poll_us") {
      if ((n = number(0, 1000000)).ok()) out.busy_poll_us = static_cast<uint32_t>(*n);
    } else if (key == "verbs.timeout") {
      if ((n = number(1, 31)).ok()) out.timeout = static_cast<uint8_t>(*n);
    } else if (key == "verbs.retry_cnt") {
      if ((n = number(0, 7)).ok()) out.retry_cnt = static_cast<uint8_t>(*n);
    } else if (key == "verbs.traffic_class") {
      if ((n = number(0, 255)).ok()) out.traffic_class = static_cast<uint8_t>(*n);
    } else {
      return Status::InvalidArgument(
          "verbs: unknown backend option '" + key +
          "' (known: verbs.devices, verbs.gid_index, verbs.sq_depth, verbs.cq_depth, "
          "verbs.signal_every, verbs.max_sge, verbs.max_message_bytes, verbs.max_chain, "
          "verbs.busy_poll_us, verbs.timeout, verbs.retry_cnt, verbs.traffic_class)");
    }
    if (!n.ok()) return n.status();
  }
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

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib
