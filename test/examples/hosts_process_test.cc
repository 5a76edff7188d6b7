// The pd-prefill and pd-decode binaries as pd-router and pd-demo drive them: start each, read
// its READY line, generate through service Host, stop it with SIGTERM and expect exit status 0.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "examples/proto/pd_serving.grpc.pb.h"
#include "hosts_reference.h"
#include "pdlib_kernels/cuda_info.h"
#include "tools/common/child_process.h"

namespace pdlib::hosts {
namespace {

namespace pb = ::pdlib::serving;

// A host binary, its stdout read line by line, its stderr where ours goes.
class Child {
 public:
  explicit Child(std::vector<std::string> argv)
      : process_(
            {.program = argv[0], .args = std::vector<std::string>(argv.begin() + 1, argv.end())}) {
    REQUIRE(process_.started());
  }

  // The next stdout line, or "" after `timeout`.
  std::string ReadLine(std::chrono::milliseconds timeout) {
    return process_.Expect("", std::chrono::steady_clock::now() + timeout).value_or("");
  }

  // Sends `signal` and waits up to `timeout` for the exit; the exit status, or -1.
  int Stop(int signal, std::chrono::milliseconds timeout) {
    process_.Signal(signal);
    return process_.Wait(std::chrono::steady_clock::now() + timeout);
  }

