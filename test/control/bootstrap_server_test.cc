// BootstrapServer over real gRPC on 127.0.0.1: registration and queries through
// BootstrapClient, wire-level validation through raw stubs, and the standard health service.
#include "lib/control/bootstrap_server.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>

#include "lib/control/bootstrap_client.h"
#include "lib/proto/health.grpc.pb.h"
#include "lib/proto/pdlib.grpc.pb.h"
#include "test/control/bootstrap_test_util.h"

namespace pdlib::control {
namespace {

namespace pb = ::pdlib::wire::v1;
namespace health_pb = ::grpc::health::v1;
using testing::TestRank;

std::string Message(const Status& s) { return std::string(s.message()); }

std::unique_ptr<BootstrapServer> StartLocalServer() {
  BootstrapServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  auto server = BootstrapServer::Start(options);
  REQUIRE(server.ok());
  REQUIRE((*server)->port() > 0);
  return std::move(server).value();
}

std::unique_ptr<BootstrapClient> ClientFor(const BootstrapServer& server) {
  BootstrapClientOptions options;
  options.rpc_timeout = std::chrono::milliseconds(10000);  // generous: sanitizer builds are slow
  auto client = BootstrapClient::Create("127.0.0.1", server.port(), options);
  REQUIRE(client.ok());
  return std::move(client).value();
}

std::shared_ptr<grpc::Channel> ChannelTo(const BootstrapServer& server) {
  return grpc::CreateChannel("127.0.0.1:" + std::to_string(server.port()),
                             grpc::InsecureChannelCredentials());
}

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
}

TEST_CASE("start on port 0 picks a free port") {
  auto server = StartLocalServer();
  CHECK(server->host() == "127.0.0.1");
  CHECK(server->address() == "127.0.0.1:" + std::to_string(server->port()));
  CHECK(server->ranks_registered() == 0);
}

TEST_CASE("start rejects bad options and a port that is taken") {
  BootstrapServerOptions options;
  options.host = "";
  CHECK(BootstrapServer::Start(options).status().code() == StatusCode::kInvalidArgument);
  options.host = "127.0.0.1";
  options.port = 70000;
  const Status port = BootstrapServer::Start(options).status();
  CHECK(port.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(port), Catch::Contains("port 70000"));

  auto first = StartLocalServer();
  options.port = first->port();
  const Status taken = BootstrapServer::Start(options).status();
  CHECK(taken.code() == StatusCode::kUnavailable);
  CHECK_THAT(Message(taken),
             Catch::Contains("could not listen on 127.0.0.1:" + std::to_string(first->port())));
}

TEST_CASE("ranks register and decode finds them") {
  auto server = StartLocalServer();
  auto client = ClientFor(*server);

  for (int32_t dp = 0; dp < 2; ++dp) {
    for (int32_t tp = 0; tp < 2; ++tp) {
      auto result = client->RegisterRank(
          TestRank(dp, tp, 0, /*dp_size=*/2, /*tp_size=*/2, 1, 7000 + 10 * dp + tp));
      REQUIRE(result.ok());
      CHECK(result->ranks_registered == 2 * dp + tp + 1);
      CHECK(result->ranks_expected == 4);
    }
  }
  CHECK(server->ranks_registered() == 4);

  auto info = client->GetParallelInfo();
  REQUIRE(info.ok());
  CHECK(info->tp_size == 2);
  CHECK(info->dp_size == 2);
  CHECK(info->pp_size == 1);
  CHECK(info->page_size == 16);
  CHECK(info->ranks_registered == 4);
  CHECK(info->ranks_expected == 4);
  CHECK(info->fingerprint.num_kv_heads == 8);
  CHECK(info->fingerprint.model_name == "test-model");

  auto address = client->GetRankAddress({1, 0, 0});
  REQUIRE(address.ok());
  CHECK(address->host == "127.0.0.1");
  CHECK(address->port == 7010);
}

TEST_CASE("query errors keep their code and name the server and the rank") {
  auto server = StartLocalServer();
  auto client = ClientFor(*server);
  const std::string where = "bootstrap 127.0.0.1:" + std::to_string(server->port());

  const Status empty = client->GetParallelInfo().status();
  CHECK(empty.code() == StatusCode::kNotFound);
  CHECK_THAT(Message(empty), Catch::StartsWith(where + ": GetParallelInfo: "));
  CHECK_THAT(Message(empty), Catch::Contains("no prefill rank has registered"));

  REQUIRE(client->RegisterRank(TestRank(0, 0, 0, 1, 2, 1)).ok());
  const Status missing = client->GetRankAddress({0, 1, 0}).status();
  CHECK(missing.code() == StatusCode::kNotFound);
  CHECK_THAT(Message(missing), Catch::Contains(where + ": GetRankAddress: "));
  CHECK_THAT(Message(missing), Catch::Contains("(dp 0, tp 1, pp 0) is not registered"));

  const Status out_of_range = client->GetRankAddress({0, 5, 0}).status();
  CHECK(out_of_range.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(out_of_range), Catch::Contains("tp_rank 5 out of range [0, 2)"));

  const Status negative = client->GetRankAddress({-1, 0, 0}).status();
  CHECK(negative.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(negative), Catch::Contains("dp_rank -1 is negative"));
}

TEST_CASE("conflicting page size is rejected with FAILED_PRECONDITION") {
  auto server = StartLocalServer();
  auto client = ClientFor(*server);
  REQUIRE(client->RegisterRank(TestRank(0, 0, 0, 1, 2, 1, 7000)).ok());
  RankRegistration other = TestRank(0, 1, 0, 1, 2, 1, 7001);
  other.page_size = 32;
  const Status s = client->RegisterRank(other).status();
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(Message(s), Catch::Contains("reports page_size 32"));
  CHECK_THAT(Message(s), Catch::Contains("has page_size 16"));
  CHECK(server->ranks_registered() == 1);
}

TEST_CASE("re-registration replaces the address") {
  auto server = StartLocalServer();
  auto client = ClientFor(*server);
  REQUIRE(client->RegisterRank(TestRank(0, 0, 0, 1, 2, 1, 7000)).ok());
  REQUIRE(client->RegisterRank(TestRank(0, 1, 0, 1, 2, 1, 7001)).ok());
  auto old_address = client->GetRankAddress({0, 1, 0});
  REQUIRE(old_address.ok());

  auto again = client->RegisterRank(TestRank(0, 1, 0, 1, 2, 1, 7999));
  REQUIRE(again.ok());
  CHECK(again->replaced);
  CHECK(again->ranks_registered == 2);
  auto new_address = client->GetRankAddress({0, 1, 0});
  REQUIRE(new_address.ok());
  CHECK(new_address->port == 7999);
  CHECK(new_address->registration_id > old_address->registration_id);

  auto removed = client->UnregisterRank({0, 1, 0}, "127.0.0.1", 7001);  // the old address
  REQUIRE(removed.ok());
  CHECK_FALSE(*removed);
  removed = client->UnregisterRank({0, 1, 0}, "127.0.0.1", 7999);
  REQUIRE(removed.ok());
  CHECK(*removed);
  CHECK(server->ranks_registered() == 1);
}

TEST_CASE("the server validates raw wire messages") {
  auto server = StartLocalServer();
  auto stub = pb::Bootstrap::NewStub(ChannelTo(*server));
  pb::RegisterRankRequest request;
  request.set_role(pb::ROLE_PREFILL);
  request.mutable_rank()->set_tp_size(1);
  request.mutable_rank()->set_dp_size(1);
  request.mutable_rank()->set_pp_size(1);
  request.set_host("127.0.0.1");
  request.set_port(7000);
  request.set_page_size(16);

  auto call = [&](const pb::RegisterRankRequest& r) {
    grpc::ClientContext context;
    SetDeadline(&context);
    pb::RegisterRankResponse response;
    return stub->RegisterRank(&context, r, &response);
  };

  SECTION("a valid request") { CHECK(call(request).ok()); }
  SECTION("decode may not register") {
    request.set_role(pb::ROLE_DECODE);
    const grpc::Status s = call(request);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("ROLE_DECODE"));
  }
  SECTION("role unset") {
    request.set_role(pb::ROLE_UNSPECIFIED);
    CHECK(call(request).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("rank missing") {
    request.clear_rank();
    const grpc::Status s = call(request);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("rank is missing"));
  }
  SECTION("port beyond 16 bits") {
    request.set_port(70000);
    const grpc::Status s = call(request);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("port 70000 out of range"));
  }
  SECTION("negative rank") {
    request.mutable_rank()->set_pp_rank(-7);
    const grpc::Status s = call(request);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("pp_rank -7"));
  }
  SECTION("empty host") {
    request.set_host("");
    const grpc::Status s = call(request);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("host is empty"));
  }
}

