// pdlib_router_bench: HTTP requests per second through pd-router with keep-alive, one or two
// router binaries side by side in one run (e.g. before and after a change), against fake hosts
// in this process that answer at once, so that the router's own work is what is measured.
//
//   pdlib_router_bench [--router PATH] [--old_router PATH] [--connections 16] [--requests 2000]
//                      [--rounds 3] [--max_tokens 4]
//
// Per router binary and round: start it with --prefill/--decode at the fake hosts, wait for
// READY, then `connections` threads each send `requests` requests on one keep-alive connection
// (httplib::Client; a server that answers `Connection: close` makes it reconnect per request)
// to POST /v1/completions and, separately, GET /health (the HTTP path alone). Every answer is
// checked (status 200; the completion's text is the fake's). Rounds alternate the binaries.
// Prints a table (the median round of each) and one JSON line per row.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "examples/proto/pd_serving.grpc.pb.h"
#include "tools/common/child_process.h"
#include "tools/common/flags.h"

ABSL_FLAG(std::string, router, PDLIB_ROUTER_BINARY, "the pd-router binary to measure");
ABSL_FLAG(std::string, old_router, "", "a second pd-router binary, measured in the same run");
ABSL_FLAG(int, connections, 16, "keep-alive connections (one client thread each)");
ABSL_FLAG(int, requests, 2000, "requests per connection and endpoint");
ABSL_FLAG(int, rounds, 3, "rounds per binary (alternating); the median is reported");
ABSL_FLAG(int, max_tokens, 4, "tokens per completion");

