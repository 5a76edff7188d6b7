// NetnsCluster: a small cluster of "hosts" inside this machine, for tests, pdlib-chaos and
// pd-demo --netns (issue #18, "Beyond one host"; target pdlib_netns, not part of the pdlib
// library). Each host is a Linux network namespace with its own loopback and one interface,
// eth0, whose other end (a veth) sits in a bridge in the root namespace:
//
//     root namespace:  bridge <id>-br  10.a.b.1/24 ---+--- veth <id>-0 ==== eth0 10.a.b.2  host 0
//                                                     +--- veth <id>-1 ==== eth0 10.a.b.3  host 1
//
// With NetnsClusterOptions::rails = N > 1 (issue #31) each host also gets eth1 ... eth<N-1>, one
// per further rail: rail r is a bridge of its own in the cluster's rail namespace "<id>-rails"
// with a /24 of its own (rail 0's third octet + r), so two hosts have N independent links, as
// machines with N NICs on N fabrics. Only rail 0 reaches the root namespace. SetRailBandwidth caps
// one host's link on one rail (both directions); PartitionRail / HealRail cut it and restore it
// (nft on eth<r>, as Partition on eth0), leaving its other rails alone.
//
// Hosts reach each other and the root namespace (through the bridge's address) over the
// subnet; a host's 127.0.0.1 is its own, so a listener there is out of the other hosts' reach,
// as on separate machines. The subnet is the caller's (NetnsClusterOptions::subnet) or a free
// 10.128.0.0/9 /24 picked from the pid; every name starts with the cluster's id,
// "<prefix><pid in base 36>_<serial>" (netns_plan.h), so concurrent processes (ctest -j) and
// several clusters of one process never collide, and leftovers of a crashed run can be told
// apart from a live one's (CleanupStale).
//
// Programs run inside a host three ways, all through the tree's one child-process helper
// (tools/common/child_process.h) or a thread:
// - InHost(host, options): the ChildOptions that start `options` through
//   `ip netns exec <namespace>`, for a ChildProcess that lives on (a server, a peer);
// - Exec(host, argv): runs a command to completion and returns its exit status and output
//   (ip, tc, nft, iperf3 ...);
// - RunInHost(host, fn): runs fn on a thread that has entered the host's namespace; the
//   sockets it opens stay in that namespace after it returns (in-process clients and servers,
//   the tests).
//
// Faults, per host, on its link (both directions unless noted):
// - Partition / Heal: every IP packet in and out of eth0 is dropped, silently for the sender
//   (nft rules on eth0's ingress and egress hooks, in the host's namespace; ARP passes; where
//   nft is missing, the link is set down instead). Established TCP connections stall and
//   retransmit, new ones time out; Heal lets them through again.
// - SetLoss(percent): each IP packet in and each one out is dropped with that probability
//   (nft `numgen random`), so a round trip loses about 1 - (1 - p)^2 of its exchanges.
// - SetBandwidth(mbit): a token bucket (tc tbf) on both egresses, the veth in the root namespace
//   (traffic to the host) and eth0 (traffic from it).
// - SetLatency(delay, jitter): tc netem on both egresses, so a round trip takes about twice
//   the delay. Needs the kernel's sch_netem: where it is missing this returns Unimplemented
//   with the reason, and Probe() says so up front, so callers skip that one fault.
// - ClearFaults: all of the above off.
// Faults combine (a partitioned host keeps its bandwidth cap for when it is healed). Each call
// returns a pdlib::Status whose message names the failing command and what it printed.
//
// Requirements: root (CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2 (ip, tc), and for loss and
// nft-based partitions the nft tool (Debian: nftables; scripts/install-deps.sh installs it).
// Where br_netfilter sends bridged traffic through the root namespace's firewall
// (net.bridge.bridge-nf-call-iptables = 1) a FORWARD policy of DROP (Docker's) cuts hosts off
// from each other: allow the bridge there.
// Probe() tells which of netns, tbf, netem and nft work here, with the reason for each that
// does not; a test that cannot get what it needs prints the reason and skips.
//
// Ownership: the destructor deletes the veths, the namespaces (with their qdiscs and nft
// tables) and the bridge, also after a partial failure of Create or AddHost. Stop the
// ChildProcesses started in its hosts first: a process still inside keeps its namespace alive
// (without a name) until it exits. CleanupStale removes what crashed processes left behind.
// Threads: one thread at a time per cluster; Probe and CleanupStale from any thread.
#ifndef PDLIB_TOOLS_NETNS_NETNS_CLUSTER_H_
#define PDLIB_TOOLS_NETNS_NETNS_CLUSTER_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pdlib/status.h"
#include "tools/common/child_process.h"
#include "tools/netns/netns_plan.h"

