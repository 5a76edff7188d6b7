#include "tools/netns/netns_plan.h"

#include <algorithm>
#include <charconv>

namespace pdlib_tools {
namespace {

bool IsBase36Digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z'); }

// Leading base-36 digits of `text`, at most `max_digits` of them.
size_t Base36Run(std::string_view text, size_t max_digits) {
  size_t n = 0;
  while (n < text.size() && n <= max_digits && IsBase36Digit(text[n])) ++n;
  return n;
}

uint32_t MaskOf(int prefix_length) {
  return prefix_length == 0 ? 0 : ~uint32_t{0} << (32 - prefix_length);
}

}  // namespace

std::string Base36(uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdefghijklmnopqrstuvwxyz";
  std::string out;
  do {
    out.insert(out.begin(), kDigits[value % 36]);
    value /= 36;
  } while (value != 0);
  return out;
}

std::string ClusterId(std::string_view prefix, pid_t pid, uint32_t serial) {
  return std::string(prefix) + Base36(uint64_t(pid)) + "_" + Base36(serial % (36 * 36));
}

std::string ProbeNamespace(std::string_view prefix, pid_t pid) {
  return std::string(prefix) + Base36(uint64_t(pid)) + "_probe";
}

std::optional<pid_t> OwnerPidOf(std::string_view name, std::string_view prefix) {
  if (prefix.empty() || !name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  // Linux pids stay below 2^22 (PID_MAX_LIMIT): at most 5 base-36 digits.
  const size_t digits = Base36Run(name, 5);
  if (digits == 0 || digits > 5 || digits >= name.size() || name[digits] != '_') {
    return std::nullopt;
  }
  const std::string_view rest = name.substr(digits + 1);
  const size_t serial = Base36Run(rest, 2);
  const bool cluster_name =
      serial >= 1 && serial <= 2 && (serial == rest.size() || rest[serial] == '-');
  if (!cluster_name && rest != "probe") return std::nullopt;
  uint64_t pid = 0;
  for (char c : name.substr(0, digits))
    pid = pid * 36 + uint64_t(c <= '9' ? c - '0' : c - 'a' + 10);
  if (pid == 0) return std::nullopt;
  return pid_t(pid);
}

bool IsValidHostName(std::string_view name) {
  if (name.empty() || name.size() > 32 || name[0] == '-' || name[0] == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
  });
}

std::optional<Ipv4Net> ParseIpv4Net(std::string_view text) {
  Ipv4Net net;
  if (const size_t slash = text.find('/'); slash != std::string_view::npos) {
    const std::string_view len = text.substr(slash + 1);
    auto [end, ec] = std::from_chars(len.data(), len.data() + len.size(), net.prefix_length);
    if (ec != std::errc() || end != len.data() + len.size() || len.empty() ||
        net.prefix_length < 0 || net.prefix_length > 32) {
      return std::nullopt;
    }
    text = text.substr(0, slash);
  }
  for (int octet = 0; octet < 4; ++octet) {
    if (octet > 0) {
      if (text.empty() || text[0] != '.') return std::nullopt;
      text.remove_prefix(1);
    }
    unsigned value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    const size_t used = size_t(end - text.data());
    if (ec != std::errc() || used == 0 || used > 3 || value > 255) return std::nullopt;
    net.address = net.address << 8 | value;
    text.remove_prefix(used);
  }
  if (!text.empty()) return std::nullopt;
  return net;
}

std::string FormatIpv4(uint32_t address) {
  return std::to_string(address >> 24) + "." + std::to_string(address >> 16 & 255) + "." +
         std::to_string(address >> 8 & 255) + "." + std::to_string(address & 255);
}

bool Overlaps(const Ipv4Net& a, const Ipv4Net& b) {
  const uint32_t mask = MaskOf(std::min(a.prefix_length, b.prefix_length));
  return (a.address & mask) == (b.address & mask);
}

Ipv4Net NetworkOf(const Ipv4Net& net) {
  return {net.address & MaskOf(net.prefix_length), net.prefix_length};
}

Ipv4Net DefaultSubnet(pid_t pid, uint32_t serial, uint32_t attempt) {
  // 2^15 /24s in 10.128.0.0/9; a process's clusters take 16 consecutive ones, and its attempts
  // step by a prime so that they leave that run quickly.
  const uint32_t index = (uint32_t(pid) * 16 + serial % 16 + attempt * 4099) % (1u << 15);
  return {(10u << 24) | (128u << 16) | (index << 8), 24};
}

std::string RailInterface(int rail) { return "eth" + std::to_string(rail); }

std::string RailNamespace(std::string_view cluster_id) {
  return std::string(cluster_id) + "-rails";
}

std::string RailBridge(int rail) { return "br" + std::to_string(rail); }

std::string RailPort(int rail, int host_index) {
  return "r" + std::to_string(rail) + "h" + Base36(uint64_t(host_index));
}

Ipv4Net RailSubnet(const Ipv4Net& rail0, int rail) {
  const Ipv4Net net = NetworkOf({rail0.address, 24});
  const uint32_t third = ((net.address >> 8 & 255) + uint32_t(rail)) & 255;
  return {(net.address & 0xffff0000u) | third << 8, 24};
}

std::vector<std::vector<std::string>> RailBridgeCommands(std::string_view rail_netns, int rail) {
  const std::string ns(rail_netns), bridge = RailBridge(rail);
  return {{"ip", "-n", ns, "link", "add", bridge, "type", "bridge"},
          {"ip", "-n", ns, "link", "set", bridge, "up"}};
}

std::vector<std::vector<std::string>> RailHostCommands(std::string_view rail_netns,
                                                       std::string_view host_netns, int rail,
                                                       int host_index, std::string_view ip) {
  const std::string ns(rail_netns), host(host_netns), port = RailPort(rail, host_index),
                                                      dev = RailInterface(rail);
  // Made inside the rail namespace with its peer straight in the host's: neither end ever
  // appears in the root namespace.
  return {{"ip", "-n", ns, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", host},
          {"ip", "-n", ns, "link", "set", port, "master", RailBridge(rail), "up"},
          {"ip", "-n", host, "addr", "add", std::string(ip) + "/24", "dev", dev},
          {"ip", "-n", host, "link", "set", dev, "up"}};
}

std::string RailFaultTable(int rail) {
  return std::string(kFaultTable) + "_" + RailInterface(rail);
}

std::string NftFaultCommand(std::string_view device, bool partitioned, int loss_percent,
                            std::string_view table_name) {
  const std::string table = "netdev " + std::string(table_name);
  // Creating the table before deleting it makes the delete succeed when there was none; the
  // whole line is one transaction, so the host never sees the table half built.
  std::string command = "add table " + table + "; delete table " + table;
  if (!partitioned && loss_percent <= 0) return command;
  // IP only: ARP keeps working, so that peers see packets vanish (timeouts), as across a
  // routed network, rather than "no route to host" once their neighbour entry expires.
  const std::string match =
      "meta protocol { ip, ip6 } " +
      (partitioned ? "" : "numgen random mod 100 < " + std::to_string(loss_percent) + " ");
  auto chain = [&](const char* name, const char* hook) {
    return std::string(" chain ") + name + " { type filter hook " + hook + " device \"" +
           std::string(device) + "\" priority 0; policy accept; " + match + "drop; };";
  };
  // Ingress and egress of the device itself: a drop at egress is silent to the sender (UDP
  // sends succeed, TCP retransmits), where one in the IP output hook would fail its send with
  // EPERM, which no real network does.
  command += "; table " + table + " {" + chain("in", "ingress") + chain("out", "egress") + " }";
  return command;
}

std::vector<std::vector<std::string>> QdiscAddArgs(const LinkShape& shape) {
  std::vector<std::vector<std::string>> out;
  std::vector<std::string> tbf;
  if (shape.rate_mbit > 0) {
    // The bucket holds 10 ms at the rate, and at least a few full-size frames (a smaller one
    // than the MTU would stall the link).
    const int64_t burst = std::max<int64_t>(int64_t(shape.rate_mbit) * 1000000 / 8 / 100, 15000);
    tbf = {
        "tbf",     "rate", std::to_string(shape.rate_mbit) + "mbit", "burst", std::to_string(burst),
        "latency", "100ms"};
  }
  if (shape.delay_ms > 0 || shape.jitter_ms > 0) {
    std::vector<std::string> netem = {
        "root",  "handle", "1:",    "netem",
        "limit", "10000",  "delay", std::to_string(shape.delay_ms) + "ms"};
    if (shape.jitter_ms > 0) netem.push_back(std::to_string(shape.jitter_ms) + "ms");
    out.push_back(std::move(netem));
    if (!tbf.empty()) {
      tbf.insert(tbf.begin(), {"parent", "1:1", "handle", "10:"});
      out.push_back(std::move(tbf));
    }
  } else if (!tbf.empty()) {
    tbf.insert(tbf.begin(), "root");
    out.push_back(std::move(tbf));
  }
  return out;
}

}  // namespace pdlib_tools
