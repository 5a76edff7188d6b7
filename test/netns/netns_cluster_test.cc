// NetnsCluster (tools/netns): hosts as network namespaces on a bridge, and the faults on their
// links. Sockets are opened inside a host through RunInHost and then used from the test's own
// threads; commands run inside through Exec and ChildProcess.
//
// Every case but the first needs root and `ip netns`: where this machine cannot build a cluster
// it prints "SKIP: <reason>" and passes. A fault the kernel lacks (netem on a kernel without
// sch_netem) is skipped the same way, by that case alone.
#include "tools/netns/netns_cluster.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <vector>

#include "test/netns/netns_test_util.h"
#include "tools/common/child_process.h"

// The helpers of every case, with NetnsCluster, Clock and the chrono literals.
using namespace netns_test;  // NOLINT(build/namespaces)

TEST_CASE("names, subnets and fault commands are computed without root") {
  using namespace pdlib_tools;
  CHECK(Base36(0) == "0");
  CHECK(Base36(35) == "z");
  CHECK(Base36(36) == "10");
  CHECK(ClusterId("pd", 4194304, 1295) == "pd2hwcg_zz");
  CHECK(ClusterId("pdxy", 4194304, 1296) == "pdxy2hwcg_0");
  // The longest names still fit an interface name.
  CHECK((ClusterId("abcd", 4194304, 1295) + "-br").size() <= kMaxInterfaceName);
  CHECK((ClusterId("abcd", 4194304, 1295) + "-" + Base36(252)).size() <= kMaxInterfaceName);

  CHECK(OwnerPidOf("pd2hwcg_zz-br", "pd") == pid_t(4194304));
  CHECK(OwnerPidOf(ClusterId("pd", 1234, 7) + "-decode0", "pd") == pid_t(1234));
  CHECK(OwnerPidOf(ClusterId("pd", 1234, 7), "pd") == pid_t(1234));
  CHECK(OwnerPidOf(ProbeNamespace("pd", 99), "pd") == pid_t(99));
  CHECK_FALSE(OwnerPidOf("pd1234_7-br", "xy"));  // another prefix
  CHECK_FALSE(OwnerPidOf("pdx_bar", "pd"));      // not a serial followed by '-' or the end
  CHECK_FALSE(OwnerPidOf("pd_1-br", "pd"));      // no pid
  CHECK_FALSE(OwnerPidOf("pd123456_1", "pd"));   // too many digits for a pid
  CHECK_FALSE(OwnerPidOf("eth0", "pd"));

  CHECK(IsValidHostName("prefill-0"));
  CHECK(IsValidHostName("etcd.1"));
  CHECK_FALSE(IsValidHostName(""));
  CHECK_FALSE(IsValidHostName("-x"));
  CHECK_FALSE(IsValidHostName("a/b"));
  CHECK_FALSE(IsValidHostName(std::string(33, 'a')));

  auto net = ParseIpv4Net("10.9.8.7/24");
  REQUIRE(net);
  CHECK(net->address == (10u << 24 | 9u << 16 | 8u << 8 | 7u));
  CHECK(FormatIpv4(NetworkOf(*net).address) == "10.9.8.0");
  CHECK(ParseIpv4Net("1.2.3.4")->prefix_length == 32);
  for (const char* bad :
       {"10.9.8", "10.9.8.256", "10.9.8.0/33", "10.9.8.0/", "a.b.c.d", "1.2.3.4 "}) {
    CHECK_FALSE(ParseIpv4Net(bad));
  }
  CHECK(Overlaps(*ParseIpv4Net("10.0.0.0/8"), *ParseIpv4Net("10.200.1.0/24")));
  CHECK_FALSE(Overlaps(*ParseIpv4Net("10.200.2.0/24"), *ParseIpv4Net("10.200.1.0/24")));
  for (uint32_t attempt = 0; attempt < 100; ++attempt) {
    const Ipv4Net subnet = DefaultSubnet(4194303, 1295, attempt);
    CHECK(Overlaps(*ParseIpv4Net("10.128.0.0/9"), subnet));
    CHECK(subnet.prefix_length == 24);
  }
  CHECK_FALSE(Overlaps(DefaultSubnet(1000, 0, 0), DefaultSubnet(1001, 0, 0)));

  CHECK(NftFaultCommand("eth0", false, 0) ==
        "add table netdev pdlib_faults; delete table netdev pdlib_faults");
  const std::string partition = NftFaultCommand("eth0", true, 30);
  CHECK(partition.find("hook ingress device \"eth0\"") != std::string::npos);
  CHECK(partition.find("hook egress device \"eth0\"") != std::string::npos);
  CHECK(partition.find("meta protocol { ip, ip6 } drop;") != std::string::npos);
  CHECK(partition.find("numgen") == std::string::npos);
  CHECK(NftFaultCommand("eth0", false, 7).find("numgen random mod 100 < 7 drop") !=
        std::string::npos);

  CHECK(QdiscAddArgs({}).empty());
  using Args = std::vector<std::vector<std::string>>;
  CHECK(QdiscAddArgs({.rate_mbit = 50}) ==
        Args{{"root", "tbf", "rate", "50mbit", "burst", "62500", "latency", "100ms"}});
  CHECK(QdiscAddArgs({.rate_mbit = 1})[0][5] == "15000");  // never below a few frames
  CHECK(QdiscAddArgs({.delay_ms = 20, .jitter_ms = 5, .rate_mbit = 50}) ==
        Args{{"root", "handle", "1:", "netem", "limit", "10000", "delay", "20ms", "5ms"},
             {"parent", "1:1", "handle", "10:", "tbf", "rate", "50mbit", "burst", "62500",
              "latency", "100ms"}});
}

