// NetnsCluster's rails (issue #31): with NetnsClusterOptions::rails = N each host has eth0 ...
// eth<N-1>, one link per rail, each rail a bridge and a /24 of its own. The plan (names, subnets,
// commands) is checked without root; the cluster cases need root and skip without it.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "test/netns/netns_test_util.h"
#include "tools/netns/netns_cluster.h"
#include "tools/netns/netns_plan.h"

using namespace netns_test;  // NOLINT(build/namespaces): the helpers of every case

TEST_CASE("rails: names and subnets and commands are computed without root") {
  using namespace pdlib_tools;
  CHECK(RailInterface(0) == "eth0");
  CHECK(RailInterface(7) == "eth7");
  CHECK(RailNamespace("pd1kw_3") == "pd1kw_3-rails");
  CHECK(OwnerPidOf(RailNamespace(ClusterId("pd", 1234, 7)), "pd") == pid_t(1234));
  CHECK(RailBridge(2) == "br2");
  CHECK(RailPort(1, 0) == "r1h0");
  CHECK(RailPort(kMaxRails - 1, 252) == "r7h70");
  CHECK(RailPort(kMaxRails - 1, 252).size() <= kMaxInterfaceName);

  const Ipv4Net rail0 = *ParseIpv4Net("10.130.7.0/24");
  CHECK(FormatIpv4(RailSubnet(rail0, 0).address) == "10.130.7.0");
  CHECK(FormatIpv4(RailSubnet(rail0, 1).address) == "10.130.8.0");
  CHECK(RailSubnet(rail0, 1).prefix_length == 24);
  // The third octet wraps inside the /16 rather than leaving it.
  CHECK(FormatIpv4(RailSubnet(*ParseIpv4Net("10.130.255.0/24"), 2).address) == "10.130.1.0");
  for (int a = 0; a < kMaxRails; ++a) {
    for (int b = a + 1; b < kMaxRails; ++b) {
      CHECK_FALSE(Overlaps(RailSubnet(rail0, a), RailSubnet(rail0, b)));
    }
  }

  using Argvs = std::vector<std::vector<std::string>>;
  CHECK(RailBridgeCommands("pd1_0-rails", 1) ==
        Argvs{{"ip", "-n", "pd1_0-rails", "link", "add", "br1", "type", "bridge"},
              {"ip", "-n", "pd1_0-rails", "link", "set", "br1", "up"}});
  CHECK(RailHostCommands("pd1_0-rails", "pd1_0-decode", 2, 37, "10.130.9.39") ==
        Argvs{{"ip", "-n", "pd1_0-rails", "link", "add", "r2h11", "type", "veth", "peer", "name",
               "eth2", "netns", "pd1_0-decode"},
              {"ip", "-n", "pd1_0-rails", "link", "set", "r2h11", "master", "br2", "up"},
              {"ip", "-n", "pd1_0-decode", "addr", "add", "10.130.9.39/24", "dev", "eth2"},
              {"ip", "-n", "pd1_0-decode", "link", "set", "eth2", "up"}});

  CHECK(RailFaultTable(1) == "pdlib_faults_eth1");
  const std::string cut = NftFaultCommand("eth1", true, 0, RailFaultTable(1));
  CHECK(
      cut.starts_with("add table netdev pdlib_faults_eth1; delete table netdev pdlib_faults_eth1"));
  CHECK(cut.find("hook ingress device \"eth1\"") != std::string::npos);
  CHECK(cut.find("hook egress device \"eth1\"") != std::string::npos);
  CHECK(NftFaultCommand("eth1", false, 0, RailFaultTable(1)) ==
        "add table netdev pdlib_faults_eth1; delete table netdev pdlib_faults_eth1");

  // Refused before anything is built (so also without root).
  for (int rails : {0, -1, kMaxRails + 1}) {
    auto c = NetnsCluster::Create({.rails = rails});
    CHECK(c.status().code() == pdlib::StatusCode::kInvalidArgument);
    CHECK(c.status().message().find("rails") != std::string::npos);
  }
}

TEST_CASE("rails: two hosts have one link per rail and each rail its own subnet") {
  auto cluster = ClusterOrSkip({.rails = 3});
  if (!cluster) return;
  const std::string id = cluster->id();
  AddHost(*cluster, "prefill");
  AddHost(*cluster, "decode");
  CHECK(cluster->rails() == 3);
  CHECK(cluster->rail_netns() == id + "-rails");
  const NetnsCluster::Host* prefill = cluster->FindHost("prefill");
  const NetnsCluster::Host* decode = cluster->FindHost("decode");
  REQUIRE(prefill->rails.size() == 2);
  for (int rail = 0; rail < 3; ++rail) {
    const std::string subnet = cluster->RailSubnetOf(rail);
    INFO("rail " << rail << " subnet " << subnet << " decode " << decode->RailIp(rail));
    const auto net = pdlib_tools::ParseIpv4Net(subnet);
    REQUIRE(net);
    CHECK(pdlib_tools::Overlaps(*net, *pdlib_tools::ParseIpv4Net(decode->RailIp(rail) + "/32")));
    if (rail > 0) CHECK(subnet != cluster->RailSubnetOf(rail - 1));
    // The address is on eth<rail> inside the host.
    auto addr = cluster->Exec(
        "decode", {"ip", "-o", "-4", "addr", "show", "dev", pdlib_tools::RailInterface(rail)},
        10000ms);
    REQUIRE(addr.ok());
    CHECK(addr->output.find(" " + decode->RailIp(rail) + "/24 ") != std::string::npos);
    // And a connection to it works from the other host.
    Fd listener = SocketIn(*cluster, "decode", SOCK_STREAM);
    const uint16_t port = Bind(listener, decode->RailIp(rail), true);
    CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(rail), port, 2000ms) ==
          Connect::kConnected);
  }
  // Rails 1 and up are out of the root namespace's reach (only rail 0 has the bridge address).
  {
    Fd listener = SocketIn(*cluster, "decode", SOCK_STREAM);
    const uint16_t port = Bind(listener, decode->RailIp(1), true);
    CHECK(ConnectFrom(*cluster, "", decode->RailIp(1), port, 300ms) != Connect::kConnected);
  }
  CHECK(NameExists(id + "-rails"));
  cluster.reset();
  CHECK_FALSE(NameExists(id + "-"));
}

