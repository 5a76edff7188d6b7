// Helpers of the NetnsCluster tests (tools/netns): clusters that skip where this machine cannot
// build them, and sockets opened inside a host and then used from the test's own threads.
#ifndef PDLIB_TEST_NETNS_NETNS_TEST_UTIL_H_
#define PDLIB_TEST_NETNS_NETNS_TEST_UTIL_H_

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

#include "tools/netns/netns_cluster.h"

namespace netns_test {

using namespace std::chrono_literals;
using pdlib_tools::NetnsCluster;
using Clock = std::chrono::steady_clock;

// A cluster, or null after printing why this machine cannot build one.
inline std::unique_ptr<NetnsCluster> ClusterOrSkip(pdlib_tools::NetnsClusterOptions options = {}) {
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

inline std::string AddHost(NetnsCluster& cluster, const std::string& name) {
  auto ip = cluster.AddHost(name);
  INFO(ip.status().ToString());
  REQUIRE(ip.ok());
  return *ip;
}

inline void RequireOk(const pdlib::Status& status) {
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
inline Fd SocketIn(const NetnsCluster& cluster, const std::string& host, int type) {
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

inline sockaddr_in Address(const std::string& ip, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  REQUIRE(::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) == 1);
  return addr;
}

// Binds `fd` to ip:0 (and listens when it is a stream socket); the port it got.
inline uint16_t Bind(const Fd& fd, const std::string& ip, bool listen) {
  sockaddr_in addr = Address(ip, 0);
  REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  if (listen) REQUIRE(::listen(fd.get(), 16) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  return ntohs(addr.sin_port);
}

enum class Connect { kConnected, kRefused, kTimedOut, kOtherError };

// A TCP connect from `fd` that gives up after `timeout`.
inline Connect ConnectWithin(const Fd& fd, const std::string& ip, uint16_t port,
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
inline Connect ConnectFrom(const NetnsCluster& cluster, const std::string& from,
                           const std::string& ip, uint16_t port,
                           std::chrono::milliseconds timeout) {
  Fd fd = SocketIn(cluster, from, SOCK_STREAM);
  return ConnectWithin(fd, ip, port, timeout);
}

inline Fd AcceptWithin(const Fd& listener, std::chrono::milliseconds timeout) {
  pollfd p = {listener.get(), POLLIN, 0};
  REQUIRE(::poll(&p, 1, int(timeout.count())) == 1);
  Fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  REQUIRE(conn.get() >= 0);
  return conn;
}

// Reads exactly `n` bytes (blocking).
inline std::string ReadExactly(const Fd& fd, size_t n) {
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
inline int DatagramsThrough(const Fd& from, const Fd& to, const std::string& to_ip,
                            uint16_t to_port, int count) {
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

// Seconds from connect to the last of `bytes` bytes sent over TCP from host `from` to `to_ip`
// (an address of host `to`).
inline double TransferSecondsTo(const NetnsCluster& cluster, const std::string& from,
                                const std::string& to, const std::string& to_ip, size_t bytes) {
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

// The same to `to`'s eth0.
inline double TransferSeconds(const NetnsCluster& cluster, const std::string& from,
                              const std::string& to, size_t bytes) {
  return TransferSecondsTo(cluster, from, to, cluster.FindHost(to)->ip, bytes);
}

// Whether `needle` appears in what `argv` prints (run in the root namespace).
inline bool Lists(const std::vector<std::string>& argv, const std::string& needle) {
  auto r = pdlib_tools::RunCommand(argv, 10000ms);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return r->output.find(needle) != std::string::npos;
}

inline bool NameExists(const std::string& name) {
  return Lists({"ip", "netns", "list"}, name) || Lists({"ip", "-o", "link", "show"}, name);
}

}  // namespace netns_test

#endif  // PDLIB_TEST_NETNS_NETNS_TEST_UTIL_H_