TEST_CASE("health Check answers SERVING through the standard grpc.health.v1 stub") {
  auto server = StartLocalServer();
  auto stub = health_pb::Health::NewStub(ChannelTo(*server));
  for (const std::string& service : {std::string(), std::string(BootstrapServer::ServiceName())}) {
    INFO("service '" << service << "'");
    grpc::ClientContext context;
    SetDeadline(&context);
    health_pb::HealthCheckRequest request;
    request.set_service(service);
    health_pb::HealthCheckResponse response;
    const grpc::Status s = stub->Check(&context, request, &response);
    REQUIRE(s.ok());
    CHECK(response.status() == health_pb::HealthCheckResponse::SERVING);
  }
  CHECK(std::string(BootstrapServer::ServiceName()) == "pdlib.wire.v1.Bootstrap");

  auto client = ClientFor(*server);
  CHECK(client->CheckHealth().ok());
  CHECK(client->CheckHealth(BootstrapServer::ServiceName()).ok());
  const Status unknown = client->CheckHealth("no.such.Service");
  CHECK(unknown.code() == StatusCode::kNotFound);
}

TEST_CASE("after Shutdown the server no longer answers") {
  auto server = StartLocalServer();
  auto client = ClientFor(*server);
  REQUIRE(client->CheckHealth().ok());
  server->Shutdown();
  server->Shutdown();  // idempotent
  const Status s = client->CheckHealth();
  CHECK_FALSE(s.ok());
  CHECK(s.code() == StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pdlib::control
