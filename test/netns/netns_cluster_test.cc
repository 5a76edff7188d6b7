// NetnsCluster (tools/netns): hosts as network namespaces on a bridge, and the faults on their
// links. Sockets are opened inside a host through RunInHost and then used from the test's own
// threads; commands run inside through Exec and ChildProcess.
//
// Every case but the first needs root and `ip netns`: where this machine cannot build a cluster
// it prints "SKIP: <reason>" and passes. A fault the kernel lacks (netem on a kernel without
// sch_netem) is skipped the same way, by that case alone.
#include "tools/netns/netns_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tools/common/child_process.h"

namespace {

using namespace std::chrono_literals;
using pdlib_tools::NetnsCluster;
using Clock = std::chrono::steady_clock;

// A cluster, or null after printing why this machine cannot build one.
std::unique_ptr<NetnsCluster> ClusterOrSkip(pdlib_tools::NetnsClusterOptions options = {}) {
  const pdlib_tools::NetnsCapabilities& capabilities = NetnsCluster::Probe();
  if (!capabilities.netns) {
    WARN("SKIP: " << capabilities.netns_reason);
    return nullptr;
  }
  auto cluster = NetnsCluster::Create(std::move(options));
  INFO(cluster.status().ToString());
  REQUIRE(cluster.ok());
  return std::move(cluster).value();
}

std::string AddHost(NetnsCluster& cluster, const std::string& name) {
  auto ip = cluster.AddHost(name);
  INFO(ip.status().ToString());
  REQUIRE(ip.ok());
  return *ip;
}

void RequireOk(const pdlib::Status& status) {
  INFO(status.ToString());
  REQUIRE(status.ok());
}

// A file descriptor, closed with its owner.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Fd& operator=(Fd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// A socket of `type` in `host`'s namespace ("" for the test's own, the root namespace).
Fd SocketIn(const NetnsCluster& cluster, const std::string& host, int type) {
  int fd = -1;
  auto make_socket = [&] { fd = ::socket(AF_INET, type | SOCK_CLOEXEC, 0); };
  if (host.empty()) {
    make_socket();
  } else {
    RequireOk(cluster.RunInHost(host, make_socket));
  }
  REQUIRE(fd >= 0);
  return Fd(fd);
}

sockaddr_in Address(const std::string& ip, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  REQUIRE(::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) == 1);
  return addr;
}

// Binds `fd` to ip:0 (and listens when it is a stream socket); the port it got.
uint16_t Bind(const Fd& fd, const std::string& ip, bool listen) {
  sockaddr_in addr = Address(ip, 0);
  REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  if (listen) REQUIRE(::listen(fd.get(), 16) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  return ntohs(addr.sin_port);
}

enum class Connect { kConnected, kRefused, kTimedOut, kOtherError };

// A TCP connect from `fd` that gives up after `timeout`.
Connect ConnectWithin(const Fd& fd, const std::string& ip, uint16_t port,
                      std::chrono::milliseconds timeout) {
  const int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK);
  sockaddr_in addr = Address(ip, port);
  int err = 0;
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p = {fd.get(), POLLOUT, 0};
      if (::poll(&p, 1, int(timeout.count())) == 0) return Connect::kTimedOut;
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    }
  }
  ::fcntl(fd.get(), F_SETFL, flags);
  if (err == 0) return Connect::kConnected;
  return err == ECONNREFUSED ? Connect::kRefused : Connect::kOtherError;
}

// A fresh TCP connect from `from` ("" = the root namespace) to ip:port.
Connect ConnectFrom(const NetnsCluster& cluster, const std::string& from, const std::string& ip,
                    uint16_t port, std::chrono::milliseconds timeout) {
  Fd fd = SocketIn(cluster, from, SOCK_STREAM);
  return ConnectWithin(fd, ip, port, timeout);
}

Fd AcceptWithin(const Fd& listener, std::chrono::milliseconds timeout) {
  pollfd p = {listener.get(), POLLIN, 0};
  REQUIRE(::poll(&p, 1, int(timeout.count())) == 1);
  Fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  REQUIRE(conn.get() >= 0);
  return conn;
}

// Reads exactly `n` bytes (blocking).
std::string ReadExactly(const Fd& fd, size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(fd.get(), out.data() + got, n - got);
    REQUIRE(r > 0);
    got += size_t(r);
  }
  return out;
}

// Datagrams from `from` to `to` (both bound UDP sockets): sends `count`, then counts what
// arrives until nothing has for 200 ms.
int DatagramsThrough(const Fd& from, const Fd& to, const std::string& to_ip, uint16_t to_port,
                     int count) {
  const sockaddr_in addr = Address(to_ip, to_port);
  const char payload[64] = "netns loss probe";
  for (int i = 0; i < count; ++i) {
    REQUIRE(::sendto(from.get(), payload, sizeof(payload), 0,
                     reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == sizeof(payload));
  }
  int received = 0;
  char buf[128];
  for (pollfd p = {to.get(), POLLIN, 0}; ::poll(&p, 1, 200) == 1;) {
    if (::recv(to.get(), buf, sizeof(buf), MSG_DONTWAIT) > 0) ++received;
  }
  return received;
}

// Seconds from connect to the last of `bytes` bytes sent over TCP from host `from` to `to`.
double TransferSeconds(const NetnsCluster& cluster, const std::string& from, const std::string& to,
                       size_t bytes) {
  const std::string to_ip = cluster.FindHost(to)->ip;
  Fd listener = SocketIn(cluster, to, SOCK_STREAM);
  const uint16_t port = Bind(listener, to_ip, true);
  Fd client = SocketIn(cluster, from, SOCK_STREAM);
  const auto start = Clock::now();
  REQUIRE(ConnectWithin(client, to_ip, port, 2000ms) == Connect::kConnected);
  Fd server = AcceptWithin(listener, 2000ms);
  std::thread sender([&] {
    const std::string block(64 * 1024, 'x');
    for (size_t sent = 0; sent < bytes;) {
      const ssize_t n = ::write(client.get(), block.data(), std::min(block.size(), bytes - sent));
      if (n <= 0) return;
      sent += size_t(n);
    }
  });
  std::vector<char> buf(64 * 1024);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::read(server.get(), buf.data(), buf.size());
    if (n <= 0) break;
    got += size_t(n);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  sender.join();
  REQUIRE(got == bytes);
  return seconds;
}

// Whether `needle` appears in what `argv` prints (run in the root namespace).
bool Lists(const std::vector<std::string>& argv, const std::string& needle) {
  auto r = pdlib_tools::RunCommand(argv, 10000ms);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return r->output.find(needle) != std::string::npos;
}

bool NameExists(const std::string& name) {
  return Lists({"ip", "netns", "list"}, name) || Lists({"ip", "-o", "link", "show"}, name);
}

}  // namespace

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
