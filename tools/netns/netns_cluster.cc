#include "tools/netns/netns_cluster.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

namespace pdlib_tools {
namespace {

using pdlib::Status;
using pdlib::StatusOr;

constexpr std::chrono::milliseconds kProbeTimeout{10000};
constexpr int kMaxHosts = 253;  // .2 ... .254 of the /24

// The serial of the next cluster of this process (ClusterId).
std::atomic<uint32_t> next_serial{0};

// "ip -n x link add ..." for messages: arguments with spaces or quotes in single quotes.
std::string CommandLine(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& arg : argv) {
    if (!line.empty()) line += ' ';
    const bool quote = arg.empty() || arg.find_first_of(" \t\"'") != std::string::npos;
    line += quote ? "'" + arg + "'" : arg;
  }
  return line;
}

std::string TrimmedOutput(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  for (char& c : text) {
    if (c == '\n') c = ' ';
  }
  return text;
}

// Empty when `argv` ran and exited 0, else why not (the command and what it printed).
std::string Failure(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  StatusOr<ExecResult> r = RunCommand(argv, timeout);
  if (!r.ok()) return std::string(r.status().message());
  if (r->exit_status == 0) return "";
  return "`" + CommandLine(argv) + "` exited " + std::to_string(r->exit_status) + ": " +
         TrimmedOutput(r->output);
}

// True when a failed delete only says that the thing is already gone.
bool SaysMissing(const std::string& failure) {
  return failure.find("Cannot find device") != std::string::npos ||
         failure.find("No such file or directory") != std::string::npos;
}

// Runs a delete command; a thing already gone is no failure. Empty when fine, else why not.
std::string Delete(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  std::string failure = Failure(argv, timeout);
  return SaysMissing(failure) ? "" : failure;
}

bool ProcessAlive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

bool IsValidPrefix(const std::string& prefix) {
  if (prefix.empty() || prefix.size() > kMaxNamePrefix) return false;
  for (char c : prefix) {
    if (c < 'a' || c > 'z') return false;
  }
  return true;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The networks of every IPv4 address and route in this namespace's main table, or an error.
StatusOr<std::vector<Ipv4Net>> NetworksInUse(std::chrono::milliseconds timeout) {
  std::vector<Ipv4Net> nets;
  StatusOr<ExecResult> addrs = RunCommand({"ip", "-o", "-4", "addr", "show"}, timeout);
  if (!addrs.ok()) return addrs.status();
  for (const std::string& line : Lines(addrs->output)) {
    std::istringstream words(line);
    for (std::string word; words >> word;) {
      if (word == "inet" && words >> word) {
        if (auto net = ParseIpv4Net(word)) nets.push_back(*net);
      }
    }
  }
  StatusOr<ExecResult> routes = RunCommand({"ip", "-4", "route", "show"}, timeout);
  if (!routes.ok()) return routes.status();
  for (const std::string& line : Lines(routes->output)) {
    std::string first = line.substr(0, line.find(' '));
    if (first == "default") continue;
    if (auto net = ParseIpv4Net(first)) nets.push_back(*net);
  }
  return nets;
}

NetnsCapabilities ProbeNow() {
  NetnsCapabilities c;
  auto without_netns = [&](const std::string& why) {
    c.netns_reason = why;
    c.tbf_reason = c.netem_reason = c.nft_reason = "no network namespaces here: " + why;
    return c;
  };
  if (const uid_t uid = ::geteuid(); uid != 0) {
    return without_netns("needs root (this process runs as uid " + std::to_string(uid) +
                         "): namespaces, veths and qdiscs need CAP_SYS_ADMIN and CAP_NET_ADMIN");
  }
  const std::string ns = ProbeNamespace("pd", ::getpid());
  const auto t = kProbeTimeout;
  Delete({"ip", "netns", "del", ns}, t);  // left by an earlier process that had our pid
  if (std::string why = Failure({"ip", "netns", "add", ns}, t); !why.empty()) {
    return without_netns("`ip netns add` failed: " + why);
  }
  std::string why =
      Failure({"ip", "-n", ns, "link", "add", "pv0", "type", "veth", "peer", "name", "pv1"}, t);
  if (why.empty()) why = Failure({"ip", "-n", ns, "link", "add", "pbr", "type", "bridge"}, t);
  if (!why.empty()) {
    without_netns("veth pairs or bridges are missing: " + why);
  } else {
    c.netns = true;
    c.tbf_reason = Failure({"tc", "-n", ns, "qdisc", "add", "dev", "pv0", "root", "tbf", "rate",
                            "10mbit", "burst", "15000", "latency", "100ms"},
                           t);
    c.tbf = c.tbf_reason.empty();
    c.netem_reason =
        Failure({"tc", "-n", ns, "qdisc", "add", "dev", "pv1", "root", "netem", "delay", "1ms"}, t);
    c.netem = c.netem_reason.empty();
    if (!c.netem && c.netem_reason.find("unknown") != std::string::npos) {
      c.netem_reason =
          "kernel has no sch_netem (module missing or CONFIG_NET_SCH_NETEM off): " + c.netem_reason;
    }
    StatusOr<ExecResult> version = RunCommand({"nft", "--version"}, t);
    if (!version.ok()) {
      c.nft_reason =
          "the nft tool is not installed (Debian: apt-get install nftables, or "
          "scripts/install-deps.sh): " +
          std::string(version.status().message());
    } else {
      // The rule SetLoss uses, so that nf_tables' numgen is checked too.
      c.nft_reason =
          Failure({"ip", "netns", "exec", ns, "nft", NftFaultCommand("pv0", false, 1)}, t);
      if (!c.nft_reason.empty()) c.nft_reason = "nf_tables refused a rule: " + c.nft_reason;
    }
    c.nft = c.nft_reason.empty();
  }
  if (std::string left = Delete({"ip", "netns", "del", ns}, t); !left.empty()) {
    std::fprintf(stderr, "NetnsCluster::Probe: %s\n", left.c_str());
  }
  return c;
}

}  // namespace

std::string NetnsCapabilities::ToString() const {
  auto one = [](const char* name, bool yes, const std::string& reason) {
    return std::string(name) + (yes ? " yes" : " no (" + reason + ")");
  };
  return one("netns", netns, netns_reason) + ", " + one("tbf", tbf, tbf_reason) + ", " +
         one("netem", netem, netem_reason) + ", " + one("nft", nft, nft_reason);
}

StatusOr<ExecResult> RunCommand(const std::vector<std::string>& argv,
                                std::chrono::milliseconds timeout) {
  if (argv.empty() || argv[0].empty()) return Status::InvalidArgument("RunCommand: no program");
  ChildOptions options{.program = argv[0],
                       .args = std::vector<std::string>(argv.begin() + 1, argv.end()),
                       .stderr_mode = ChildOptions::Stderr::kMerge};
  ChildProcess child(std::move(options));
  if (!child.started()) {
    return Status::NotFound("`" + CommandLine(argv) + "` could not start: " + child.error());
  }
  const auto deadline = ChildProcess::Clock::now() + timeout;
  ExecResult result;
  while (std::optional<std::string> line = child.ReadLine(deadline)) {
    result.output += *line;
    result.output += '\n';
  }
  result.exit_status = child.output_fd() < 0 ? child.Wait(deadline) : -1;
  if (result.exit_status < 0) {
    child.KillAndReap(std::chrono::milliseconds(2000));
    return Status::DeadlineExceeded("`" + CommandLine(argv) + "` did not finish within " +
                                    std::to_string(timeout.count()) +
                                    " ms; its output so far: " + TrimmedOutput(result.output));
  }
  return result;
}

const NetnsCapabilities& NetnsCluster::Probe() {
  static const NetnsCapabilities capabilities = ProbeNow();
  return capabilities;
}

StatusOr<std::unique_ptr<NetnsCluster>> NetnsCluster::Create(NetnsClusterOptions options) {
  if (!IsValidPrefix(options.prefix)) {
    return Status::InvalidArgument("NetnsCluster prefix \"" + options.prefix +
                                   "\" must be 1 to 4 lowercase letters");
  }
  if (options.rails < 1 || options.rails > kMaxRails) {
    return Status::InvalidArgument("NetnsCluster rails " + std::to_string(options.rails) +
                                   " is not in [1, " + std::to_string(kMaxRails) + "]");
  }
  const NetnsCapabilities& capabilities = Probe();
  if (!capabilities.netns) {
    return Status::FailedPrecondition("no network namespaces here: " + capabilities.netns_reason);
  }
  std::unique_ptr<NetnsCluster> cluster(new NetnsCluster(std::move(options)));
  if (Status s = cluster->Build(); !s.ok()) return s;  // the destructor removes what was made
  return cluster;
}

NetnsCluster::NetnsCluster(NetnsClusterOptions options) : options_(std::move(options)) {
  // relaxed: the serial only has to differ between this process's clusters.
  serial_ = next_serial.fetch_add(1, std::memory_order_relaxed);
  id_ = ClusterId(options_.prefix, ::getpid(), serial_);
}

NetnsCluster::~NetnsCluster() {
  if (Status s = Destroy(); !s.ok()) {
    std::fprintf(stderr, "NetnsCluster %s: cleanup failed: %s\n", id_.c_str(),
                 std::string(s.message()).c_str());
  }
}

Status NetnsCluster::Build() {
  StatusOr<std::vector<Ipv4Net>> in_use = NetworksInUse(options_.command_timeout);
  if (!in_use.ok()) return in_use.status();
  auto taken_by = [&](const Ipv4Net& candidate) -> std::optional<Ipv4Net> {
    for (const Ipv4Net& net : *in_use) {
      if (Overlaps(net, candidate)) return net;
    }
    return std::nullopt;
  };
  Ipv4Net subnet;
  if (!options_.subnet.empty()) {
    std::string text = options_.subnet;
    if (text.find('/') == std::string::npos) text += "/24";
    std::optional<Ipv4Net> parsed = ParseIpv4Net(text);
    if (!parsed || parsed->prefix_length != 24) {
      return Status::InvalidArgument("NetnsCluster subnet \"" + options_.subnet +
                                     "\" is not an IPv4 /24 such as 10.9.8.0/24");
    }
    subnet = NetworkOf(*parsed);
    if (auto net = taken_by(subnet)) {
      return Status::AlreadyExists("NetnsCluster subnet " + FormatIpv4(subnet.address) +
                                   "/24 overlaps " + FormatIpv4(net->address) + "/" +
                                   std::to_string(net->prefix_length) + ", in use here");
    }
  } else {
    bool found = false;
    for (uint32_t attempt = 0; attempt < 64 && !found; ++attempt) {
      subnet = DefaultSubnet(::getpid(), serial_, attempt);
      found = !taken_by(subnet);
    }
    if (!found) {
      return Status::ResourceExhausted(
          "NetnsCluster found no free /24 in 10.128.0.0/9 after 64 tries; pick one "
          "(NetnsClusterOptions::subnet)");
    }
  }
  network_ = subnet.address;
  subnet_ = FormatIpv4(network_) + "/24";
  bridge_ip_ = FormatIpv4(network_ + 1);
  bridge_ = id_ + "-br";
  bridge_made_ = true;  // from here on the destructor deletes it (a missing one is no error)
  for (const auto& argv : std::vector<std::vector<std::string>>{
           {"ip", "link", "add", bridge_, "type", "bridge"},
           {"ip", "addr", "add", bridge_ip_ + "/24", "dev", bridge_},
           {"ip", "link", "set", bridge_, "up"}}) {
    if (Status s = Run(argv); !s.ok()) return s.WithPrefix("NetnsCluster " + id_);
  }
  if (options_.rails > 1) {
    rail_netns_ = RailNamespace(id_);  // from here on Destroy deletes it
    std::vector<std::vector<std::string>> commands = {{"ip", "netns", "add", rail_netns_}};
    for (int rail = 1; rail < options_.rails; ++rail) {
      for (auto& argv : RailBridgeCommands(rail_netns_, rail)) commands.push_back(std::move(argv));
    }
    for (const auto& argv : commands) {
      if (Status s = Run(argv); !s.ok()) return s.WithPrefix("NetnsCluster " + id_ + " rails");
    }
  }
  return Status::OK();
}

std::string NetnsCluster::RailSubnetOf(int rail) const {
  return FormatIpv4(RailSubnet({network_, 24}, rail).address) + "/24";
}

Status NetnsCluster::Run(const std::vector<std::string>& argv) const {
  std::string why = Failure(argv, options_.command_timeout);
  return why.empty() ? Status::OK() : Status::Internal(why);
}

StatusOr<std::string> NetnsCluster::AddHost(const std::string& name) {
  if (!IsValidHostName(name)) {
    return Status::InvalidArgument(
        "host name \"" + name + "\" must be 1 to 32 of [A-Za-z0-9_.-], not starting with - or .");
  }
  if (FindHost(name) != nullptr) {
    return Status::AlreadyExists("cluster " + id_ + " already has a host " + name);
  }
  if (next_index_ >= kMaxHosts) {
    return Status::ResourceExhausted("cluster " + id_ + " has no address left for " + name);
  }
  Host host;
  host.name = name;
  host.netns = id_ + "-" + name;
  host.index = next_index_++;
  host.veth = id_ + "-" + Base36(uint64_t(host.index));
  host.ip = FormatIpv4(network_ + 2 + uint32_t(host.index));
  for (const auto& argv : std::vector<std::vector<std::string>>{
           {"ip", "netns", "add", host.netns},
           {"ip", "-n", host.netns, "link", "set", "lo", "up"},
           {"ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns",
            host.netns},
           {"ip", "link", "set", host.veth, "master", bridge_, "up"},
           {"ip", "-n", host.netns, "addr", "add", host.ip + "/24", "dev", "eth0"},
           {"ip", "-n", host.netns, "link", "set", "eth0", "up"}}) {
    if (Status s = Run(argv); !s.ok()) {
      RemoveHost(host).IgnoreError();  // the error that matters is the first one
      return s.WithPrefix("cluster " + id_ + ": adding host " + name);
    }
  }
  for (int rail = 1; rail < options_.rails; ++rail) {
    Host::RailLink link;
    link.ip = FormatIpv4(RailSubnet({network_, 24}, rail).address + 2 + uint32_t(host.index));
    host.rails.push_back(link);
    for (const auto& argv : RailHostCommands(rail_netns_, host.netns, rail, host.index, link.ip)) {
      if (Status s = Run(argv); !s.ok()) {
        RemoveHost(host).IgnoreError();
        return s.WithPrefix("cluster " + id_ + ": adding host " + name + " to rail " +
                            std::to_string(rail));
      }
    }
  }
  hosts_.push_back(std::move(host));
  // The kernel reports a new link's carrier (operstate "up", what UCX's tcp transport and other
  // programs check before they use a device) up to a second after the link came up (linkwatch):
  // wait for every rail's link, so that a program started in the host right away finds them.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (int rail = 0; rail < options_.rails; ++rail) {
    const std::string link = RailInterface(rail);
    while (true) {
      auto state = Exec(name, {"cat", "/sys/class/net/" + link + "/operstate"},
                        std::chrono::milliseconds(2000));
      if (state.ok() && state->exit_status == 0 && state->output.rfind("up", 0) == 0) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string seen = state.ok() ? state->output.substr(0, state->output.find('\n'))
                                            : state.status().ToString();
        RemoveHost(hosts_.back()).IgnoreError();
        hosts_.pop_back();
        return Status::Unavailable("cluster " + id_ + ": host " + name + "'s " + link +
                                   " is not up after 5 s (operstate: " + seen + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return hosts_.back().ip;
}

const NetnsCluster::Host* NetnsCluster::FindHost(const std::string& name) const {
  for (const Host& host : hosts_) {
    if (host.name == name) return &host;
  }
  return nullptr;
}

NetnsCluster::Host* NetnsCluster::MutableHost(const std::string& name) {
  return const_cast<Host*>(FindHost(name));
}

std::vector<std::string> NetnsCluster::HostNames() const {
  std::vector<std::string> names;
  for (const Host& host : hosts_) names.push_back(host.name);
  return names;
}

Status NetnsCluster::UnknownHost(const std::string& name) const {
  return Status::NotFound("cluster " + id_ + " has no host " + name);
}

StatusOr<ChildOptions> NetnsCluster::InHost(const std::string& host, ChildOptions options) const {
  const Host* h = FindHost(host);
  if (h == nullptr) return UnknownHost(host);
  std::string program = options.program;
  if (program.empty()) {
    char path[4096];
    const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
    if (n <= 0)
      return Status::Internal(std::string("readlink /proc/self/exe: ") + std::strerror(errno));
    program.assign(path, size_t(n));
  }
  std::vector<std::string> args = {"netns", "exec", h->netns, program};
  args.insert(args.end(), options.args.begin(), options.args.end());
  options.program = "ip";
  options.args = std::move(args);
  return options;
}

StatusOr<ExecResult> NetnsCluster::Exec(const std::string& host,
                                        const std::vector<std::string>& argv,
                                        std::chrono::milliseconds timeout) const {
  const Host* h = FindHost(host);
  if (h == nullptr) return UnknownHost(host);
  if (argv.empty()) return Status::InvalidArgument("Exec: no program");
  std::vector<std::string> full = {"ip", "netns", "exec", h->netns};
  full.insert(full.end(), argv.begin(), argv.end());
  return RunCommand(full, timeout);
}

Status NetnsCluster::RunInHost(const std::string& host, const std::function<void()>& fn) const {
  const Host* h = FindHost(host);
  if (h == nullptr) return UnknownHost(host);
  const std::string path = "/run/netns/" + h->netns;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Internal("open " + path + ": " + std::strerror(errno));
  Status result;
  // A fresh thread enters the namespace, so that the caller's thread never changes namespace.
  std::thread thread([&] {
    if (::setns(fd, CLONE_NEWNET) != 0) {
      result = Status::Internal("setns " + path + ": " + std::strerror(errno));
      return;
    }
    fn();
  });
  thread.join();
  ::close(fd);
  return result;
}

Status NetnsCluster::Partition(const std::string& host) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  const Host before = *h;
  h->partitioned = true;
  Status s = ApplyFilters(*h);
  if (!s.ok()) *h = before;
  return s;
}

Status NetnsCluster::Heal(const std::string& host) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  const Host before = *h;
  h->partitioned = false;
  Status s = ApplyFilters(*h);
  if (!s.ok()) *h = before;
  return s;
}

Status NetnsCluster::SetLoss(const std::string& host, int percent) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  if (percent < 0 || percent > 100) {
    return Status::InvalidArgument("loss " + std::to_string(percent) + "% is not in [0, 100]");
  }
  if (percent > 0 && !Probe().nft) {
    return Status::Unimplemented("packet loss needs nft: " + Probe().nft_reason);
  }
  const Host before = *h;
  h->loss_percent = percent;
  Status s = ApplyFilters(*h);
  if (!s.ok()) *h = before;
  return s;
}

