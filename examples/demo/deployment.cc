#include "examples/demo/deployment.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>

#include "examples/proto/pd_serving.grpc.pb.h"
#include "lib/control/net_address.h"
#include "tools/common/child_process.h"
#include "tools/netns/netns_cluster.h"

namespace pdlib::demo {
namespace {

using Clock = std::chrono::steady_clock;
using pdlib_tools::ChildProcess;

int64_t MicrosSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
}

// "key=value" tokens of a line.
std::map<std::string, std::string> Fields(const std::string& line) {
  std::map<std::string, std::string> out;
  std::istringstream in(line);
  for (std::string token; in >> token;) {
    if (size_t eq = token.find('='); eq != std::string::npos) {
      out[token.substr(0, eq)] = token.substr(eq + 1);
    }
  }
  return out;
}

std::string TailOfFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return all.size() > max_bytes ? all.substr(all.size() - max_bytes) : all;
}

}  // namespace

struct Deployment::Impl {
  struct Proc {
    std::string name;
    std::unique_ptr<ChildProcess> child;
    std::string log;
    std::string address;  // host:port of its gRPC service
  };
  DeploymentOptions options;
  std::unique_ptr<pdlib_tools::NetnsCluster> cluster;  // with options.netns
  std::string etcd_dir;                                // its data, removed at the end
  std::vector<Proc> procs;                             // in start order; stopped in reverse
  std::vector<size_t> prefill_procs;
  std::string router_address, colocated_address;
  std::string etcd_endpoint;  // "host:port" with discovery etcd
  int http_port = -1;
  std::shared_ptr<grpc::Channel> router_channel, colocated_channel;

  // Starts `bin` with `args`, waits for a stdout line starting with `ready` and returns it.
  // With netns: a new host `name` (its namespace), else nothing. Where `name` listens.
  StatusOr<std::string> Place(const std::string& name) {
    if (!cluster) return std::string("127.0.0.1");
    auto ip = cluster->AddHost(name);
    if (!ip.ok()) return ip.status();
    if (options.link_mbit > 0) {
      if (Status s = cluster->SetBandwidth(name, options.link_mbit); !s.ok()) return s;
    }
    return *ip;
  }
  std::string IpOf(const std::string& name) const {
    if (!cluster) return "127.0.0.1";
    const auto* h = cluster->FindHost(name);
    return h != nullptr ? h->ip : std::string();
  }