TEST_CASE("the probe says what this machine offers, with a reason for each no") {
  const pdlib_tools::NetnsCapabilities& c = NetnsCluster::Probe();
  WARN("netns capabilities: " << c.ToString());
  CHECK(c.netns == c.netns_reason.empty());
  CHECK(c.tbf == c.tbf_reason.empty());
  CHECK(c.netem == c.netem_reason.empty());
  CHECK(c.nft == c.nft_reason.empty());
  if (!c.netns) CHECK_FALSE((c.tbf || c.netem || c.nft));
  if (c.netns && !c.netem) CHECK(c.netem_reason.find("netem") != std::string::npos);
}

TEST_CASE("two hosts talk over TCP, and each host's 127.0.0.1 is its own") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  const std::string a = AddHost(*cluster, "prefill");
  const std::string b = AddHost(*cluster, "decode");
  CHECK(a != b);
  CHECK(cluster->HostNames() == std::vector<std::string>{"prefill", "decode"});

  Fd listener = SocketIn(*cluster, "prefill", SOCK_STREAM);
  const uint16_t port = Bind(listener, a, true);
  Fd client = SocketIn(*cluster, "decode", SOCK_STREAM);
  REQUIRE(ConnectWithin(client, a, port, 2000ms) == Connect::kConnected);
  Fd server = AcceptWithin(listener, 2000ms);
  // An echo: decode -> prefill -> decode.
  REQUIRE(::write(client.get(), "ping", 4) == 4);
  const std::string got = ReadExactly(server, 4);
  REQUIRE(::write(server.get(), got.data(), got.size()) == 4);
  CHECK(ReadExactly(client, 4) == "ping");
  // The root namespace reaches hosts through the bridge.
  CHECK(ConnectFrom(*cluster, "", a, port, 2000ms) == Connect::kConnected);

  Fd local = SocketIn(*cluster, "prefill", SOCK_STREAM);
  const uint16_t local_port = Bind(local, "127.0.0.1", true);
  CHECK(ConnectFrom(*cluster, "prefill", "127.0.0.1", local_port, 2000ms) == Connect::kConnected);
  CHECK(ConnectFrom(*cluster, "decode", "127.0.0.1", local_port, 2000ms) == Connect::kRefused);
  // Nor is it on eth0.
  CHECK(ConnectFrom(*cluster, "decode", a, local_port, 2000ms) == Connect::kRefused);
}

