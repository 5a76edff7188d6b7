// pd-prefill / pd-decode as the router sees them, in one process: two Hosts on the gRPC control
// plane (prefill runs its own bootstrap server on a free port), each served by a HostService on
// 127.0.0.1; a client calls Generate on both as the router does and GetLoad. Plus the command
// line (host_flags.h).
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <string>
#include <thread>
#include <vector>

#include "examples/hosts/host_flags.h"
#include "examples/hosts/host_service.h"
#include "examples/proto/pd_serving.grpc.pb.h"
#include "hosts_reference.h"
#include "pdlib_kernels/cuda_info.h"

namespace pdlib::hosts {
namespace {

namespace pb = ::pdlib::serving;

struct Stream {
  std::vector<pb::HostToken> tokens;
  pb::HostResult result;
  int results = 0;
  grpc::Status status;
};

Stream Generate(const std::string& target, const pb::HostGenerateRequest& request) {
  auto stub = pb::Host::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  Stream out;
  auto reader = stub->Generate(&ctx, request);
  pb::HostEvent e;
  while (reader->Read(&e)) {
    if (e.has_token()) out.tokens.push_back(e.token());
    if (e.has_result()) {
      out.result = e.result();
      ++out.results;
    }
  }
  out.status = reader->Finish();
  return out;
}

pb::LoadReply GetLoad(const std::string& target) {
  auto stub = pb::Host::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::LoadReply reply;
  const grpc::Status s = stub->GetLoad(&ctx, pb::LoadRequest(), &reply);
  REQUIRE(s.ok());
  return reply;
}

HostOptions GrpcOptions(Role role) {
  HostOptions o;
  o.role = role;
  o.seed = 11;
  o.backend = "ucx";
  o.backend_options = {{"ucx.tls", "shm"}};
  o.threads_per_rank = 1;
  o.num_pages = 64;
  o.max_running = 4;
  o.chunked_prefill_size = 24;
  o.reserved_decode_tokens = 16;
  o.idle_poll = std::chrono::microseconds(200);
  return o;
}

TEST_CASE("hosts service: 1P1D over gRPC as the router drives it") {
  HostOptions po = GrpcOptions(Role::kPrefill);
  po.tp_size = 2;
  po.start_bootstrap = true;
  po.bootstrap_port = 0;  // the host runs the bootstrap server and picks its port
  auto prefill = Host::Create(po);
  INFO(prefill.status().ToString());
  REQUIRE(prefill.ok());
  const BootstrapAddress bootstrap = (*prefill)->bootstrap();
  CHECK(bootstrap.port != 0);
  auto decode = Host::Create(GrpcOptions(Role::kDecode));
  INFO(decode.status().ToString());
  REQUIRE(decode.ok());
  auto prefill_service = HostService::Start({}, prefill->get());
  auto decode_service = HostService::Start({}, decode->get());
  REQUIRE(prefill_service.ok());
  REQUIRE(decode_service.ok());

  const pb::LoadReply pl = GetLoad((*prefill_service)->address());
  CHECK(pl.role() == "prefill");
  CHECK((pl.tp_size() == 2 && pl.pp_size() == 1 && pl.dp_size() == 1));
  CHECK(pl.bootstrap_host() == bootstrap.host);
  CHECK(pl.bootstrap_port() == bootstrap.port);
  const pb::LoadReply dl = GetLoad((*decode_service)->address());
  CHECK(dl.role() == "decode");
  CHECK(dl.bootstrap_port() == 0);

  std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}, {}};
  for (int32_t i = 0; i < 40; ++i) prompts[1].push_back((i * 37 + 11) % 512);
  std::vector<Stream> p_out(prompts.size()), d_out(prompts.size());
  std::vector<std::thread> calls;
  for (size_t k = 0; k < prompts.size(); ++k) {
    pb::HostGenerateRequest req;
    req.set_room(500 + k);
    req.mutable_prompt_ids()->Add(prompts[k].begin(), prompts[k].end());
    req.set_max_new_tokens(5);
    req.set_prefill_dp_rank(-1);
    calls.emplace_back([&, k, req] { p_out[k] = Generate((*prefill_service)->address(), req); });
    pb::HostGenerateRequest dreq = req;
    dreq.set_bootstrap_host(bootstrap.host);
    dreq.set_bootstrap_port(bootstrap.port);
    calls.emplace_back([&, k, dreq] { d_out[k] = Generate((*decode_service)->address(), dreq); });
  }
  for (auto& t : calls) t.join();
  for (size_t k = 0; k < prompts.size(); ++k) {
    INFO("prompt " << k);
    const Stream& d = d_out[k];
    const Stream& p = p_out[k];
    REQUIRE(d.status.ok());
    REQUIRE(p.status.ok());
    CHECK((d.results == 1 && p.results == 1));
    INFO("decode: " << d.result.reason() << "; prefill: " << p.result.reason());
    REQUIRE(d.result.ok());
    REQUIRE(p.result.ok());
    const std::vector<int32_t> want = testing::Reference("small", 11, prompts[k], 5);
    const std::vector<int32_t> got(d.result.output_ids().begin(), d.result.output_ids().end());
    CHECK(got == want);
    REQUIRE(d.tokens.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      CHECK(d.tokens[i].index() == static_cast<int32_t>(i));
      CHECK(d.tokens[i].token_id() == want[i]);
    }
    CHECK(p.tokens.empty());
    CHECK((p.result.output_ids_size() == 1 && p.result.output_ids(0) == want[0]));
    CHECK(p.result.kv_bytes() == d.result.kv_bytes());
    CHECK(d.result.kv_bytes() > 0);
    CHECK(d.result.first_token_us() > 0);
    CHECK(d.result.finish_us() >= d.result.first_token_us());
  }

