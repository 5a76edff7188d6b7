// pd-router's HTTP server end to end: a raw socket client against a real Router over fake
// hosts (router_test_harness.h): completions (whole and as server-sent events), health, metrics,
// malformed input, limits, Expect: 100-continue, timeouts and clients that leave.
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "examples/router/json.h"
#include "examples/router/router.h"
#include "examples/router/tokenizer.h"
#include "router_test_harness.h"

namespace pdlib::router {

using namespace testing;  // NOLINT(build/namespaces): the test deployment's helpers

TEST_CASE("router http: completions, health, metrics and errors over a socket") {
  Deployment d;
  const int port = d.router->http_port();
  REQUIRE(port > 0);

  SECTION("a completion") {
    HttpReply reply =
        HttpExchange(port, Post("/v1/completions", R"({"prompt":"Hi there","max_tokens":5})"));
    REQUIRE(reply.status == 200);
    CHECK(Contains(reply.head, "Content-Type: application/json"));
    StatusOr<JsonValue> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    const std::vector<int32_t> expected = ExpectedTokens("Hi there", 5);
    CHECK(body->Find("choices")->items.at(0).Find("text")->string == Detokenize(expected));
    CHECK(body->Find("choices")->items.at(0).Find("finish_reason")->string == "length");
    CHECK(body->Find("usage")->Find("prompt_tokens")->int_value == 8);
    CHECK(body->Find("usage")->Find("completion_tokens")->int_value == 5);
    const JsonValue* pd = body->Find("pdlib");
    CHECK(pd->Find("prefill")->string == d.prefill[0]->address());
    CHECK(pd->Find("kv_bytes")->int_value == 800);
    CHECK(pd->Find("output_ids")->items.size() == 5);
    CHECK(body->Find("id")->string ==
          "cmpl-" + std::to_string(d.decode[0]->requests().at(0).room()));
  }
  SECTION("token ids in, ids >= 256 out") {
    HttpReply reply =
        HttpExchange(port, Post("/v1/completions", R"({"prompt":[66,73,71],"max_tokens":2})"));
    REQUIRE(reply.status == 200);
    StatusOr<JsonValue> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    CHECK(body->Find("choices")->items.at(0).Find("text")->string == "<1000><1001>");
  }
  SECTION("server-sent events") {
    HttpReply reply = HttpExchange(
        port, Post("/v1/completions", R"({"prompt":"stream me","max_tokens":4,"stream":true})"));
    REQUIRE(reply.status == 200);
    CHECK(Contains(reply.head, "text/event-stream"));
    std::string text;
    size_t events = 0, pos = 0;
    bool done = false;
    while ((pos = reply.body.find("data: ", pos)) != std::string::npos) {
      const size_t end = reply.body.find("\n\n", pos);
      REQUIRE(end != std::string::npos);
      const std::string data = reply.body.substr(pos + 6, end - pos - 6);
      pos = end + 2;
      if (data == "[DONE]") {
        done = true;
        continue;
      }
      ++events;
      StatusOr<JsonValue> chunk = ParseJson(data);
      REQUIRE(chunk.ok());
      text += chunk->Find("choices")->items.at(0).Find("text")->string;
      if (chunk->Find("usage") != nullptr) {
        CHECK(chunk->Find("choices")->items.at(0).Find("finish_reason")->string == "length");
      }
    }
    CHECK(done);
    CHECK(events >= 2);
    CHECK(text == Detokenize(ExpectedTokens("stream me", 4)));
  }
  SECTION("a failing host is an error naming the host") {
    HttpReply reply = HttpExchange(port, Post("/v1/completions", R"({"prompt":"PFAIL x"})"));
    CHECK(reply.status == 429);  // the host said RESOURCE_EXHAUSTED
    StatusOr<JsonValue> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    const std::string message = body->Find("error")->Find("message")->string;
    CHECK(Contains(message, "prefill host " + d.prefill[0]->address() + " failed"));
    reply = HttpExchange(port, Post("/v1/completions", R"({"prompt":"DFAIL x"})"));
    CHECK(reply.status == 502);
    CHECK(Contains(reply.body, "decode host " + d.decode[0]->address()));
  }
  SECTION("health, metrics, unknown paths and methods") {
    HttpReply reply = HttpExchange(port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(reply.status == 200);
    CHECK(reply.body == "ok\n");
    reply = HttpExchange(port, "GET /metrics HTTP/1.1\r\n\r\n");
    CHECK(reply.status == 200);
    CHECK(Contains(reply.body, "pdlib_router_requests_total"));
    CHECK(Contains(reply.body, "pdlib_router_host_in_flight{role=\"decode\""));
    CHECK(HttpExchange(port, "GET /nope HTTP/1.1\r\n\r\n").status == 404);
    CHECK(HttpExchange(port, "GET /v1/completions HTTP/1.1\r\n\r\n").status == 405);
    CHECK(HttpExchange(port, Post("/health", "")).status == 405);
  }
  SECTION("malformed input is a 400 with a JSON error") {
    for (const std::string& body :
         {std::string("{not json"), std::string(R"({"prompt":"x","max_tokens":-1})"),
          std::string(R"({"prompt":5})"), std::string(R"({"max_tokens":3})"), std::string("")}) {
      INFO(body);
      HttpReply reply = HttpExchange(port, Post("/v1/completions", body));
      CHECK(reply.status == 400);
      StatusOr<JsonValue> parsed = ParseJson(reply.body);
      REQUIRE(parsed.ok());
      CHECK_FALSE(parsed->Find("error")->Find("message")->string.empty());
    }
    CHECK(HttpExchange(port, "BROKEN\r\n\r\n").status == 400);
    CHECK(
        HttpExchange(port, "POST /v1/completions HTTP/1.1\r\nContent-Length: zz\r\n\r\n").status ==
        400);
    CHECK(d.prefill[0]->requests().empty());
  }
  SECTION("a body over the limit is a 413, answered from the headers alone") {
    HttpReply reply = HttpExchange(
        port, "POST /v1/completions HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n{\"prompt\"");
    CHECK(reply.status == 413);
    CHECK(Contains(reply.body, "larger than the limit"));
  }
  SECTION("Expect: 100-continue gets the interim response before the body is sent") {
    const std::string body = R"({"prompt":"cont","max_tokens":2})";
    const int fd = Connect(port);
    const std::string head =
        "POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n";
    REQUIRE(::send(fd, head.data(), head.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(head.size()));
    std::string got;
    char buf[256];
    while (!Contains(got, "\r\n\r\n")) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      REQUIRE(n > 0);
      got.append(buf, static_cast<size_t>(n));
    }
    CHECK(got == "HTTP/1.1 100 Continue\r\n\r\n");
    REQUIRE(::send(fd, body.data(), body.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(body.size()));
    got.clear();
    while (true) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    CHECK(got.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  }
}

TEST_CASE("router http: a timed-out request is a 504") {
  Deployment d(1, 1, [](RouterOptions* o) { o->request_timeout = std::chrono::milliseconds(500); });
  HttpReply reply =
      HttpExchange(d.router->http_port(), Post("/v1/completions", R"({"prompt":"PHANG"})"));
  CHECK(reply.status == 504);
  CHECK(Contains(reply.body, "did not finish within the request timeout of 500 ms"));
}

TEST_CASE("router http: a client that leaves cancels its request") {
  Deployment d;  // request timeout 10 s: only the disconnect can cancel within the wait below
  const int fd = Connect(d.router->http_port());
  const std::string req = Post("/v1/completions", R"({"prompt":"PHANG again"})");
  REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  REQUIRE(WaitFor([&] { return d.prefill[0]->open.load() == 1 && d.decode[0]->open.load() == 1; }));
  ::close(fd);
  CHECK(WaitFor(
      [&] { return d.prefill[0]->cancelled.load() == 1 && d.decode[0]->cancelled.load() == 1; },
      std::chrono::milliseconds(3000)));
  CHECK(WaitFor(
      [&] { return Contains(d.router->MetricsText(), "pdlib_router_requests_in_flight 0"); }));
}

TEST_CASE("router http: HTTP can be turned off") {
  Deployment d(1, 1, [](RouterOptions* o) { o->http_port = -1; });
  CHECK(d.router->http_port() == -1);
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("still grpc", 2));
  REQUIRE(out.has_result);
  CHECK(out.result.ok());
}

}  // namespace pdlib::router