TEST_CASE("commands and child processes run inside a host") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  const std::string a = AddHost(*cluster, "router");

  auto addr = cluster->Exec("router", {"ip", "-o", "-4", "addr", "show", "dev", "eth0"}, 10000ms);
  INFO(addr.status().ToString());
  REQUIRE(addr.ok());
  CHECK(addr->exit_status == 0);
  CHECK(addr->output.find(" " + a + "/24 ") != std::string::npos);
  auto links = cluster->Exec("router", {"ip", "-o", "link", "show"}, 10000ms);
  REQUIRE(links.ok());
  CHECK(links->output.find(cluster->bridge()) == std::string::npos);  // the root's links
  auto missing = cluster->Exec("router", {"pdlib-no-such-program"}, 10000ms);
  REQUIRE(missing.ok());
  CHECK(missing->exit_status != 0);
  CHECK(cluster->Exec("nobody", {"true"}, 10000ms).status().code() == pdlib::StatusCode::kNotFound);

  auto options =
      cluster->InHost("router", {.program = "ip",
                                 .args = {"-o", "-4", "addr", "show"},
                                 .stderr_mode = pdlib_tools::ChildOptions::Stderr::kMerge});
  REQUIRE(options.ok());
  CHECK(options->program == "ip");
  pdlib_tools::ChildProcess child(*options);
  REQUIRE(child.started());
  const auto deadline = Clock::now() + 10s;
  std::string output;
  while (auto line = child.ReadLine(deadline)) output += *line + "\n";
  CHECK(child.Wait(deadline) == 0);
  CHECK(output.find(" " + a + "/24 ") != std::string::npos);
  CHECK(output.find(" 127.0.0.1/8 ") != std::string::npos);
  CHECK(output.find(cluster->bridge_ip()) == std::string::npos);

  // This binary itself: the path of /proc/self/exe.
  auto self = cluster->InHost("router", {.args = {"--list-tests"}});
  REQUIRE(self.ok());
  REQUIRE(self->args.size() == 5);
  CHECK(self->args[3].starts_with("/"));
  CHECK(self->args[4] == "--list-tests");
}

TEST_CASE("a partition blocks new connections until it heals") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  const std::string a = AddHost(*cluster, "prefill");
  const std::string b = AddHost(*cluster, "decode");
  Fd listener = SocketIn(*cluster, "prefill", SOCK_STREAM);
  const uint16_t port = Bind(listener, a, true);
  REQUIRE(ConnectFrom(*cluster, "decode", a, port, 2000ms) == Connect::kConnected);

  RequireOk(cluster->Partition("prefill"));
  CHECK(cluster->FindHost("prefill")->partitioned);
  CHECK(ConnectFrom(*cluster, "decode", a, port, 300ms) == Connect::kTimedOut);
  CHECK(ConnectFrom(*cluster, "", a, port, 300ms) == Connect::kTimedOut);
  // From inside too, and silently: the SYN vanishes, the connect does not fail at once.
  Fd decode_listener = SocketIn(*cluster, "decode", SOCK_STREAM);
  const uint16_t decode_port = Bind(decode_listener, b, true);
  CHECK(ConnectFrom(*cluster, "prefill", b, decode_port, 300ms) == Connect::kTimedOut);
  RequireOk(cluster->Partition("prefill"));  // twice is fine

  RequireOk(cluster->Heal("prefill"));
  CHECK(ConnectFrom(*cluster, "decode", a, port, 2000ms) == Connect::kConnected);
  CHECK(ConnectFrom(*cluster, "prefill", b, decode_port, 2000ms) == Connect::kConnected);
  CHECK(cluster->Partition("nobody").code() == pdlib::StatusCode::kNotFound);
}