Status NetnsCluster::SetBandwidth(const std::string& host, int mbit) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  if (mbit < 0) return Status::InvalidArgument("bandwidth " + std::to_string(mbit) + " mbit < 0");
  if (mbit > 0 && !Probe().tbf) {
    return Status::Unimplemented("a bandwidth cap needs tc tbf: " + Probe().tbf_reason);
  }
  const LinkShape before = h->shape;
  h->shape.rate_mbit = mbit;
  Status s = ApplyQdiscs(*h);
  if (!s.ok()) h->shape = before;
  return s;
}

StatusOr<NetnsCluster::Host::RailLink*> NetnsCluster::RailLinkOf(const std::string& host,
                                                                 int rail) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  if (rail < 1 || rail >= options_.rails) {
    return Status::InvalidArgument("cluster " + id_ + " has rails 0 to " +
                                   std::to_string(options_.rails - 1) + ", not " +
                                   std::to_string(rail));
  }
  return &h->rails[size_t(rail - 1)];
}

Status NetnsCluster::PartitionRail(const std::string& host, int rail) {
  if (rail == 0) return Partition(host);
  return SetRailPartitioned(host, rail, true);
}

Status NetnsCluster::HealRail(const std::string& host, int rail) {
  if (rail == 0) return Heal(host);
  return SetRailPartitioned(host, rail, false);
}

