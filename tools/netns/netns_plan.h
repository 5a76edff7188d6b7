// The pure parts of NetnsCluster (netns_cluster.h): the names it gives interfaces and
// namespaces and how a leftover name leads back to the process that made it, IPv4 subnets, and
// the nft and tc commands that put faults on a host's link. No I/O, no threads: unit-tested
// without root by test/netns.
#ifndef PDLIB_TOOLS_NETNS_NETNS_PLAN_H_
#define PDLIB_TOOLS_NETNS_NETNS_PLAN_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib_tools {

// --- Names ---
// Linux limits interface names to 15 characters (IFNAMSIZ - 1).
inline constexpr size_t kMaxInterfaceName = 15;
// A caller's prefix: 1 to 4 lowercase letters, so that every name below fits.
inline constexpr size_t kMaxNamePrefix = 4;

// `value` in base 36, lowercase ("0" for 0).
std::string Base36(uint64_t value);

// The id of a process's cluster number `serial`: "<prefix><pid in base 36>_<serial in base 36>",
// e.g. "pd1kw_3" (at most 4 + 5 + 1 + 2 = 12 characters; `serial` is taken modulo 36^2).
// Every name the cluster makes starts with it: "<id>-br" (the bridge), "<id>-<n>" (host n's
// veth end in the bridge, n in base 36) and "<id>-<host name>" (host's namespace).
std::string ClusterId(std::string_view prefix, pid_t pid, uint32_t serial);
// The scratch namespace of NetnsCluster::Probe(): "<prefix><pid in base 36>_probe".
std::string ProbeNamespace(std::string_view prefix, pid_t pid);

// The pid encoded in a name made by ClusterId or ProbeNamespace with `prefix`, or nullopt when
// `name` is not one of those ("<prefix>", base-36 digits, '_', anything).
std::optional<pid_t> OwnerPidOf(std::string_view name, std::string_view prefix);

// True when `name` may name a host: 1 to 32 of [A-Za-z0-9_.-], not starting with '-' or '.'
// (it becomes part of a namespace name, a file under /run/netns).
bool IsValidHostName(std::string_view name);

// --- IPv4 ---
struct Ipv4Net {
  uint32_t address = 0;  // host byte order
  int prefix_length = 32;
};

// "a.b.c.d/n" or "a.b.c.d" (/32); nullopt when malformed.
std::optional<Ipv4Net> ParseIpv4Net(std::string_view text);
std::string FormatIpv4(uint32_t address);
// True when the two networks share an address.
bool Overlaps(const Ipv4Net& a, const Ipv4Net& b);
// The network of `net` (host bits cleared).
Ipv4Net NetworkOf(const Ipv4Net& net);

// The /24 a cluster tries first when the caller picks none: inside 10.128.0.0/9, spread by pid
// and serial so that the clusters of concurrent test processes start apart. `attempt` walks on
// from there (when the first one is taken on this machine).
Ipv4Net DefaultSubnet(pid_t pid, uint32_t serial, uint32_t attempt);

// --- Rails (issue #31) ---
// A cluster may have several rails: rail 0 is the bridge in the root namespace described in
// netns_cluster.h (eth0 in each host); rail r >= 1 is a bridge of its own, "br<r>", inside the
// cluster's rail namespace "<id>-rails", with each host's eth<r> on it, in a /24 of its own. So
// every pair of hosts has one independent link per rail, and a rail's names, being inside that
// namespace, never collide with another cluster's.
inline constexpr int kMaxRails = 8;

// "eth<rail>": the host's interface on the rail.
std::string RailInterface(int rail);
// "<id>-rails": the namespace that holds the bridges of rails 1 and up.
std::string RailNamespace(std::string_view cluster_id);
// In the rail namespace: the rail's bridge "br<rail>", and the host's port on it
// "r<rail>h<host index in base 36>".
std::string RailBridge(int rail);
std::string RailPort(int rail, int host_index);
// The /24 of rail `rail`: rail 0's with the third octet stepped by `rail` (mod 256), so that a
// host's addresses on all rails end alike (10.a.b.5, 10.a.b+1.5, ...).
Ipv4Net RailSubnet(const Ipv4Net& rail0, int rail);

// The commands (argv) that put the host whose namespace is `host_netns` on rail `rail` >= 1 with
// address `ip` (in the rail's /24): its port in `rail_netns` and eth<rail> in the host,
// both up. The rail's bridge must exist (RailBridgeCommands).
std::vector<std::vector<std::string>> RailHostCommands(std::string_view rail_netns,
                                                       std::string_view host_netns, int rail,
                                                       int host_index, std::string_view ip);
// The nft table of the faults on a host's link on rail `rail` >= 1: "pdlib_faults_eth<rail>".
std::string RailFaultTable(int rail);
// The commands that make rail `rail`'s bridge in `rail_netns` (which must exist), up.
std::vector<std::vector<std::string>> RailBridgeCommands(std::string_view rail_netns, int rail);

// --- Faults ---
// The name of the nft table that holds a host's packet filters, inside its namespace.
inline constexpr std::string_view kFaultTable = "pdlib_faults";

// One nft command line (one atomic transaction) that makes the fault table of a host say what
// is asked, with netdev hooks on `device` (ingress: packets to the host, egress: packets from
// it): drop every IPv4 and IPv6 packet when `partitioned`, else drop each with probability
// `loss_percent`/100; ARP passes. With neither, it removes the table. Idempotent. Needs a
// kernel with the netfilter egress hook (5.16 and later). `table`: the table's name (a host's
// rails each have their own, RailFaultTable).
std::string NftFaultCommand(std::string_view device, bool partitioned, int loss_percent,
                            std::string_view table = kFaultTable);

// What goes on one direction of a link (the egress of one device).
struct LinkShape {
  int delay_ms = 0;   // netem; 0: none
  int jitter_ms = 0;  // netem, with delay_ms
  int rate_mbit = 0;  // tbf; 0: no cap
  bool empty() const { return delay_ms == 0 && jitter_ms == 0 && rate_mbit == 0; }
};

// The arguments after "tc qdisc add dev <device>" of each qdisc `shape` needs, in order: netem
// as the root with tbf as its child when both are asked (tc-netem(8)'s way to combine them),
// else the one that is. Empty for an empty shape.
std::vector<std::vector<std::string>> QdiscAddArgs(const LinkShape& shape);

}  // namespace pdlib_tools

#endif  // PDLIB_TOOLS_NETNS_NETNS_PLAN_H_