  // A failed request: ok=false with the code and reason on an OK stream.
  pb::HostGenerateRequest bad;
  bad.set_room(900);
  bad.add_prompt_ids(1);
  bad.set_max_new_tokens(0);
  const Stream b = Generate((*decode_service)->address(), bad);
  CHECK(b.status.ok());
  CHECK(!b.result.ok());
  CHECK(b.result.code() == static_cast<int32_t>(StatusCode::kInvalidArgument));
  CHECK(!b.result.reason().empty());

  (*decode)->Shutdown();
  (*prefill)->Shutdown();
  (*decode_service)->Shutdown();
  (*prefill_service)->Shutdown();
}

StatusOr<HostFlags> Parse(Role program, std::vector<std::string_view> args) {
  return ParseHostFlags(program, args);
}

TEST_CASE("hosts flags: parsing and defaults and refusals") {
  auto d = Parse(Role::kPrefill, {});
  REQUIRE(d.ok());
  CHECK(d->host.backend == "ucx");
  CHECK((d->grpc_host == "127.0.0.1" && d->grpc_port == 0));
  CHECK(d->host.bootstrap_timeout == std::chrono::milliseconds(10000));
  CHECK(d->host.transfer_timeout == std::chrono::milliseconds(30000));

  auto p = Parse(Role::kPrefill, {"--host",
                                  "0.0.0.0",
                                  "--port=7000",
                                  "--model",
                                  "small-hybrid",
                                  "--tp",
                                  "2",
                                  "--pp=2",
                                  "--backend",
                                  "fake",
                                  "--backend-option",
                                  "ucx.tls=shm",
                                  "--backend-option=ucx.net_devices=lo",
                                  "--bootstrap-port",
                                  "0",
                                  "--start-bootstrap",
                                  "--num-pages",
                                  "128",
                                  "--max-running",
                                  "8",
                                  "--chunked-prefill-size",
                                  "64",
                                  "--transfer-timeout-ms",
                                  "1234",
                                  "--seed",
                                  "9"});
  INFO(p.status().ToString());
  REQUIRE(p.ok());
  CHECK((p->grpc_host == "0.0.0.0" && p->host.listen_host == "0.0.0.0" && p->grpc_port == 7000));
  CHECK((p->host.model == "small-hybrid" && p->host.tp_size == 2 && p->host.pp_size == 2));
  CHECK(p->host.backend == "fake");
  CHECK(p->host.backend_options ==
        std::map<std::string, std::string>{{"ucx.tls", "shm"}, {"ucx.net_devices", "lo"}});
  CHECK((p->host.start_bootstrap && p->host.bootstrap_port == 0));
  CHECK((p->host.num_pages == 128 && p->host.max_running == 8 &&
         p->host.chunked_prefill_size == 64 && p->host.seed == 9));
  CHECK(p->host.transfer_timeout == std::chrono::milliseconds(1234));

  // Every parse starts from the defaults (the flags are process-wide).
  auto reset = Parse(Role::kPrefill, {});
  REQUIRE(reset.ok());
  CHECK((reset->host.num_pages == 512 && reset->host.tp_size == 1 &&
         reset->host.backend_options.empty() && !reset->host.start_bootstrap));

  auto c = Parse(Role::kDecode, {"--colocated"});
  REQUIRE(c.ok());
  CHECK(c->host.role == Role::kColocated);

  // Issue #20: decode warms up its connections to the deployments it is given.
  auto w = Parse(Role::kDecode, {"--connect", "127.0.0.1:9000", "--connect=10.0.0.2:8998"});
  INFO(w.status().ToString());
  REQUIRE(w.ok());
  CHECK(w->host.connect == std::vector<std::string>{"127.0.0.1:9000", "10.0.0.2:8998"});
  for (std::string_view bad : {"nohost", "127.0.0.1:0", ":9000", "127.0.0.1:x"}) {
    auto b = Parse(Role::kDecode, {"--connect", bad});
    INFO(bad);
    CHECK(b.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(b.status().message()), Catch::Contains("--connect wants HOST:PORT"));
  }
  CHECK(Parse(Role::kPrefill, {"--connect", "127.0.0.1:9000"}).status().code() ==
        StatusCode::kInvalidArgument);

  // Decode runs any TP and PP the model splits into.
  auto tp = Parse(Role::kDecode, {"--tp", "2", "--pp", "2", "--model", "small-mla"});
  INFO(tp.status().ToString());
  REQUIRE(tp.ok());
  CHECK((tp->host.tp_size == 2 && tp->host.pp_size == 2 && tp->host.model == "small-mla"));
  CHECK(tp->host.test_fault.empty());
  auto tp3 = Parse(Role::kDecode, {"--tp", "3"});
  CHECK(tp3.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(tp3.status().message()), Catch::Contains("model small with tp 3 pp 1"));
  CHECK(Parse(Role::kDecode, {"--model", "small-swa", "--tp", "4"}).ok());
  // The test-only fault: decode only, one value.
  auto fault = Parse(Role::kDecode, {"--test-fault", "swap-heads"});
  REQUIRE(fault.ok());
  CHECK(fault->host.test_fault == "swap-heads");
  CHECK(!Parse(Role::kDecode, {"--test-fault", "flip-bits"}).ok());
  CHECK(Parse(Role::kPrefill, {"--test-fault", "swap-heads"}).status().message() ==
        "--test_fault: not a flag of pd-prefill (see --help)");
  CHECK(!Parse(Role::kPrefill, {"--colocated"}).ok());
  CHECK(!Parse(Role::kDecode, {"--bootstrap-port", "1"}).ok());
  CHECK(!Parse(Role::kPrefill, {"--port", "70000"}).ok());
  CHECK(!Parse(Role::kPrefill, {"--model", "huge"}).ok());
  CHECK(!Parse(Role::kPrefill, {"--tp"}).ok());
  CHECK(!Parse(Role::kPrefill, {"--backend-option", "novalue"}).ok());
  CHECK(!Parse(Role::kPrefill, {"--liveness-timeout-ms", "10"}).ok());
  // Errors name the flag.
  CHECK(Parse(Role::kPrefill, {"--port", "70000"}).status().message() ==
        "--port '70000': not an integer in [0, 65535]");
  CHECK(Parse(Role::kPrefill, {"--num-pages", "lots"})
            .status()
            .message()
            .starts_with("Illegal value 'lots' specified for flag 'num_pages'"));
  CHECK(Parse(Role::kPrefill, {"--colocated"}).status().message() ==
        "--colocated: not a flag of pd-prefill (see --help)");
  CHECK(Parse(Role::kDecode, {"--bogus"}).status().message() ==
        "Unknown command line flag 'bogus' (see --help)");
  CHECK(Parse(Role::kDecode, {"stray"}).status().message() ==
        "unexpected argument 'stray' (see --help)");
  // Issue #19: the device. cpu by default (backend ucx); cuda switches the default backend to
  // cuda_ipc (GPU pools need a backend that reaches GPU memory) but keeps one that is named.
  CHECK((d->host.device == kernels::Device::kCpu && d->host.cuda_device == 0));
  auto gpu = Parse(Role::kPrefill, {"--device", "cuda", "--cuda-device", "3"});
  INFO(gpu.status().ToString());
  REQUIRE(gpu.ok());
  CHECK((gpu->host.device == kernels::Device::kCuda && gpu->host.cuda_device == 3));
  CHECK(gpu->host.backend == "cuda_ipc");
  auto gpu_ucx = Parse(Role::kDecode, {"--device=cuda", "--backend", "ucx"});
  REQUIRE(gpu_ucx.ok());
  CHECK((gpu_ucx->host.device == kernels::Device::kCuda && gpu_ucx->host.backend == "ucx"));
  auto cpu = Parse(Role::kDecode, {"--device", "cpu"});
  REQUIRE(cpu.ok());
  CHECK((cpu->host.device == kernels::Device::kCpu && cpu->host.backend == "ucx"));
  CHECK(Parse(Role::kDecode, {"--device", "gpu"}).status().message() ==
        "--device 'gpu': expected cpu or cuda");
  CHECK(Parse(Role::kDecode, {"--device", "CUDA"}).status().code() == StatusCode::kInvalidArgument);
  CHECK(Parse(Role::kDecode, {"--cuda-device", "-1"}).status().message() ==
        "--cuda_device '-1': not an integer in [0, 1023]");
  // Models the CUDA model has no kernels for are refused before any GPU is asked.
  for (const char* model : {"small-mla", "small-swa", "small-nsa"}) {
    auto m = Parse(Role::kDecode, {"--device", "cuda", "--model", model});
    INFO(model);
    CHECK(m.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(m.status().message()),
               Catch::Contains("device cuda: model " + std::string(model)) &&
                   Catch::Contains("use device cpu"));
  }
  CHECK(Parse(Role::kDecode, {"--device", "cuda", "--model", "small-hybrid"}).ok());

  auto help = Parse(Role::kDecode, {"--help", "--tp", "4"});
  REQUIRE(help.ok());
  CHECK(help->help);
}