Status NetnsCluster::SetRailPartitioned(const std::string& host, int rail, bool partitioned) {
  StatusOr<Host::RailLink*> link = RailLinkOf(host, rail);
  if (!link.ok()) return link.status();
  const bool before = (*link)->partitioned;
  (*link)->partitioned = partitioned;
  Status s = ApplyRailFilters(*MutableHost(host), rail);
  if (!s.ok()) (*link)->partitioned = before;  // the filters stay as they were
  return s;
}

Status NetnsCluster::ApplyRailFilters(Host& host, int rail) {
  Host::RailLink& link = host.rails[size_t(rail - 1)];
  if (Probe().nft) {
    return Run({"ip", "netns", "exec", host.netns, "nft",
                NftFaultCommand(RailInterface(rail), link.partitioned, 0, RailFaultTable(rail))});
  }
  // Without nft: the host's port on the rail's bridge goes down (eth<rail> loses its carrier).
  if (link.partitioned == link.link_down) return Status::OK();
  Status s = Run({"ip", "-n", rail_netns_, "link", "set", RailPort(rail, host.index),
                  link.partitioned ? "down" : "up"});
  if (s.ok()) link.link_down = link.partitioned;
  return s;
}

Status NetnsCluster::SetRailBandwidth(const std::string& host, int rail, int mbit) {
  if (rail == 0) return SetBandwidth(host, mbit);
  StatusOr<Host::RailLink*> rail_link = RailLinkOf(host, rail);
  if (!rail_link.ok()) return rail_link.status();
  const Host* h = FindHost(host);
  if (mbit < 0) return Status::InvalidArgument("bandwidth " + std::to_string(mbit) + " mbit < 0");
  if (mbit > 0 && !Probe().tbf) {
    return Status::Unimplemented("a bandwidth cap needs tc tbf: " + Probe().tbf_reason);
  }
  Host::RailLink& link = **rail_link;
  const int before = link.rate_mbit;
  link.rate_mbit = mbit;
  // The port in the rail namespace carries traffic to the host, eth<rail> traffic from it.
  Status s = ApplyShape({{{"tc", "-n", rail_netns_, "qdisc"}, RailPort(rail, h->index)},
                         {{"tc", "-n", h->netns, "qdisc"}, RailInterface(rail)}},
                        LinkShape{.rate_mbit = mbit}, &link.qdiscs_set);
  if (!s.ok()) {
    link.rate_mbit = before;
    return s.WithPrefix("host " + h->name + " rail " + std::to_string(rail));
  }
  return s;
}