namespace pdlib_tools {

// What this machine can do, found once per process by NetnsCluster::Probe(). A `reason` is
// empty when the capability is there, else one line a person can act on.
struct NetnsCapabilities {
  bool netns = false;  // root, `ip netns add`, veth pairs and bridges: clusters at all
  std::string netns_reason{};
  bool tbf = false;  // tc tbf: SetBandwidth
  std::string tbf_reason{};
  bool netem = false;  // tc netem (sch_netem): SetLatency
  std::string netem_reason{};
  // The nft tool, and nf_tables with numgen and the netdev egress hook: SetLoss, Partition by
  // rules.
  bool nft = false;
  std::string nft_reason{};

  // "netns yes, tbf yes, netem no (kernel has no sch_netem: ...), nft yes".
  std::string ToString() const;
};

struct NetnsClusterOptions {
  // The hosts' /24 ("10.9.8.0/24"; the host bits are ignored). The bridge takes .1, hosts .2
  // upwards. Empty: a /24 of 10.128.0.0/9 that no address or route of the root namespace
  // overlaps, picked from the pid.
  std::string subnet{};
  // 1 to 4 lowercase letters that start every name (see the top of this file).
  std::string prefix = "pd";
  // Links between each pair of hosts, 1 to kMaxRails (netns_plan.h): eth0 on the bridge above,
  // and eth1 ... on one bridge per further rail.
  int rails = 1;
  // How long one ip/tc/nft command may take.
  std::chrono::milliseconds command_timeout{10000};
};

// A command's outcome: how it exited (0..255, or 128 + n when killed by signal n) and what it
// wrote to stdout and stderr, merged.
struct ExecResult {
  int exit_status = -1;
  std::string output{};
};

// Runs `argv` (argv[0] looked up on PATH) in this process's namespace until it exits or
// `timeout` passes (then it is killed: DeadlineExceeded). An exit status other than 0 is not an
// error here; the caller reads it. NotFound when the program cannot be started. Its stdin is a
// pipe nothing writes to (a program that reads it waits for the timeout), and output is read in
// whole lines (ChildProcess::ReadLine): a last line without '\n' is not in `output`.
pdlib::StatusOr<ExecResult> RunCommand(const std::vector<std::string>& argv,
                                       std::chrono::milliseconds timeout);

class NetnsCluster {
 public:
  struct Host {
    std::string name;   // the caller's
    std::string netns;  // the namespace: "<id>-<name>", under /run/netns
    std::string ip;     // eth0's address
    std::string veth;   // the link's end in the bridge (root namespace)
    int index = 0;      // 0, 1, ... in AddHost order
    bool partitioned = false;
    int loss_percent = 0;
    LinkShape shape{};        // latency and bandwidth, the same both ways
    bool qdiscs_set = false;  // some qdisc of `shape` may be installed
    bool link_down = false;   // partitioned by setting the link down (no nft)
    // Rails 1 and up (index r - 1): eth<r>'s address and its faults.
    struct RailLink {
      std::string ip;
      int rate_mbit = 0;
      bool qdiscs_set = false;
      bool partitioned = false;
      bool link_down = false;  // partitioned by setting the link down (no nft)
    };
    std::vector<RailLink> rails{};
    // The host's address on `rail` (0: ip).
    const std::string& RailIp(int rail) const { return rail == 0 ? ip : rails[rail - 1].ip; }
  };

  // Which of netns, tbf, netem and nft this machine offers, and why not (cached: the first call
  // runs about ten commands in a scratch namespace).
  static const NetnsCapabilities& Probe();

  // The bridge with its address, up. FailedPrecondition (with Probe()'s reason) where clusters
  // cannot be built here.
  static pdlib::StatusOr<std::unique_ptr<NetnsCluster>> Create(NetnsClusterOptions options = {});

  // Removes the interfaces and namespaces in the root namespace whose names start with
  // `prefix` and were made by a process that no longer runs (their pid is in the name): what a
  // crashed or killed run left behind. Never touches a live process's cluster. The number of
  // things removed, or the first failure.
  static pdlib::StatusOr<int> CleanupStale(const std::string& prefix = "pd");

  ~NetnsCluster();
  NetnsCluster(const NetnsCluster&) = delete;
  NetnsCluster& operator=(const NetnsCluster&) = delete;

  const std::string& id() const { return id_; }  // every name starts with it
  const std::string& bridge() const { return bridge_; }
  const std::string& bridge_ip() const { return bridge_ip_; }  // the root namespace's address
  const std::string& subnet() const { return subnet_; }        // "10.a.b.0/24"
  int rails() const { return options_.rails; }
  // Rail `rail`'s /24 ("10.a.b+r.0/24"); rail 0's is subnet().
  std::string RailSubnetOf(int rail) const;
  // The namespace holding the bridges of rails 1 and up; empty with one rail.
  const std::string& rail_netns() const { return rail_netns_; }