namespace {

namespace pb = ::pdlib::serving;
using Clock = std::chrono::steady_clock;

// A Host that answers at once: prefill with one result, decode with its tokens in one result
// (the router streams them to the client from there).
class InstantHost final : public pb::Host::CallbackService {
 public:
  explicit InstantHost(std::string role) : role_(std::move(role)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~InstantHost() override { server_->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* ctx, const pb::LoadRequest*,
                                    pb::LoadReply* reply) override {
    reply->set_role(role_);
    reply->set_tp_size(1);
    reply->set_pp_size(1);
    reply->set_dp_size(1);
    if (role_ == "prefill") {
      reply->set_bootstrap_host("127.0.0.1");
      reply->set_bootstrap_port(1);
    }
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerWriteReactor<pb::HostEvent>* Generate(
      grpc::CallbackServerContext*, const pb::HostGenerateRequest* request) override {
    class Reply final : public grpc::ServerWriteReactor<pb::HostEvent> {
     public:
      Reply(bool prefill, const pb::HostGenerateRequest& request) {
        pb::HostResult* r = event_.mutable_result();
        r->set_ok(true);
        if (prefill) {
          r->add_output_ids('a');
          r->set_kv_bytes(100 * static_cast<uint64_t>(request.prompt_ids_size()));
        } else {
          for (int32_t i = 0; i < request.max_new_tokens(); ++i) r->add_output_ids('a' + i % 26);
        }
        StartWriteAndFinish(&event_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      pb::HostEvent event_;
    };
    return new Reply(role_ == "prefill", *request);
  }

 private:
  const std::string role_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

struct Figures {
  double req_per_s = 0;
  double p50_us = 0;
  double p99_us = 0;
  uint64_t failed = 0;
};

// `connections` threads, `requests` each on one client; `send` makes one request and says
// whether its answer was right.
Figures Load(int port, int connections, int requests,
             bool (*send)(httplib::Client*, const std::string&), const std::string& arg) {
  std::vector<std::vector<double>> latencies(static_cast<size_t>(connections));
  std::atomic<uint64_t> failed{0};
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int c = 0; c < connections; ++c) {
    threads.emplace_back([&, c] {
      httplib::Client client("127.0.0.1", port);
      client.set_keep_alive(true);
      client.set_tcp_nodelay(true);
      auto& lat = latencies[static_cast<size_t>(c)];
      lat.reserve(static_cast<size_t>(requests));
      for (int i = 0; i < requests; ++i) {
        const auto t0 = Clock::now();
        if (!send(&client, arg)) failed.fetch_add(1, std::memory_order_relaxed);
        lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> all;
  for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  Figures f;
  f.req_per_s = static_cast<double>(all.size()) / seconds;
  f.p50_us = all[all.size() / 2];
  f.p99_us = all[all.size() * 99 / 100];
  f.failed = failed.load();
  return f;
}

bool SendCompletion(httplib::Client* client, const std::string& body) {
  httplib::Result r = client->Post("/v1/completions", body, "application/json");
  return r && r->status == 200 && r->body.find("\"text\":\"abcd") != std::string::npos;
}

bool SendHealth(httplib::Client* client, const std::string& /*unused*/) {
  httplib::Result r = client->Get("/health");
  return r && r->status == 200 && r->body == "ok\n";
}

struct Row {
  std::string which, endpoint;
  std::vector<Figures> rounds;
  Figures Median() const {
    std::vector<Figures> sorted = rounds;
    std::sort(sorted.begin(), sorted.end(),
              [](const Figures& a, const Figures& b) { return a.req_per_s < b.req_per_s; });
    return sorted[sorted.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  pdlib_tools::ParseFlagsNoArguments(
      argc, argv,
      "usage: pdlib_router_bench [flags]\n\nHTTP requests/s through pd-router with keep-alive, "
      "against instant fake hosts\n(more at the top of bench/router/router_bench.cc).");
  const int connections = absl::GetFlag(FLAGS_connections);
  const int requests = absl::GetFlag(FLAGS_requests);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (connections < 1 || requests < 1 || rounds < 1 || max_tokens < 4) {
    std::fprintf(stderr,
                 "pdlib_router_bench: --connections, --requests, --rounds must be >= 1 "
                 "and --max_tokens >= 4\n");
    return 2;
  }
  InstantHost prefill("prefill"), decode("decode");
  std::vector<std::pair<std::string, std::string>> binaries = {
      {"new", absl::GetFlag(FLAGS_router)}};
  if (!absl::GetFlag(FLAGS_old_router).empty()) {
    binaries.insert(binaries.begin(), {"old", absl::GetFlag(FLAGS_old_router)});
  }
  const std::string body =
      R"({"prompt":"a benchmark prompt","max_tokens":)" + std::to_string(max_tokens) + "}";
  std::vector<Row> rows;
  for (const auto& [which, path] : binaries) {
    rows.push_back({which, "POST /v1/completions", {}});
    rows.push_back({which, "GET /health", {}});
  }
  for (int round = 0; round < rounds; ++round) {
    for (size_t b = 0; b < binaries.size(); ++b) {
      pdlib_tools::ChildProcess router(
          {.program = binaries[b].second,
           .args = {"--prefill", prefill.address(), "--decode", decode.address(), "--seed", "1"}});
      std::optional<std::string> ready =
          router.started() ? router.Expect("READY", Clock::now() + std::chrono::seconds(30))
                           : std::nullopt;
      int grpc_port = 0, http_port = 0;
      if (!ready || std::sscanf(ready->c_str(), "READY role=router port=%d http_port=%d",
                                &grpc_port, &http_port) != 2) {
        std::fprintf(stderr, "pdlib_router_bench: %s did not print READY (%s)\n",
                     binaries[b].second.c_str(), router.error().c_str());
        return 1;
      }
      // Warm up: connections, channels to the hosts.
      Load(http_port, connections, 20, SendCompletion, body);
      rows[2 * b].rounds.push_back(Load(http_port, connections, requests, SendCompletion, body));
      rows[2 * b + 1].rounds.push_back(Load(http_port, connections, requests, SendHealth, ""));
      router.Signal(SIGTERM);
      router.Wait(Clock::now() + std::chrono::seconds(20));
    }
  }

  std::printf(
      "pd-router over HTTP/1.1 keep-alive: %d connections x %d requests, median of %d "
      "rounds\n",
      connections, requests, rounds);
  std::printf("%-5s %-22s %12s %10s %10s %8s\n", "which", "endpoint", "req/s", "p50 us", "p99 us",
              "failed");
  bool any_failed = false;
  for (const Row& r : rows) {
    const Figures f = r.Median();
    std::printf("%-5s %-22s %12.0f %10.0f %10.0f %8llu\n", r.which.c_str(), r.endpoint.c_str(),
                f.req_per_s, f.p50_us, f.p99_us, static_cast<unsigned long long>(f.failed));
    for (const Figures& x : r.rounds) any_failed |= x.failed > 0;
  }
  for (const Row& r : rows) {
    const Figures f = r.Median();
    nlohmann::ordered_json j = {{"bench", "router_http"},
                                {"which", r.which},
                                {"endpoint", r.endpoint},
                                {"connections", connections},
                                {"requests_per_connection", requests},
                                {"rounds", rounds},
                                {"req_per_s", static_cast<int64_t>(f.req_per_s)},
                                {"p50_us", static_cast<int64_t>(f.p50_us)},
                                {"p99_us", static_cast<int64_t>(f.p99_us)},
                                {"failed", f.failed}};
    std::printf("%s\n", j.dump().c_str());
  }
  return any_failed ? 1 : 0;
}