TEST_CASE("hosts: device cuda without a usable GPU fails Host::Create with CUDA's reason") {
  const kernels::CudaInfo cuda = kernels::ProbeCuda();
  if (cuda.device_count > 0) {
    WARN("skipped: CUDA device " << cuda.device_name << " is present");
    return;
  }
  REQUIRE(!cuda.reason.empty());
  for (Role role : {Role::kPrefill, Role::kDecode, Role::kColocated}) {
    HostOptions o;
    o.role = role;
    o.device = kernels::Device::kCuda;
    o.backend = "cuda_ipc";
    o.threads_per_rank = 1;
    o.num_pages = 16;
    auto host = Host::Create(o);
    INFO(RoleName(role) << ": " << host.status().ToString());
    CHECK(host.status().code() == StatusCode::kUnavailable);
    CHECK(host.status().message() == "no CUDA device: " + cuda.reason);
  }
}

TEST_CASE("hosts flags: --help documents every flag, each program only its own") {
  const std::vector<std::string> common = {"--host ",
                                           "--port ",
                                           "--model ",
                                           "--seed ",
                                           "--threads ",
                                           "--backend ",
                                           "--backend_option ",
                                           "--num_pages ",
                                           "--max_running ",
                                           "--chunked_prefill_size ",
                                           "--max_context_len ",
                                           "--bootstrap_timeout_ms ",
                                           "--waiting_timeout_ms ",
                                           "--transfer_timeout_ms ",
                                           "--liveness_timeout_ms ",
                                           "--connect_timeout_ms ",
                                           "--idle_poll_us ",
                                           "--verbose ",
                                           "--tp ",
                                           "--pp ",
                                           "--device ",
                                           "--cuda_device ",
                                           "READY role="};
  const std::vector<std::string> prefill_only = {"--bootstrap_host ", "--bootstrap_port ",
                                                 "--start_bootstrap "};
  const std::vector<std::string> decode_only = {"--colocated ", "--reserved_decode_tokens ",
                                                "--connect ", "--test_fault "};
  for (Role program : {Role::kPrefill, Role::kDecode}) {
    const std::string usage = HostUsage(program);
    std::vector<std::string> flags = common;
    const auto& own = program == Role::kPrefill ? prefill_only : decode_only;
    const auto& other = program == Role::kPrefill ? decode_only : prefill_only;
    flags.insert(flags.end(), own.begin(), own.end());
    for (const std::string& f : flags) {
      INFO(RoleName(program) << ": " << f);
      CHECK(usage.find(f) != std::string::npos);
    }
    for (const std::string& f : other) {
      INFO(RoleName(program) << " must not list " << f);
      CHECK(usage.find(f) == std::string::npos);
    }
  }
  // Decode's PP rule, the models and the test-only fault are documented.
  const std::string decode = HostUsage(Role::kDecode);
  CHECK(decode.find("pd-decode: equal to the prefill's PP, or 1") != std::string::npos);
  CHECK(decode.find("small-mla") != std::string::npos);
  CHECK(decode.find("small-swa") != std::string::npos);
  CHECK(decode.find("TEST ONLY") != std::string::npos);
}

}  // namespace
}  // namespace pdlib::hosts