TEST_CASE("50% loss drops about half the datagrams each way") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  const std::string a = AddHost(*cluster, "prefill");
  const std::string b = AddHost(*cluster, "decode");
  Fd sa = SocketIn(*cluster, "prefill", SOCK_DGRAM);
  Fd sb = SocketIn(*cluster, "decode", SOCK_DGRAM);
  const uint16_t pa = Bind(sa, a, false), pb = Bind(sb, b, false);
  for (const Fd* s : {&sa, &sb}) {  // room for every datagram: only the fault may drop them
    const int bytes = 4 << 20;
    ::setsockopt(s->get(), SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof(bytes));
  }
  // Both ways once, so that neither side still resolves the other's address.
  REQUIRE(DatagramsThrough(sb, sa, a, pa, 1) == 1);
  REQUIRE(DatagramsThrough(sa, sb, b, pb, 1) == 1);

  const pdlib::Status loss = cluster->SetLoss("prefill", 50);
  if (!NetnsCluster::Probe().nft) {
    CHECK(loss.code() == pdlib::StatusCode::kUnimplemented);
    WARN("SKIP: " << loss.message());
    return;
  }
  RequireOk(loss);
  // 200 each way at p = 0.5: 100 expected, standard deviation about 7.
  const int in = DatagramsThrough(sb, sa, a, pa, 200);
  const int out = DatagramsThrough(sa, sb, b, pb, 200);
  WARN("50% loss: " << in << " of 200 arrived at the host, " << out << " of 200 left it");
  CHECK(in >= 50);
  CHECK(in <= 150);
  CHECK(out >= 50);
  CHECK(out <= 150);
  CHECK(cluster->SetLoss("prefill", 101).code() == pdlib::StatusCode::kInvalidArgument);

  RequireOk(cluster->ClearFaults("prefill"));
  CHECK(DatagramsThrough(sb, sa, a, pa, 100) == 100);
  CHECK(DatagramsThrough(sa, sb, b, pb, 100) == 100);
}

TEST_CASE("a bandwidth cap slows a transfer in both directions") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  AddHost(*cluster, "prefill");
  AddHost(*cluster, "decode");
  if (!NetnsCluster::Probe().tbf) {
    CHECK(cluster->SetBandwidth("prefill", 50).code() == pdlib::StatusCode::kUnimplemented);
    WARN("SKIP: " << NetnsCluster::Probe().tbf_reason);
    return;
  }
  // 3 MiB at 50 Mbit/s: 0.5 s; over a bare veth, milliseconds.
  constexpr size_t kBytes = 3 << 20;
  const double free_s = TransferSeconds(*cluster, "prefill", "decode", kBytes);
  RequireOk(cluster->SetBandwidth("prefill", 50));
  const double out_s = TransferSeconds(*cluster, "prefill", "decode", kBytes);
  const double in_s = TransferSeconds(*cluster, "decode", "prefill", kBytes);
  RequireOk(cluster->ClearFaults("prefill"));
  const double after_s = TransferSeconds(*cluster, "prefill", "decode", kBytes);
  WARN("3 MiB: " << free_s << " s uncapped, at 50 Mbit/s " << out_s << " s out and " << in_s
                 << " s in, " << after_s << " s after ClearFaults");
  CHECK(out_s >= 0.35);
  CHECK(in_s >= 0.35);
  CHECK(out_s < 5.0);
  CHECK(in_s < 5.0);
  CHECK(free_s < out_s / 2);
  CHECK(after_s < out_s / 2);
}

TEST_CASE("latency needs netem: it works or says why") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  const std::string a = AddHost(*cluster, "prefill");
  AddHost(*cluster, "decode");
  const pdlib::Status latency = cluster->SetLatency("prefill", 20, 5);
  if (!NetnsCluster::Probe().netem) {
    CHECK(latency.code() == pdlib::StatusCode::kUnimplemented);
    CHECK(latency.message().find("sch_netem") != std::string::npos);
    WARN("SKIP: " << latency.message());
    return;
  }
  RequireOk(latency);
  Fd listener = SocketIn(*cluster, "prefill", SOCK_STREAM);
  const uint16_t port = Bind(listener, a, true);
  // A connect is one round trip: at least 2 x (20 - 5) ms.
  const auto start = Clock::now();
  REQUIRE(ConnectFrom(*cluster, "decode", a, port, 2000ms) == Connect::kConnected);
  CHECK(Clock::now() - start >= 30ms);
  RequireOk(cluster->ClearFaults("prefill"));
}