Status NetnsCluster::SetLatency(const std::string& host, int delay_ms, int jitter_ms) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  if (delay_ms < 0 || jitter_ms < 0) {
    return Status::InvalidArgument("latency " + std::to_string(delay_ms) + " ms, jitter " +
                                   std::to_string(jitter_ms) + " ms: must be >= 0");
  }
  if ((delay_ms > 0 || jitter_ms > 0) && !Probe().netem) {
    return Status::Unimplemented("latency needs tc netem: " + Probe().netem_reason);
  }
  const LinkShape before = h->shape;
  h->shape.delay_ms = delay_ms;
  h->shape.jitter_ms = jitter_ms;
  Status s = ApplyQdiscs(*h);
  if (!s.ok()) h->shape = before;
  return s;
}

Status NetnsCluster::ClearFaults(const std::string& host) {
  Host* h = MutableHost(host);
  if (h == nullptr) return UnknownHost(host);
  h->partitioned = false;
  h->loss_percent = 0;
  h->shape = LinkShape{};
  Status filters = ApplyFilters(*h);
  Status qdiscs = ApplyQdiscs(*h);
  for (int rail = 1; rail < options_.rails; ++rail) {
    const Host::RailLink& link = h->rails[size_t(rail - 1)];
    if (link.partitioned || link.link_down) {
      if (Status s = HealRail(host, rail); !s.ok() && filters.ok()) filters = s;
    }
    if (link.rate_mbit == 0 && !link.qdiscs_set) continue;
    if (Status s = SetRailBandwidth(host, rail, 0); !s.ok() && qdiscs.ok()) qdiscs = s;
  }
  return filters.ok() ? qdiscs : filters;
}