TEST_CASE("rails: a cap on one rail slows that rail only") {
  auto cluster = ClusterOrSkip({.rails = 2});
  if (!cluster) return;
  AddHost(*cluster, "prefill");
  AddHost(*cluster, "decode");
  if (!NetnsCluster::Probe().tbf) {
    CHECK(cluster->SetRailBandwidth("prefill", 1, 50).code() == pdlib::StatusCode::kUnimplemented);
    WARN("SKIP: " << NetnsCluster::Probe().tbf_reason);
    return;
  }
  CHECK(cluster->SetRailBandwidth("prefill", 2, 50).code() == pdlib::StatusCode::kInvalidArgument);
  CHECK(cluster->SetRailBandwidth("prefill", -1, 50).code() == pdlib::StatusCode::kInvalidArgument);
  CHECK(cluster->SetRailBandwidth("nobody", 1, 50).code() == pdlib::StatusCode::kNotFound);
  const std::string rail1 = cluster->FindHost("decode")->RailIp(1);
  const std::string back1 = cluster->FindHost("prefill")->RailIp(1);
  // 3 MiB at 50 Mbit/s: 0.5 s; over a bare veth, milliseconds.
  constexpr size_t kBytes = 3 << 20;
  RequireOk(cluster->SetRailBandwidth("prefill", 1, 50));
  const double rail0_s = TransferSeconds(*cluster, "prefill", "decode", kBytes);
  const double out_s = TransferSecondsTo(*cluster, "prefill", "decode", rail1, kBytes);
  const double in_s = TransferSecondsTo(*cluster, "decode", "prefill", back1, kBytes);
  RequireOk(cluster->ClearFaults("prefill"));
  const double after_s = TransferSecondsTo(*cluster, "prefill", "decode", rail1, kBytes);
  WARN("3 MiB with rail 1 at 50 Mbit/s: rail 0 " << rail0_s << " s, rail 1 " << out_s
                                                 << " s out and " << in_s << " s in, " << after_s
                                                 << " s after ClearFaults");
  CHECK(out_s >= 0.35);
  CHECK(in_s >= 0.35);
  CHECK(out_s < 5.0);
  CHECK(rail0_s < out_s / 2);
  CHECK(after_s < out_s / 2);
}

TEST_CASE("rails: a partition of one rail leaves the other rails working until it heals") {
  auto cluster = ClusterOrSkip({.rails = 2});
  if (!cluster) return;
  AddHost(*cluster, "prefill");
  AddHost(*cluster, "decode");
  const NetnsCluster::Host* decode = cluster->FindHost("decode");
  Fd listener0 = SocketIn(*cluster, "decode", SOCK_STREAM);
  const uint16_t port0 = Bind(listener0, decode->RailIp(0), true);
  Fd listener1 = SocketIn(*cluster, "decode", SOCK_STREAM);
  const uint16_t port1 = Bind(listener1, decode->RailIp(1), true);

  RequireOk(cluster->PartitionRail("decode", 1));
  CHECK(cluster->FindHost("decode")->rails[0].partitioned);
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(1), port1, 300ms) == Connect::kTimedOut);
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(0), port0, 2000ms) == Connect::kConnected);
  RequireOk(cluster->PartitionRail("decode", 1));  // twice is fine

  RequireOk(cluster->HealRail("decode", 1));
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(1), port1, 2000ms) == Connect::kConnected);

  // Rail 0 is the host's eth0: Partition and Heal.
  RequireOk(cluster->PartitionRail("decode", 0));
  CHECK(cluster->FindHost("decode")->partitioned);
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(0), port0, 300ms) == Connect::kTimedOut);
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(1), port1, 2000ms) == Connect::kConnected);
  // ClearFaults heals every rail.
  RequireOk(cluster->PartitionRail("decode", 1));
  RequireOk(cluster->ClearFaults("decode"));
  CHECK_FALSE(cluster->FindHost("decode")->rails[0].partitioned);
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(0), port0, 2000ms) == Connect::kConnected);
  CHECK(ConnectFrom(*cluster, "prefill", decode->RailIp(1), port1, 2000ms) == Connect::kConnected);
  CHECK(cluster->PartitionRail("decode", 2).code() == pdlib::StatusCode::kInvalidArgument);
  CHECK(cluster->HealRail("nobody", 1).code() == pdlib::StatusCode::kNotFound);
}