  // A new host `name` ([A-Za-z0-9_.-], up to 32 characters, unique in this cluster): its
  // namespace with lo up, the veth pair, eth0's address. Returns that address. On failure
  // nothing of the host is left.
  pdlib::StatusOr<std::string> AddHost(const std::string& name);
  // The host `name`, or nullptr.
  const Host* FindHost(const std::string& name) const;
  std::vector<std::string> HostNames() const;

  // `options` turned into one run through `ip netns exec <namespace> <program> args...`:
  // environment and stderr handling stay as they were. An empty program (this binary) becomes
  // the path of /proc/self/exe, which is then also its argv[0] (self_name is lost).
  pdlib::StatusOr<ChildOptions> InHost(const std::string& host, ChildOptions options) const;
  // RunCommand of `argv` inside the host's namespace (through `ip netns exec`).
  pdlib::StatusOr<ExecResult> Exec(const std::string& host, const std::vector<std::string>& argv,
                                   std::chrono::milliseconds timeout) const;
  // Runs `fn` on a new thread that has entered the host's network namespace, and waits for it.
  // Sockets opened there belong to that namespace for good.
  pdlib::Status RunInHost(const std::string& host, const std::function<void()>& fn) const;

  // --- Faults (see the top of this file) ---
  pdlib::Status Partition(const std::string& host);
  pdlib::Status Heal(const std::string& host);
  // percent in [0, 100]; 0 turns loss off. Unimplemented without nft.
  pdlib::Status SetLoss(const std::string& host, int percent);
  // mbit > 0 caps both directions; 0 lifts the cap.
  pdlib::Status SetBandwidth(const std::string& host, int mbit);
  // The same for the host's link on `rail` (0: SetBandwidth; tbf only, no netem on rails >= 1).
  pdlib::Status SetRailBandwidth(const std::string& host, int rail, int mbit);
  // Partition / Heal of the host's link on `rail` alone (0: Partition / Heal): its other rails
  // keep working, as when one NIC or its switch port fails.
  pdlib::Status PartitionRail(const std::string& host, int rail);
  pdlib::Status HealRail(const std::string& host, int rail);
  // delay_ms and jitter_ms >= 0 (0, 0: none). Unimplemented where the kernel has no sch_netem.
  pdlib::Status SetLatency(const std::string& host, int delay_ms, int jitter_ms);
  pdlib::Status ClearFaults(const std::string& host);

  // Deletes everything (what the destructor does), reporting the first failure. Afterwards the
  // cluster has no hosts and no bridge; calling it again does nothing.
  pdlib::Status Destroy();

 private:
  explicit NetnsCluster(NetnsClusterOptions options);
  pdlib::Status Build();  // the bridge
  // Runs `argv` (in the root namespace); an error when it fails or exits non-zero.
  pdlib::Status Run(const std::vector<std::string>& argv) const;
  Host* MutableHost(const std::string& name);
  pdlib::Status UnknownHost(const std::string& name) const;
  // Makes the host's nft table (or link state) and qdiscs match its fault fields.
  pdlib::Status ApplyFilters(Host& host);
  pdlib::Status ApplyQdiscs(Host& host);
  // The rail's nft table (or link state) made to match link.partitioned.
  pdlib::Status ApplyRailFilters(Host& host, int rail);
  // The host's link on `rail` >= 1, or an error for an unknown host or rail.
  pdlib::StatusOr<Host::RailLink*> RailLinkOf(const std::string& host, int rail);
  // PartitionRail / HealRail of a rail >= 1: sets the link's flag and applies its filters.
  pdlib::Status SetRailPartitioned(const std::string& host, int rail, bool partitioned);
  // One egress: the tc command up to "qdisc" ({"tc", "-n", ns, "qdisc"}) and the device.
  using Egress = std::pair<std::vector<std::string>, std::string>;
  // Replaces the qdiscs on every egress with those of `shape`; *qdiscs_set says whether some
  // may be installed afterwards.
  pdlib::Status ApplyShape(const std::vector<Egress>& egresses, const LinkShape& shape,
                           bool* qdiscs_set);
  // Deletes one host's veth and namespace; the first failure.
  pdlib::Status RemoveHost(const Host& host);

  NetnsClusterOptions options_;
  uint32_t serial_ = 0;  // this process's clusters count from 0
  std::string id_;
  std::string bridge_;
  std::string bridge_ip_;
  std::string subnet_;
  uint32_t network_ = 0;  // the subnet's address, host byte order
  bool bridge_made_ = false;
  std::string rail_netns_;  // set once the rail namespace may exist
  std::vector<Host> hosts_;
  int next_index_ = 0;
};

}  // namespace pdlib_tools

#endif  // PDLIB_TOOLS_NETNS_NETNS_CLUSTER_H_