Status NetnsCluster::ApplyFilters(Host& host) {
  if (Probe().nft) {
    return Run({"ip", "netns", "exec", host.netns, "nft",
                NftFaultCommand("eth0", host.partitioned, host.loss_percent)});
  }
  // Without nft a partition sets the link down (in the bridge; eth0 loses its carrier).
  if (host.partitioned == host.link_down) return Status::OK();
  Status s = Run({"ip", "link", "set", host.veth, host.partitioned ? "down" : "up"});
  if (s.ok()) host.link_down = host.partitioned;
  return s;
}

Status NetnsCluster::ApplyQdiscs(Host& host) {
  // Both egresses: the veth in the root namespace carries traffic to the host, eth0 in its
  // namespace traffic from it.
  Status s = ApplyShape({{{"tc", "qdisc"}, host.veth}, {{"tc", "-n", host.netns, "qdisc"}, "eth0"}},
                        host.shape, &host.qdiscs_set);
  return s.ok() ? s : s.WithPrefix("host " + host.name);
}

Status NetnsCluster::ApplyShape(const std::vector<Egress>& egresses, const LinkShape& shape,
                                bool* qdiscs_set) {
  // The old qdiscs go first: a tree of netem and tbf cannot be turned into another in place.
  const std::vector<std::vector<std::string>> adds = QdiscAddArgs(shape);
  Status first;
  for (const auto& [tc, device] : egresses) {
    if (*qdiscs_set) {
      std::vector<std::string> del = tc;
      del.insert(del.end(), {"del", "dev", device, "root"});
      // Fails harmlessly when the old shape never got installed; an add below then tells.
      RunCommand(del, options_.command_timeout).status().IgnoreError();
    }
    for (const std::vector<std::string>& args : adds) {
      std::vector<std::string> add = tc;
      add.insert(add.end(), {"add", "dev", device});
      add.insert(add.end(), args.begin(), args.end());
      if (Status s = Run(add); !s.ok() && first.ok()) first = s;
    }
  }
  // After a failure some qdisc may be left: the next call deletes before adding.
  *qdiscs_set = !adds.empty() || !first.ok();
  return first;
}

