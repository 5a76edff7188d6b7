#include "tools/etcd/etcd_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lib/control/etcd_client.h"
#include "tools/common/child_process.h"

namespace pdlib_tools {
namespace {

using Clock = std::chrono::steady_clock;
using pdlib::Status;
using pdlib::StatusOr;
using std::chrono::milliseconds;

// The program's path on PATH, or "".
std::string FindOnPath(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) continue;
    const std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

std::optional<std::string> Missing(const std::string& program) {
  if (!FindOnPath(program).empty()) return std::nullopt;
  return absl::StrFormat(
      "%s is not installed (scripts/install-deps.sh installs etcd-server and "
      "etcd-client)",
      program);
}

std::string Url(const std::string& host, uint16_t port) {
  return absl::StrFormat("http://%s:%d", host, port);
}

}  // namespace

std::optional<std::string> EtcdMissing() { return Missing("etcd"); }
std::optional<std::string> EtcdctlMissing() { return Missing("etcdctl"); }

struct EtcdCluster::Member {
  std::string name;
  std::string endpoint;  // 127.0.0.1:client_port
  uint16_t client_port = 0;
  uint16_t peer_port = 0;
  std::string data_dir;
  std::string log_path;
  std::unique_ptr<ChildProcess> process;  // null while killed
};

StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(const EtcdClusterOptions& options) {
  if (auto why = EtcdMissing()) return Status::FailedPrecondition(*why);
  if (options.members < 1) {
    return Status::InvalidArgument(absl::StrFormat("%d etcd members", options.members));
  }
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster());
  cluster->options_ = options;
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/pdlib-etcd-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    return Status::Internal(absl::StrFormat("mkdtemp %s failed", pattern));
  }
  cluster->dir_ = pattern;

  std::vector<std::string> peers;
  for (int i = 0; i < options.members; ++i) {
    auto m = std::make_unique<Member>();
    m->name = absl::StrFormat("m%d", i);
    m->client_port = UnusedPort(options.host);
    m->peer_port = UnusedPort(options.host);
    if (m->client_port == 0 || m->peer_port == 0 || m->client_port == m->peer_port) {
      return Status::Internal("no free ports on " + options.host + " for etcd");
    }
    m->endpoint = absl::StrFormat("%s:%d", options.host, m->client_port);
    m->data_dir = absl::StrFormat("%s/%s.etcd", cluster->dir_, m->name);
    m->log_path = absl::StrFormat("%s/%s.log", cluster->dir_, m->name);
    peers.push_back(absl::StrFormat("%s=%s", m->name, Url(options.host, m->peer_port)));
    cluster->members_.push_back(std::move(m));
  }
  cluster->initial_cluster_ = absl::StrJoin(peers, ",");
  // Every member first: each waits for the others to elect a leader.
  for (int i = 0; i < options.members; ++i) {
    if (Status s = cluster->Launch(i); !s.ok()) return s;
  }
  const Clock::time_point deadline = Clock::now() + options.start_timeout;
  for (int i = 0; i < options.members; ++i) {
    if (Status s = cluster->WaitServing(i, deadline); !s.ok()) return s;
  }
  return cluster;
}