  // Starts `bin` with `args` (in host `name` with netns: Place it first), waits for a stdout
  // line starting with `ready` ("" : none, return at once) and returns it.
  StatusOr<std::string> Launch(const std::string& name, const std::string& bin,
                               const std::vector<std::string>& args, const std::string& ready) {
    Proc p;
    p.name = name;
    p.log = options.log_dir + "/" + name + ".log";
    std::ofstream(p.log, std::ios::trunc).flush();
    pdlib_tools::ChildOptions co{.program = bin,
                                 .args = args,
                                 .stderr_mode = pdlib_tools::ChildOptions::Stderr::kAppendToFile,
                                 .stderr_path = p.log};
    if (cluster) {
      auto in_host = cluster->InHost(name, co);
      if (!in_host.ok()) return in_host.status();
      co = std::move(*in_host);
    }
    p.child = std::make_unique<ChildProcess>(std::move(co));
    if (!p.child->started()) {
      return Status::Unavailable(name + ": could not start " + bin);
    }
    if (ready.empty()) {
      procs.push_back(std::move(p));
      return std::string();
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(options.start_timeout_ms);
    auto line = p.child->Expect(ready, deadline);
    procs.push_back(std::move(p));
    if (!line) {
      return Status::Unavailable(name + ": no '" + ready + "' line within " +
                                 std::to_string(options.start_timeout_ms) + " ms; its log:\n" +
                                 TailOfFile(procs.back().log, 3000));
    }
    return *line;
  }

  // A host's flags; `device` is its --device ("cpu" or "cuda", on options.cuda_device).
  std::vector<std::string> HostArgs(const std::string& ip, const std::string& device) const {
    std::vector<std::string> a = {"--host",      ip,
                                  "--port",      "0",
                                  "--model",     options.model,
                                  "--seed",      std::to_string(options.seed),
                                  "--backend",   options.backend,
                                  "--num-pages", std::to_string(options.num_pages),
                                  "--device",    device,
                                  "--direction", options.direction};
    if (device == "cuda") a.insert(a.end(), {"--cuda-device", std::to_string(options.cuda_device)});
    for (const std::string& o : options.backend_options) {
      a.push_back("--backend-option");
      a.push_back(o);
    }
    if (cluster && options.backend == "ucx") {  // separate hosts: TCP over their link only
      a.insert(a.end(),
               {"--backend-option", "ucx.tls=tcp", "--backend-option", "ucx.net_devices=eth0"});
    }
    if (!etcd_endpoint.empty()) {
      a.insert(a.end(), {"--discovery", "etcd", "--etcd-endpoints", etcd_endpoint});
    }
    return a;
  }

  // One etcd member in host "etcd" (netns) or on 127.0.0.1, serving once its client port
  // accepts connections.
  Status StartEtcd() {
    auto ip = Place("etcd");
    if (!ip.ok()) return ip.status();
    char tmpl[] = "/tmp/pd-demo-etcd-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return Status::Internal("mkdtemp for etcd's data failed");
    etcd_dir = tmpl;
    const uint16_t client_port = cluster ? 2379 : FreeLocalPort();
    const uint16_t peer_port = cluster ? 2380 : FreeLocalPort();
    const std::string client = "http://" + pdlib::control::JoinHostPort(*ip, client_port);
    const std::string peer = "http://" + pdlib::control::JoinHostPort(*ip, peer_port);
    auto started = Launch("etcd", options.etcd_bin,
                          {"--name", "pd-demo", "--data-dir", etcd_dir, "--listen-client-urls",
                           client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                           "--initial-advertise-peer-urls", peer, "--initial-cluster",
                           "pd-demo=" + peer, "--log-level", "warn"},
                          "");
    if (!started.ok()) return started.status();
    const auto deadline = Clock::now() + std::chrono::milliseconds(options.start_timeout_ms);
    while (pdlib::control::ProbeTcpPort(*ip, client_port, std::chrono::milliseconds(200)) !=
           pdlib::control::PortProbe::kListening) {
      if (Clock::now() > deadline || procs.back().child->Wait(Clock::now()) >= 0) {
        return Status::Unavailable("etcd did not serve at " + client + "; its log:\n" +
                                   TailOfFile(procs.back().log, 3000));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    etcd_endpoint = pdlib::control::JoinHostPort(*ip, client_port);
    return Status::OK();
  }

  static uint16_t FreeLocalPort() {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    uint16_t port = 0;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    close(fd);
    return port;
  }

  Status StartAll() {
    if (options.netns) {
      auto c = pdlib_tools::NetnsCluster::Create();
      if (!c.ok()) return c.status().WithPrefix("--netns");
      cluster = std::move(*c);
    }
    if (options.discovery == "etcd") {
      if (Status s = StartEtcd(); !s.ok()) return s;
    } else if (options.discovery != "bootstrap") {
      return Status::InvalidArgument("discovery '" + options.discovery +
                                     "': expected bootstrap or etcd");
    }
    std::vector<std::string> prefill_addrs, decode_addrs, prefill_bootstraps;
    for (size_t i = 0; i < options.prefills.size(); ++i) {
      const std::string n = std::to_string(i);
      std::string boot_host, boot_port;
      if (etcd_endpoint.empty()) {
        auto ip = Place("bootstrap" + n);
        if (!ip.ok()) return ip.status();
        auto boot = Launch("bootstrap" + n, options.bootstrap_bin, {"--host", *ip, "--port", "0"},
                           "pdlib-bootstrap listening on ");
        if (!boot.ok()) return boot.status();
        const std::string boot_addr = boot->substr(boot->rfind(' ') + 1);
        boot_host = *ip;
        boot_port = boot_addr.substr(boot_addr.rfind(':') + 1);
      }
      auto ip = Place("prefill" + n);
      if (!ip.ok()) return ip.status();
      if (!etcd_endpoint.empty()) {  // the deployment's name in etcd: its first host
        boot_host = *ip;
        boot_port = "8998";
      }
      std::vector<std::string> args = HostArgs(*ip, options.device);
      args.insert(args.end(), {"--bootstrap-host", boot_host, "--bootstrap-port", boot_port, "--tp",
                               std::to_string(options.prefills[i].tp), "--pp",
                               std::to_string(options.prefills[i].pp),
                               options.layerwise ? "--layerwise=true" : "--layerwise=false"});
      prefill_bootstraps.push_back(pdlib::control::JoinHostPort(boot_host, std::stoi(boot_port)));
      auto ready = Launch("prefill" + n, options.prefill_bin, args, "READY ");
      if (!ready.ok()) return ready.status();
      prefill_procs.push_back(procs.size() - 1);
      procs.back().address = pdlib::control::JoinHostPort(*ip, std::stoi(Fields(*ready)["port"]));
      prefill_addrs.push_back(procs.back().address);
    }
    for (int32_t i = 0; i < options.decodes; ++i) {
      auto ip = Place("decode" + std::to_string(i));
      if (!ip.ok()) return ip.status();
      std::vector<std::string> args = HostArgs(*ip, options.device);
      args.insert(args.end(), {"--tp", std::to_string(options.decode_tp), "--pp",
                               std::to_string(options.decode_pp)});
      // Warm-up: connect to every prefill deployment before the first request.
      for (const std::string& b : prefill_bootstraps) args.insert(args.end(), {"--connect", b});
      if (!options.decode_test_fault.empty()) {
        args.insert(args.end(), {"--test-fault", options.decode_test_fault});
      }
      if (options.prefix_cache_pages > 0) {
        args.insert(args.end(),
                    {"--prefix-cache-pages", std::to_string(options.prefix_cache_pages)});
      }
      auto ready = Launch("decode" + std::to_string(i), options.decode_bin, args, "READY ");
      if (!ready.ok()) return ready.status();
      procs.back().address = pdlib::control::JoinHostPort(*ip, std::stoi(Fields(*ready)["port"]));
      decode_addrs.push_back(procs.back().address);
    }
    if (options.colocated) {
      auto ip = Place("colocated");
      if (!ip.ok()) return ip.status();
      std::vector<std::string> args = HostArgs(*ip, options.colocated_device);
      args.push_back("--colocated");
      auto ready = Launch("colocated", options.decode_bin, args, "READY ");
      if (!ready.ok()) return ready.status();
      colocated_address = pdlib::control::JoinHostPort(*ip, std::stoi(Fields(*ready)["port"]));
      colocated_channel =
          grpc::CreateChannel(colocated_address, grpc::InsecureChannelCredentials());
    }
    auto router_ip = Place("router");
    if (!router_ip.ok()) return router_ip.status();
    std::vector<std::string> router = {"--host",
                                       *router_ip,
                                       "--port",
                                       "0",
                                       "--http-port",
                                       "0",
                                       "--policy",
                                       options.policy,
                                       "--request-timeout-ms",
                                       std::to_string(options.request_timeout_ms)};
    for (const auto& a : prefill_addrs) router.insert(router.end(), {"--prefill", a});
    for (const auto& a : decode_addrs) router.insert(router.end(), {"--decode", a});
    auto ready = Launch("router", options.router_bin, router, "READY ");
    if (!ready.ok()) return ready.status();
    auto f = Fields(*ready);
    router_address = pdlib::control::JoinHostPort(*router_ip, std::stoi(f["port"]));
    http_port = std::atoi(f["http_port"].c_str());
    router_channel = grpc::CreateChannel(router_address, grpc::InsecureChannelCredentials());
    return Status::OK();
  }

  void StopAll() {
    // Hosts first, then what they registered with (etcd, bootstrap servers), so that prefill
    // ranks can withdraw their registrations as they shut down.
    for (bool infrastructure : {false, true}) {
      auto ours = [&](const Proc& p) {
        const bool infra = p.name.rfind("etcd", 0) == 0 || p.name.rfind("bootstrap", 0) == 0;
        return infra == infrastructure && p.child != nullptr;
      };
      for (auto it = procs.rbegin(); it != procs.rend(); ++it) {
        if (ours(*it)) it->child->Signal(SIGTERM);
      }
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      for (auto it = procs.rbegin(); it != procs.rend(); ++it) {
        if (ours(*it) && it->child->Wait(deadline) < 0) it->child.reset();  // SIGKILL and reap
      }
    }
    procs.clear();
    if (cluster) {
      if (Status s = cluster->Destroy(); !s.ok()) {
        std::fprintf(stderr, "pd-demo: removing the namespaces: %s\n", s.ToString().c_str());
      }
      cluster.reset();
    }
    if (!etcd_dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(etcd_dir, ec);
    }
  }
};

StatusOr<std::unique_ptr<Deployment>> Deployment::Start(const DeploymentOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (impl->options.log_dir.empty()) impl->options.log_dir = ".";
  std::unique_ptr<Deployment> d(new Deployment(std::move(impl)));
  if (Status s = d->impl_->StartAll(); !s.ok()) return s;  // the destructor stops what started
  return d;
}

Deployment::Deployment(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Deployment::~Deployment() { impl_->StopAll(); }

std::string Deployment::router_address() const { return impl_->router_address; }
std::string Deployment::host_ip(const std::string& name) const {
  return impl_->cluster ? impl_->IpOf(name) : std::string();
}
int Deployment::http_port() const { return impl_->http_port; }

std::string Deployment::prefill_address(size_t index) const {
  return index < impl_->prefill_procs.size() ? impl_->procs[impl_->prefill_procs[index]].address
                                             : std::string();
}

void Deployment::KillPrefill(size_t index) {
  if (index < impl_->prefill_procs.size()) {
    auto& p = impl_->procs[impl_->prefill_procs[index]];
    p.child->Signal(SIGKILL);
    p.child->Wait(Clock::now() + std::chrono::seconds(10));
  }
}

std::string Deployment::LogTails(size_t max_bytes_each) const {
  std::string out;
  for (const auto& p : impl_->procs) {
    out += "--- " + p.name + " (" + p.log + ") ---\n" + TailOfFile(p.log, max_bytes_each) + "\n";
  }
  return out;
}

namespace {

// Reads a Generate stream (the router's or a host's: both send tokens, then one result) into an
// Outcome: the client-side TTFT and latency, and what `take_result` copies from the result.
template <typename Event, typename Request, typename Stub, typename TakeResult>
Outcome ReadGenerate(Stub& stub, const Request& req, int32_t timeout_ms, const std::string& who,
                     TakeResult take_result) {
  Outcome out;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  const auto start = Clock::now();
  auto reader = stub.Generate(&ctx, req);
  Event ev;
  bool have_result = false;
  while (reader->Read(&ev)) {
    if (ev.has_token()) {
      if (out.ttft_us == 0) out.ttft_us = MicrosSince(start);
    } else if (ev.has_result()) {
      have_result = true;
      out.ok = ev.result().ok();
      out.reason = ev.result().reason();
      out.output_ids.assign(ev.result().output_ids().begin(), ev.result().output_ids().end());
      take_result(ev.result(), &out);
    }
  }
  grpc::Status st = reader->Finish();
  out.latency_us = MicrosSince(start);
  if (!have_result) {
    out.ok = false;
    out.reason = who + ": " + st.error_message() + " (no result)";
  }
  return out;
}

}  // namespace

Outcome Deployment::Generate(const std::vector<int32_t>& prompt, int32_t max_new_tokens) {
  auto stub = pdlib::serving::Router::NewStub(impl_->router_channel);
  pdlib::serving::GenerateRequest req;
  for (int32_t t : prompt) req.add_prompt_ids(t);
  req.set_max_new_tokens(max_new_tokens);
  return ReadGenerate<pdlib::serving::GenerateEvent>(
      *stub, req, impl_->options.request_timeout_ms + 10000, "router",
      [](const pdlib::serving::GenerateResult& r, Outcome* out) {
        out->transfer_us = r.transfer_us();
        out->exposed_transfer_us = r.exposed_transfer_us();
        out->kv_bytes = r.kv_bytes();
        out->room = r.room();
        out->prefill_host = r.prefill_host();
        out->decode_host = r.decode_host();
      });
}

Outcome Deployment::GenerateColocated(const std::vector<int32_t>& prompt, int32_t max_new_tokens) {
  if (!impl_->colocated_channel) {
    Outcome out;
    out.reason = "no colocated host in this deployment";
    return out;
  }
  auto stub = pdlib::serving::Host::NewStub(impl_->colocated_channel);
  static std::atomic<uint64_t> next_room{1};
  pdlib::serving::HostGenerateRequest req;
  req.set_room(next_room++);
  for (int32_t t : prompt) req.add_prompt_ids(t);
  req.set_max_new_tokens(max_new_tokens);
  req.set_prefill_dp_rank(-1);
  return ReadGenerate<pdlib::serving::HostEvent>(
      *stub, req, impl_->options.request_timeout_ms + 10000, "colocated host",
      [room = req.room()](const pdlib::serving::HostResult&, Outcome* out) { out->room = room; });
}

}  // namespace pdlib::demo