Status NetnsCluster::RemoveHost(const Host& host) {
  // The veth first: deleting one end deletes the pair, also when a process still inside keeps
  // the namespace alive after its name is gone.
  std::string why = Delete({"ip", "link", "del", host.veth}, options_.command_timeout);
  for (size_t rail = 1; rail <= host.rails.size(); ++rail) {
    std::string port =
        Delete({"ip", "-n", rail_netns_, "link", "del", RailPort(int(rail), host.index)},
               options_.command_timeout);
    if (why.empty()) why = port;
  }
  std::string ns = Delete({"ip", "netns", "del", host.netns}, options_.command_timeout);
  if (why.empty()) why = ns;
  return why.empty() ? Status::OK() : Status::Internal(why);
}

Status NetnsCluster::Destroy() {
  Status first;
  for (auto it = hosts_.rbegin(); it != hosts_.rend(); ++it) {
    if (Status s = RemoveHost(*it); !s.ok() && first.ok()) first = s;
  }
  hosts_.clear();
  if (!rail_netns_.empty()) {
    if (std::string why = Delete({"ip", "netns", "del", rail_netns_}, options_.command_timeout);
        !why.empty() && first.ok()) {
      first = Status::Internal(why);
    }
    rail_netns_.clear();
  }
  if (bridge_made_) {
    if (std::string why = Delete({"ip", "link", "del", bridge_}, options_.command_timeout);
        !why.empty() && first.ok()) {
      first = Status::Internal(why);
    }
    bridge_made_ = false;
  }
  return first;
}