EtcdCluster::~EtcdCluster() {
  for (auto& m : members_) {
    if (m->process) m->process->KillAndReap(milliseconds(5000));
  }
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

Status EtcdCluster::Launch(int i) {
  Member& m = *members_[i];
  const std::string& host = options_.host;
  std::vector<std::string> args = {
      "--name", m.name, "--data-dir", m.data_dir, "--listen-client-urls", Url(host, m.client_port),
      "--advertise-client-urls", Url(host, m.client_port), "--listen-peer-urls",
      Url(host, m.peer_port), "--initial-advertise-peer-urls", Url(host, m.peer_port),
      "--initial-cluster", initial_cluster_, "--initial-cluster-state", "new",
      // Unique per cluster, so that members of two tests' clusters never join each other.
      "--initial-cluster-token", "pdlib-etcd-" + std::filesystem::path(dir_).filename().string(),
      "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"};
  args.insert(args.end(), options_.extra_args.begin(), options_.extra_args.end());
  ChildOptions o;
  // Killed with this process even when it dies without running destructors (setpriv is in
  // util-linux; the death signal follows the spawning thread, the caller's).
  const std::string setpriv = FindOnPath("setpriv");
  if (!setpriv.empty()) {
    o.program = setpriv;
    o.args = {"--pdeathsig", "KILL", FindOnPath("etcd")};
    o.args.insert(o.args.end(), args.begin(), args.end());
  } else {
    o.program = FindOnPath("etcd");
    o.args = std::move(args);
  }
  o.stderr_mode = ChildOptions::Stderr::kAppendToFile;
  o.stderr_path = m.log_path;
  m.process = std::make_unique<ChildProcess>(std::move(o));
  if (!m.process->started()) {
    Status s = Status::Internal(
        absl::StrFormat("etcd member %s did not start: %s", m.name, m.process->error()));
    m.process.reset();
    return s;
  }
  return Status::OK();
}

Status EtcdCluster::WaitServing(int i, Clock::time_point deadline) {
  Member& m = *members_[i];
  pdlib::control::EtcdClientOptions o;
  o.endpoints = {m.endpoint};
  o.dial_timeout = milliseconds(500);
  auto client = pdlib::control::EtcdClient::Create(o);
  if (!client.ok()) return client.status();
  Status last = Status::Unavailable("not asked yet");
  while (Clock::now() < deadline) {
    if (!m.process) return Status::FailedPrecondition("etcd member " + m.name + " is not running");
    if (auto code = m.process->Reap()) {
      m.process.reset();
      return Status::Internal(absl::StrFormat("etcd member %s exited with status %d; its log:\n%s",
                                              m.name, *code, LogTail(i)));
    }
    auto status = (*client)->MemberStatus(m.endpoint, milliseconds(1000));
    if (status.ok() && status->leader != 0) return Status::OK();
    last = status.ok() ? Status::Unavailable("no leader yet") : status.status();
    std::this_thread::sleep_for(milliseconds(50));
  }
  return Status::DeadlineExceeded(
      absl::StrFormat("etcd member %s did not serve within %d ms: %s; its log:\n%s", m.name,
                      options_.start_timeout.count(), last.message(), LogTail(i)));
}

const std::string& EtcdCluster::endpoint(int member) const { return members_.at(member)->endpoint; }

std::vector<std::string> EtcdCluster::endpoints() const {
  std::vector<std::string> out;
  for (const auto& m : members_) out.push_back(m->endpoint);
  return out;
}

bool EtcdCluster::running(int member) const { return members_.at(member)->process != nullptr; }

Status EtcdCluster::Kill(int member) {
  Member& m = *members_.at(member);
  if (!m.process) return Status::FailedPrecondition("etcd member " + m.name + " is not running");
  const int code = m.process->KillAndReap(milliseconds(5000));
  m.process.reset();
  if (code < 0) return Status::Internal("etcd member " + m.name + " would not die");
  return Status::OK();
}

Status EtcdCluster::Restart(int member) {
  if (members_.at(member)->process) {
    return Status::FailedPrecondition("etcd member " + members_[member]->name + " is running");
  }
  if (Status s = Launch(member); !s.ok()) return s;
  return WaitServing(member, Clock::now() + options_.start_timeout);
}

Status EtcdCluster::Relaunch(int member) {
  if (members_.at(member)->process) {
    return Status::FailedPrecondition("etcd member " + members_[member]->name + " is running");
  }
  return Launch(member);
}

bool EtcdCluster::Serving(int member, milliseconds timeout) {
  Member& m = *members_.at(member);
  if (!m.process) return false;
  pdlib::control::EtcdClientOptions o;
  o.endpoints = {m.endpoint};
  o.dial_timeout = timeout;
  auto client = pdlib::control::EtcdClient::Create(o);
  if (!client.ok()) return false;
  auto status = (*client)->MemberStatus(m.endpoint, timeout);
  return status.ok() && status->leader != 0;
}

StatusOr<std::string> EtcdCluster::Etcdctl(const std::vector<std::string>& args,
                                           const std::string& user) {
  if (auto why = EtcdctlMissing()) return Status::FailedPrecondition(*why);
  std::vector<std::string> running_endpoints;
  for (const auto& m : members_) {
    if (m->process) running_endpoints.push_back(m->endpoint);
  }
  ChildOptions o;
  o.program = FindOnPath("etcdctl");
  o.args = {"--endpoints=" + absl::StrJoin(running_endpoints, ","), "--dial-timeout=5s",
            "--command-timeout=10s"};
  if (!user.empty()) o.args.push_back("--user=" + user);
  o.args.insert(o.args.end(), args.begin(), args.end());
  o.env = {"ETCDCTL_API=3"};
  o.stderr_mode = ChildOptions::Stderr::kMerge;
  ChildProcess process(std::move(o));
  if (!process.started()) return Status::Internal("etcdctl did not start: " + process.error());
  const Clock::time_point deadline = Clock::now() + milliseconds(20000);
  std::string output;
  while (auto line = process.ReadLine(deadline)) output += *line + "\n";
  const int code = process.Wait(deadline);
  if (code != 0) {
    return Status::Internal(
        absl::StrFormat("etcdctl %s exited with %d: %s", absl::StrJoin(args, " "), code, output));
  }
  return output;
}

std::string EtcdCluster::LogTail(int member, size_t max_bytes) const {
  return TailOfFile(members_.at(member)->log_path, max_bytes);
}

}  // namespace pdlib_tools
