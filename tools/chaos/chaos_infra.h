// What one pdlib-chaos topology's processes run on: the hosts (with --netns, one network
// namespace per prefill or decode process slot, tools/netns; else all of them on 127.0.0.1),
// the faults on those hosts' links, and the discovery the processes find each other through,
// which the discovery faults break: the bootstrap server the driver hosts (stopped, then
// started again on the same port) or an etcd cluster of three members (one killed, then started
// again with its data).
//
// With --netns the bootstrap server and the etcd members listen on the bridge's address in the
// root namespace, which every host reaches (and a partitioned host does not).
//
// Threads: one (the driver's). Every call returns promptly except Create (etcd members start
// in seconds) and StopBootstrap (the server's shutdown grace, 250 ms).
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_INFRA_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_INFRA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/control/bootstrap_server.h"
#include "pdlib/status.h"
#include "tools/chaos/chaos_faults.h"
#include "tools/common/child_process.h"

namespace pdlib_tools {
class NetnsCluster;
class EtcdCluster;
}  // namespace pdlib_tools

namespace pdlib_chaos {

struct InfraOptions {
  bool netns = false;    // hosts as network namespaces
  bool etcd = false;     // discovery through etcd instead of the bootstrap server
  int etcd_members = 3;  // with etcd
  int rails = 1;         // links between each pair of hosts (netns), eth0 ... eth<rails-1>
};

class ChaosInfra {
 public:
  // Why this machine cannot give what `options` and the link faults in `faults` ask (no
  // network namespaces, no nft for partition and loss, no tbf for bandwidth: NetnsCluster's
  // probe; etcd not installed), or "" when it can.
  static std::string Missing(const InfraOptions& options, const std::vector<FaultKind>& faults);
  // Why the latency fault cannot run here (the kernel has no sch_netem), or "".
  static std::string LatencyMissing();

  // The hosts named `hosts` (with netns), then the discovery.
  static pdlib::StatusOr<std::unique_ptr<ChaosInfra>> Create(const InfraOptions& options,
                                                             const std::vector<std::string>& hosts);
  ~ChaosInfra();  // the discovery, then the hosts: stop their processes first
  ChaosInfra(const ChaosInfra&) = delete;
  ChaosInfra& operator=(const ChaosInfra&) = delete;

  // Where the processes of `host` listen: its address, or 127.0.0.1 without netns.
  std::string HostIp(const std::string& host) const;
  // `options` made to run inside `host` (unchanged without netns).
  pdlib::StatusOr<pdlib_tools::ChildOptions> Place(const std::string& host,
                                                   pdlib_tools::ChildOptions options) const;

  // The deployment's bootstrap address: the server's, or with etcd the deployment's name.
  const std::string& bootstrap_host() const { return bootstrap_host_; }
  uint16_t bootstrap_port() const { return bootstrap_port_; }
  std::vector<std::string> etcd_endpoints() const;

  // A link fault of `kind` with `params` on `host`, and its end. Needs netns.
  pdlib::Status StartLinkFault(const std::string& host, FaultKind kind, const FaultParams& params);
  pdlib::Status EndLinkFault(const std::string& host, FaultKind kind, const FaultParams& params);

  // The bootstrap server: gone (with every registration it held) and back on the same port.
  // StartBootstrap fails while the old socket's port is not free yet: call it again.
  void StopBootstrap();
  pdlib::Status StartBootstrap();
  bool bootstrap_up() const { return bootstrap_ != nullptr; }

  // The etcd members.
  int etcd_size() const;
  bool etcd_running(int member) const;
  pdlib::Status KillEtcd(int member);
  pdlib::Status RelaunchEtcd(int member);  // returns at once; EtcdServing tells when it serves
  bool EtcdServing(int member);

 private:
  ChaosInfra() = default;

  InfraOptions options_;
  std::unique_ptr<pdlib_tools::NetnsCluster> cluster_;
  std::unique_ptr<pdlib_tools::EtcdCluster> etcd_;
  std::unique_ptr<pdlib::control::BootstrapServer> bootstrap_;
  std::string bootstrap_host_ = "127.0.0.1";
  uint16_t bootstrap_port_ = 0;
};

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_INFRA_H_
