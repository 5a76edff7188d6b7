#include "examples/demo/deployment.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include "examples/proto/pd_serving.grpc.pb.h"
#include "tools/common/child_process.h"

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
  std::vector<Proc> procs;  // in start order; stopped in reverse
  std::vector<size_t> prefill_procs;
  std::string router_address, colocated_address;
  int http_port = -1;
  std::shared_ptr<grpc::Channel> router_channel, colocated_channel;

  // Starts `bin` with `args`, waits for a stdout line starting with `ready` and returns it.
  StatusOr<std::string> Launch(const std::string& name, const std::string& bin,
                               const std::vector<std::string>& args, const std::string& ready) {
    Proc p;
    p.name = name;
    p.log = options.log_dir + "/" + name + ".log";
    std::ofstream(p.log, std::ios::trunc).flush();
    p.child = std::make_unique<ChildProcess>(
        pdlib_tools::ChildOptions{.program = bin,
                                  .args = args,
                                  .stderr_mode = pdlib_tools::ChildOptions::Stderr::kAppendToFile,
                                  .stderr_path = p.log});
    if (!p.child->started()) {
      return Status::Unavailable(name + ": could not start " + bin);
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

  std::vector<std::string> HostArgs() const {
    std::vector<std::string> a = {
        "--host",    "127.0.0.1",     "--port",      "0",
        "--model",   options.model,   "--seed",      std::to_string(options.seed),
        "--backend", options.backend, "--num-pages", std::to_string(options.num_pages)};
    for (const std::string& o : options.backend_options) {
      a.push_back("--backend-option");
      a.push_back(o);
    }
    return a;
  }

  Status StartAll() {
    std::vector<std::string> prefill_addrs, decode_addrs, prefill_bootstraps;
    for (size_t i = 0; i < options.prefills.size(); ++i) {
      const std::string n = std::to_string(i);
      auto boot = Launch("bootstrap" + n, options.bootstrap_bin,
                         {"--host", "127.0.0.1", "--port", "0"}, "pdlib-bootstrap listening on ");
      if (!boot.ok()) return boot.status();
      const std::string boot_addr = boot->substr(boot->rfind(' ') + 1);
      const std::string boot_port = boot_addr.substr(boot_addr.rfind(':') + 1);
      std::vector<std::string> args = HostArgs();
      args.insert(args.end(), {"--bootstrap-host", "127.0.0.1", "--bootstrap-port", boot_port,
                               "--tp", std::to_string(options.prefills[i].tp), "--pp",
                               std::to_string(options.prefills[i].pp),
                               options.layerwise ? "--layerwise=true" : "--layerwise=false"});
      prefill_bootstraps.push_back("127.0.0.1:" + boot_port);
      auto ready = Launch("prefill" + n, options.prefill_bin, args, "READY ");
      if (!ready.ok()) return ready.status();
      prefill_procs.push_back(procs.size() - 1);
      procs.back().address = "127.0.0.1:" + Fields(*ready)["port"];
      prefill_addrs.push_back(procs.back().address);
    }
    for (int32_t i = 0; i < options.decodes; ++i) {
      std::vector<std::string> args = HostArgs();
      args.insert(args.end(), {"--tp", std::to_string(options.decode_tp), "--pp",
                               std::to_string(options.decode_pp)});
      // Warm-up: connect to every prefill deployment before the first request.
      for (const std::string& b : prefill_bootstraps) args.insert(args.end(), {"--connect", b});
      if (!options.decode_test_fault.empty()) {
        args.insert(args.end(), {"--test-fault", options.decode_test_fault});
      }
      auto ready = Launch("decode" + std::to_string(i), options.decode_bin, args, "READY ");
      if (!ready.ok()) return ready.status();
      procs.back().address = "127.0.0.1:" + Fields(*ready)["port"];
      decode_addrs.push_back(procs.back().address);
    }
    if (options.colocated) {
      std::vector<std::string> args = HostArgs();
      args.push_back("--colocated");
      auto ready = Launch("colocated", options.decode_bin, args, "READY ");
      if (!ready.ok()) return ready.status();
      colocated_address = "127.0.0.1:" + Fields(*ready)["port"];
      colocated_channel =
          grpc::CreateChannel(colocated_address, grpc::InsecureChannelCredentials());
    }
    std::vector<std::string> router = {"--host",
                                       "127.0.0.1",
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
    router_address = "127.0.0.1:" + f["port"];
    http_port = std::atoi(f["http_port"].c_str());
    router_channel = grpc::CreateChannel(router_address, grpc::InsecureChannelCredentials());
    return Status::OK();
  }

  void StopAll() {
    for (auto it = procs.rbegin(); it != procs.rend(); ++it) it->child->Signal(SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (auto it = procs.rbegin(); it != procs.rend(); ++it) {
      if (it->child->Wait(deadline) < 0) it->child.reset();  // SIGKILL and reap
    }
    procs.clear();
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