TEST_CASE("destroying a cluster, also after a failed AddHost, leaves nothing behind") {
  auto cluster = ClusterOrSkip();
  if (!cluster) return;
  const std::string id = cluster->id();
  AddHost(*cluster, "prefill");
  AddHost(*cluster, "decode");
  if (NetnsCluster::Probe().tbf) RequireOk(cluster->SetBandwidth("decode", 100));
  RequireOk(cluster->Partition("decode"));
  CHECK(cluster->AddHost("decode").status().code() == pdlib::StatusCode::kAlreadyExists);
  CHECK(cluster->AddHost("a/b").status().code() == pdlib::StatusCode::kInvalidArgument);

  // Something already holds the next host's veth name: AddHost fails halfway (after making
  // the namespace) and takes back what it made.
  const std::string taken = id + "-" + pdlib_tools::Base36(2);
  REQUIRE(pdlib_tools::RunCommand({"ip", "link", "add", taken, "type", "bridge"}, 10000ms)
              ->exit_status == 0);
  const auto failed = cluster->AddHost("router");
  CHECK_FALSE(failed.ok());
  CHECK(failed.status().message().find("ip link add " + taken) != std::string::npos);
  CHECK_FALSE(Lists({"ip", "netns", "list"}, id + "-router"));
  CHECK(cluster->FindHost("router") == nullptr);

  CHECK(NameExists(id + "-prefill"));
  CHECK(NameExists(id + "-br"));
  cluster.reset();
  CHECK_FALSE(NameExists(id + "-"));
}

TEST_CASE("two clusters at once keep to their own names and subnets") {
  auto first = ClusterOrSkip();
  if (!first) return;
  // The second one on a subnet the test picks.
  const std::string picked = "10.127." + std::to_string(::getpid() % 256) + ".0/24";
  auto second = ClusterOrSkip({.subnet = picked});
  CHECK(second->subnet() == picked);
  CHECK(first->id() != second->id());
  CHECK(first->subnet() != second->subnet());
  CHECK(NetnsCluster::Create({.subnet = picked}).status().code() ==
        pdlib::StatusCode::kAlreadyExists);

  for (NetnsCluster* cluster : {first.get(), second.get()}) {
    const std::string a = AddHost(*cluster, "prefill");  // the same host names in both
    AddHost(*cluster, "decode");
    Fd listener = SocketIn(*cluster, "prefill", SOCK_STREAM);
    const uint16_t port = Bind(listener, a, true);
    CHECK(ConnectFrom(*cluster, "decode", a, port, 2000ms) == Connect::kConnected);
  }
  // A fault on one cluster's host leaves the other's alone.
  RequireOk(first->Partition("prefill"));
  const std::string a2 = second->FindHost("prefill")->ip;
  Fd listener = SocketIn(*second, "prefill", SOCK_STREAM);
  const uint16_t port = Bind(listener, a2, true);
  CHECK(ConnectFrom(*second, "decode", a2, port, 2000ms) == Connect::kConnected);
}

TEST_CASE("CleanupStale removes what a dead process left, and nothing of a live one") {
  auto live = ClusterOrSkip();
  if (!live) return;
  AddHost(*live, "prefill");
  // A pid that is gone: a child that has exited and been reaped.
  pid_t dead = -1;
  {
    pdlib_tools::ChildProcess child({.program = "true"});
    REQUIRE(child.started());
    dead = child.pid();
    REQUIRE(child.Wait(Clock::now() + 10s) == 0);
  }
  const std::string stale = pdlib_tools::ClusterId("pd", dead, 0);
  for (const std::vector<std::string>& argv : std::vector<std::vector<std::string>>{
           {"ip", "link", "add", stale + "-br", "type", "bridge"},
           {"ip", "netns", "add", stale + "-prefill"},
           {"ip", "link", "add", stale + "-0", "type", "veth", "peer", "name", "eth0", "netns",
            stale + "-prefill"}}) {
    auto r = pdlib_tools::RunCommand(argv, 10000ms);
    REQUIRE(r.ok());
    INFO(r->output);
    REQUIRE(r->exit_status == 0);
  }
  auto removed = NetnsCluster::CleanupStale("pd");
  INFO(removed.status().ToString());
  REQUIRE(removed.ok());
  CHECK(*removed >= 1);  // a concurrent test process may have removed some of them first
  CHECK_FALSE(NameExists(stale + "-"));
  CHECK(NameExists(live->id() + "-prefill"));
  CHECK(NameExists(live->bridge()));
  CHECK(NetnsCluster::CleanupStale("PD").status().code() == pdlib::StatusCode::kInvalidArgument);
}