 private:
  pdlib_tools::ChildProcess process_;
};

// "READY role=prefill port=1 bootstrap=h:2" -> {"role": "prefill", "port": "1", ...}.
std::map<std::string, std::string> ParseReady(const std::string& line) {
  std::map<std::string, std::string> out;
  std::istringstream in(line);
  std::string word;
  in >> word;
  if (word != "READY") return out;
  while (in >> word) {
    const size_t eq = word.find('=');
    if (eq != std::string::npos) out[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return out;
}

struct Result {
  std::vector<int32_t> tokens;
  pb::HostResult result;
  grpc::Status status;
};

Result Generate(const std::string& target, const pb::HostGenerateRequest& request) {
  auto stub = pb::Host::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  Result out;
  auto reader = stub->Generate(&ctx, request);
  pb::HostEvent e;
  while (reader->Read(&e)) {
    if (e.has_token()) out.tokens.push_back(e.token().token_id());
    if (e.has_result()) out.result = e.result();
  }
  out.status = reader->Finish();
  return out;
}

TEST_CASE("hosts process: pd-prefill and pd-decode serve 1P1D and exit cleanly on SIGTERM") {
  const std::vector<std::string> common = {"--backend-option", "ucx.tls=shm", "--threads", "1",
                                           "--num-pages",      "64",          "--seed",    "3"};
  std::vector<std::string> pargs = {
      PD_PREFILL_BIN, "--start-bootstrap", "--bootstrap-port", "0", "--tp", "2"};
  pargs.insert(pargs.end(), common.begin(), common.end());
  Child prefill(pargs);
  const auto pready = ParseReady(prefill.ReadLine(std::chrono::seconds(20)));
  REQUIRE(pready.count("port") == 1);
  CHECK(pready.at("role") == "prefill");
  REQUIRE(pready.count("bootstrap") == 1);
  const std::string bootstrap = pready.at("bootstrap");
  const size_t colon = bootstrap.rfind(':');
  REQUIRE(colon != std::string::npos);

  std::vector<std::string> dargs = {PD_DECODE_BIN};
  dargs.insert(dargs.end(), common.begin(), common.end());
  Child decode(dargs);
  const auto dready = ParseReady(decode.ReadLine(std::chrono::seconds(20)));
  REQUIRE(dready.count("port") == 1);
  CHECK(dready.at("role") == "decode");

  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 30; ++i) prompt.push_back((i * 13 + 5) % 512);
  pb::HostGenerateRequest req;
  req.set_room(77);
  req.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
  req.set_max_new_tokens(4);
  req.set_prefill_dp_rank(-1);
  pb::HostGenerateRequest dreq = req;
  dreq.set_bootstrap_host(bootstrap.substr(0, colon));
  dreq.set_bootstrap_port(static_cast<uint32_t>(std::stoul(bootstrap.substr(colon + 1))));
  Result p, d;
  std::thread pt([&] { p = Generate("127.0.0.1:" + pready.at("port"), req); });
  d = Generate("127.0.0.1:" + dready.at("port"), dreq);
  pt.join();
  REQUIRE(d.status.ok());
  REQUIRE(p.status.ok());
  INFO("decode: " << d.result.reason() << "; prefill: " << p.result.reason());
  REQUIRE(d.result.ok());
  REQUIRE(p.result.ok());
  const std::vector<int32_t> want = testing::Reference("small", 3, prompt, 4);
  CHECK(d.tokens == want);
  CHECK(std::vector<int32_t>(d.result.output_ids().begin(), d.result.output_ids().end()) == want);

  CHECK(decode.Stop(SIGTERM, std::chrono::seconds(15)) == 0);
  CHECK(prefill.Stop(SIGTERM, std::chrono::seconds(15)) == 0);
}

TEST_CASE("hosts process: pd-decode --colocated generates on its own") {
  Child host({PD_DECODE_BIN, "--colocated", "--threads", "1", "--num-pages", "64", "--seed", "3"});
  const auto ready = ParseReady(host.ReadLine(std::chrono::seconds(20)));
  REQUIRE(ready.count("port") == 1);
  CHECK(ready.at("role") == "colocated");
  pb::HostGenerateRequest req;
  req.set_room(1);
  for (int32_t t : {7, 8, 9}) req.add_prompt_ids(t);
  req.set_max_new_tokens(3);
  const Result r = Generate("127.0.0.1:" + ready.at("port"), req);
  REQUIRE(r.status.ok());
  INFO(r.result.reason());
  REQUIRE(r.result.ok());
  CHECK(r.tokens == testing::Reference("small", 3, {7, 8, 9}, 3));
  CHECK(host.Stop(SIGINT, std::chrono::seconds(15)) == 0);
}

// A host binary that must exit before serving: its stdout and stderr together, and its status.
using Exited = pdlib_tools::ExitedChild;
Exited RunToExit(std::vector<std::string> argv) {
  return pdlib_tools::RunToExit(argv[0], std::vector<std::string>(argv.begin() + 1, argv.end()),
                                std::chrono::seconds(30));
}

TEST_CASE("hosts process: --device takes cpu or cuda, cuda without a GPU exits 1 with the reason") {
  const Exited bad = RunToExit({PD_DECODE_BIN, "--device", "tpu"});
  INFO(bad.output);
  CHECK(bad.status == 2);
  CHECK_THAT(bad.output, Catch::Contains("--device 'tpu': expected cpu or cuda"));

  const kernels::CudaInfo cuda = kernels::ProbeCuda();
  if (cuda.device_count > 0) {
    WARN("skipped the no-GPU case: CUDA device " << cuda.device_name << " is present");
    return;
  }
  // Every role refuses before serving, with CUDA's own reason, and prints no READY line.
  for (std::vector<std::string> argv :
       {std::vector<std::string>{PD_PREFILL_BIN}, std::vector<std::string>{PD_DECODE_BIN},
        std::vector<std::string>{PD_DECODE_BIN, "--colocated"}}) {
    argv.insert(argv.end(), {"--device", "cuda", "--threads", "1", "--num-pages", "16"});
    const Exited e = RunToExit(argv);
    INFO(argv[0] << (argv.size() > 7 ? " --colocated" : "") << ": " << e.output);
    CHECK(e.status == 1);
    CHECK_THAT(e.output, Catch::Contains("no CUDA device: " + cuda.reason));
    CHECK(e.output.find("READY") == std::string::npos);
  }
}

}  // namespace
}  // namespace pdlib::hosts
