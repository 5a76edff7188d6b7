#include "tools/chaos/chaos_infra.h"

#include <algorithm>
#include <utility>

#include "tools/etcd/etcd_cluster.h"
#include "tools/netns/netns_cluster.h"

namespace pdlib_chaos {

using pdlib::Status;
using pdlib::StatusOr;

std::string ChaosInfra::Missing(const InfraOptions& options, const std::vector<FaultKind>& faults) {
  auto asked = [&](FaultKind k) {
    return std::find(faults.begin(), faults.end(), k) != faults.end();
  };
  if (options.netns) {
    const auto& caps = pdlib_tools::NetnsCluster::Probe();
    if (!caps.netns) return "no network namespaces here: " + caps.netns_reason;
    // Partition and loss are nft rules (netns_cluster.h): without nft a partition would be a
    // link set down instead, which is not the silent drop this run is meant to inject.
    if (!caps.nft && (asked(FaultKind::kPartition) || asked(FaultKind::kLoss))) {
      return "no nft here (partition and loss faults): " + caps.nft_reason;
    }
    if (!caps.nft && asked(FaultKind::kRail)) {
      return "no nft here (rail faults partition a rail): " + caps.nft_reason;
    }
    if (!caps.tbf && (asked(FaultKind::kBandwidth) || asked(FaultKind::kRail))) {
      return "no tc tbf here (bandwidth faults): " + caps.tbf_reason;
    }
  }
  if (options.etcd) {
    if (auto why = pdlib_tools::EtcdMissing()) return *why;
  }
  return "";
}

std::string ChaosInfra::LatencyMissing() {
  const auto& caps = pdlib_tools::NetnsCluster::Probe();
  return caps.netem ? "" : caps.netem_reason;
}

StatusOr<std::unique_ptr<ChaosInfra>> ChaosInfra::Create(const InfraOptions& options,
                                                         const std::vector<std::string>& hosts) {
  std::unique_ptr<ChaosInfra> infra(new ChaosInfra());
  infra->options_ = options;
  if (options.netns) {
    pdlib_tools::NetnsClusterOptions no;
    no.rails = options.rails;
    auto cluster = pdlib_tools::NetnsCluster::Create(no);
    if (!cluster.ok()) return cluster.status().WithPrefix("network namespaces");
    infra->cluster_ = std::move(*cluster);
    for (const std::string& host : hosts) {
      if (auto ip = infra->cluster_->AddHost(host); !ip.ok()) {
        return ip.status().WithPrefix("host " + host);
      }
    }
    infra->bootstrap_host_ = infra->cluster_->bridge_ip();
  }
  if (options.etcd) {
    pdlib_tools::EtcdClusterOptions eo;
    eo.members = options.etcd_members;
    eo.host = infra->bootstrap_host_;
    auto etcd = pdlib_tools::EtcdCluster::Start(eo);
    if (!etcd.ok()) return etcd.status().WithPrefix("etcd");
    infra->etcd_ = std::move(*etcd);
    // No server runs at the bootstrap address with etcd: it only names the deployment.
    infra->bootstrap_port_ = uint16_t(pdlib::control::kDefaultBootstrapPort);
    return infra;
  }
  pdlib::control::BootstrapServerOptions bo;
  bo.host = infra->bootstrap_host_;
  bo.port = 0;
  auto server = pdlib::control::BootstrapServer::Start(bo);
  if (!server.ok()) return server.status().WithPrefix("bootstrap server");
  infra->bootstrap_ = std::move(*server);
  infra->bootstrap_port_ = uint16_t(infra->bootstrap_->port());
  return infra;
}

ChaosInfra::~ChaosInfra() {
  bootstrap_.reset();
  etcd_.reset();
  cluster_.reset();
}

std::string ChaosInfra::HostIp(const std::string& host) const {
  if (!cluster_) return "127.0.0.1";
  const auto* h = cluster_->FindHost(host);
  return h != nullptr ? h->ip : "";
}

StatusOr<pdlib_tools::ChildOptions> ChaosInfra::Place(const std::string& host,
                                                      pdlib_tools::ChildOptions options) const {
  if (!cluster_) return options;
  return cluster_->InHost(host, std::move(options));
}

std::vector<std::string> ChaosInfra::etcd_endpoints() const {
  return etcd_ ? etcd_->endpoints() : std::vector<std::string>{};
}

Status ChaosInfra::StartLinkFault(const std::string& host, FaultKind kind, const FaultParams& p) {
  if (!cluster_) return Status::FailedPrecondition("link faults need --netns");
  switch (kind) {
    case FaultKind::kPartition: return cluster_->Partition(host);
    case FaultKind::kLoss: return cluster_->SetLoss(host, p.loss_percent);
    case FaultKind::kBandwidth: return cluster_->SetBandwidth(host, p.rate_mbit);
    case FaultKind::kLatency: return cluster_->SetLatency(host, p.delay_ms, p.jitter_ms);
    case FaultKind::kRail:
      return p.rate_mbit > 0 ? cluster_->SetRailBandwidth(host, p.rail, p.rate_mbit)
                             : cluster_->PartitionRail(host, p.rail);
    default: break;
  }
  return Status::InvalidArgument(std::string(FaultKindName(kind)) + " is not a link fault");
}

Status ChaosInfra::EndLinkFault(const std::string& host, FaultKind kind, const FaultParams& p) {
  if (!cluster_) return Status::FailedPrecondition("link faults need --netns");
  switch (kind) {
    case FaultKind::kPartition: return cluster_->Heal(host);
    case FaultKind::kLoss: return cluster_->SetLoss(host, 0);
    case FaultKind::kBandwidth: return cluster_->SetBandwidth(host, 0);
    case FaultKind::kLatency: return cluster_->SetLatency(host, 0, 0);
    case FaultKind::kRail:
      return p.rate_mbit > 0 ? cluster_->SetRailBandwidth(host, p.rail, 0)
                             : cluster_->HealRail(host, p.rail);
    default: break;
  }
  return Status::InvalidArgument(std::string(FaultKindName(kind)) + " is not a link fault");
}

void ChaosInfra::StopBootstrap() { bootstrap_.reset(); }

Status ChaosInfra::StartBootstrap() {
  if (bootstrap_ || etcd_) return Status::OK();
  pdlib::control::BootstrapServerOptions bo;
  bo.host = bootstrap_host_;
  bo.port = bootstrap_port_;
  auto server = pdlib::control::BootstrapServer::Start(bo);
  if (!server.ok()) return server.status();
  bootstrap_ = std::move(*server);
  return Status::OK();
}

int ChaosInfra::etcd_size() const { return etcd_ ? etcd_->size() : 0; }

bool ChaosInfra::etcd_running(int member) const { return etcd_ && etcd_->running(member); }

Status ChaosInfra::KillEtcd(int member) {
  if (!etcd_) return Status::FailedPrecondition("no etcd");
  return etcd_->Kill(member);
}

Status ChaosInfra::RelaunchEtcd(int member) {
  if (!etcd_) return Status::FailedPrecondition("no etcd");
  return etcd_->Relaunch(member);
}

bool ChaosInfra::EtcdServing(int member) {
  return etcd_ && etcd_->Serving(member, std::chrono::milliseconds(200));
}

}  // namespace pdlib_chaos