StatusOr<int> NetnsCluster::CleanupStale(const std::string& prefix) {
  if (!IsValidPrefix(prefix)) {
    return Status::InvalidArgument("prefix \"" + prefix + "\" must be 1 to 4 lowercase letters");
  }
  const auto t = kProbeTimeout;
  auto stale = [&](const std::string& name) {
    const std::optional<pid_t> owner = OwnerPidOf(name, prefix);
    return owner && *owner != ::getpid() && !ProcessAlive(*owner);
  };
  int removed = 0;
  std::string first;
  // Interfaces first ("5: pd1kw_0-0@if2: <...>"): a veth's end in a namespace goes with it.
  StatusOr<ExecResult> links = RunCommand({"ip", "-o", "link", "show"}, t);
  if (!links.ok()) return links.status();
  for (const std::string& line : Lines(links->output)) {
    const size_t start = line.find(": ");
    if (start == std::string::npos) continue;
    const std::string name =
        line.substr(start + 2, line.find_first_of("@:", start + 2) - start - 2);
    if (!stale(name)) continue;
    std::string why = Failure({"ip", "link", "del", name}, t);
    if (why.empty()) ++removed;
    if (!SaysMissing(why) && !why.empty() && first.empty()) first = why;
  }
  // "name" or "name (id: 3)".
  StatusOr<ExecResult> namespaces = RunCommand({"ip", "netns", "list"}, t);
  if (!namespaces.ok()) return namespaces.status();
  for (const std::string& line : Lines(namespaces->output)) {
    const std::string name = line.substr(0, line.find(' '));
    if (!stale(name)) continue;
    std::string why = Failure({"ip", "netns", "del", name}, t);
    if (why.empty()) ++removed;
    if (!SaysMissing(why) && !why.empty() && first.empty()) first = why;
  }
  if (!first.empty()) return Status::Internal("CleanupStale: " + first);
  return removed;
}

}  // namespace pdlib_tools
