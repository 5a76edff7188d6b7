// EtcdCluster: real etcd members on one address of this machine, for the tests of the etcd
// client and of etcd discovery (through test/support/etcd_launcher.h) and for pdlib-chaos
// --discovery etcd, which kills and restarts members (target pdlib_tool_etcd; not installed).
//
// Each member listens on free ports of `host` (127.0.0.1 by default; pdlib-chaos --netns uses
// the bridge's address, which every network-namespace host reaches) with its own data
// directory under one temporary directory, which the destructor removes after killing every
// member. Members run through pdlib_tools::ChildProcess (and `setpriv --pdeathsig KILL` where
// present, so that a caller that crashes does not leave etcd running). Their logs (warnings and
// errors) go to files whose tail LogTail() returns.
//
// Callers skip, with the reason, where etcd is not installed:
//   if (auto why = pdlib_tools::EtcdMissing()) { ...print *why and skip... }
//
// Threads: one thread per object.
#ifndef PDLIB_TOOLS_ETCD_ETCD_CLUSTER_H_
#define PDLIB_TOOLS_ETCD_ETCD_CLUSTER_H_

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pdlib/status.h"

namespace pdlib_tools {

// Why etcd cannot run here ("etcd is not installed ..."), or nullopt when it can.
std::optional<std::string> EtcdMissing();
// The same for etcdctl (tests that enable auth or compact use it).
std::optional<std::string> EtcdctlMissing();

struct EtcdClusterOptions {
  int members = 1;
  // The IPv4 address every member listens on (clients and peers).
  std::string host = "127.0.0.1";
  // How long Start() and Restart() wait for the members to serve (a leader elected).
  std::chrono::milliseconds start_timeout{30000};
  // Appended to every member's command line (e.g. {"--auth-token-ttl", "1"}).
  std::vector<std::string> extra_args;
};

class EtcdCluster {
 public:
  // Starts the members and waits until each one serves and knows a leader.
  static pdlib::StatusOr<std::unique_ptr<EtcdCluster>> Start(const EtcdClusterOptions& options);
  static pdlib::StatusOr<std::unique_ptr<EtcdCluster>> Start() {
    return Start(EtcdClusterOptions{});
  }

  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;
  ~EtcdCluster();  // kills every member, removes the data

  int size() const { return static_cast<int>(members_.size()); }
  // The client endpoint of one member ("host:port") or of all.
  const std::string& endpoint(int member) const;
  std::vector<std::string> endpoints() const;

  // SIGKILL, as a crash would; the member's data stays for Restart().
  pdlib::Status Kill(int member);
  // Starts a killed member again (same name, ports and data) and waits until it serves.
  pdlib::Status Restart(int member);
  // Starts a killed member again and returns at once; Serving() tells when it is back.
  pdlib::Status Relaunch(int member);
  // One quick question (up to `timeout`) to a running member: does it serve and know a leader?
  bool Serving(int member, std::chrono::milliseconds timeout);
  bool running(int member) const;

  // Runs `etcdctl --endpoints=<all running> args...` (API v3) and returns what it printed;
  // an error with that output when it exits non-zero. `user` is "name:password" or "".
  pdlib::StatusOr<std::string> Etcdctl(const std::vector<std::string>& args,
                                       const std::string& user = "");

  // The last `max_bytes` of a member's log, for failure messages.
  std::string LogTail(int member, size_t max_bytes = 2000) const;

 private:
  struct Member;
  EtcdCluster() = default;
  pdlib::Status Launch(int member);
  pdlib::Status WaitServing(int member, std::chrono::steady_clock::time_point deadline);

  EtcdClusterOptions options_;
  std::string dir_;  // the temporary directory holding every member's data and log
  std::string initial_cluster_;
  std::vector<std::unique_ptr<Member>> members_;
};

}  // namespace pdlib_tools

#endif  // PDLIB_TOOLS_ETCD_ETCD_CLUSTER_H_
