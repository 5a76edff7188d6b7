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

#include "examples/router/router.h"
#include "examples/router/tokenizer.h"
#include "kernels/src/json.h"
#include "router_test_harness.h"

namespace pdlib::router {

using namespace testing;  // NOLINT(build/namespaces): the test deployment's helpers
using nlohmann::json;

namespace {

StatusOr<json> ParseJson(std::string_view text) { return pdlib::json::ParseStrict(text); }

}  // namespace

TEST_CASE("router http: completions, health, metrics and errors over a socket") {
  Deployment d;
  const int port = d.router->http_port();
  REQUIRE(port > 0);

  SECTION("a completion") {
    HttpReply reply =
        HttpExchange(port, Post("/v1/completions", R"({"prompt":"Hi there","max_tokens":5})"));
    REQUIRE(reply.status == 200);
    CHECK(Contains(reply.head, "Content-Type: application/json"));
    StatusOr<json> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    const std::vector<int32_t> expected = ExpectedTokens("Hi there", 5);
    CHECK(body->at("choices").at(0).at("text") == Detokenize(expected));
    CHECK(body->at("choices").at(0).at("finish_reason") == "length");
    CHECK(body->at("usage").at("prompt_tokens") == 8);
    CHECK(body->at("usage").at("completion_tokens") == 5);
    const json& pd = body->at("pdlib");
    CHECK(pd.at("prefill") == d.prefill[0]->address());
    CHECK(pd.at("kv_bytes") == 800);
    CHECK(pd.at("output_ids").size() == 5);
    CHECK(body->at("id") == "cmpl-" + std::to_string(d.decode[0]->requests().at(0).room()));
  }
  SECTION("token ids in, ids >= 256 out") {
    HttpReply reply =
        HttpExchange(port, Post("/v1/completions", R"({"prompt":[66,73,71],"max_tokens":2})"));
    REQUIRE(reply.status == 200);
    StatusOr<json> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    CHECK(body->at("choices").at(0).at("text") == "<1000><1001>");
  }
  SECTION("server-sent events") {
    HttpReply reply = HttpExchange(
        port, Post("/v1/completions", R"({"prompt":"stream me","max_tokens":4,"stream":true})"));
    REQUIRE(reply.status == 200);
    CHECK(Contains(reply.head, "text/event-stream"));
    CHECK(reply.chunked);  // each event its own chunk, on a connection that stays open
    CHECK_FALSE(Contains(reply.head, "Connection: close"));
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
      StatusOr<json> chunk = ParseJson(data);
      REQUIRE(chunk.ok());
      text += chunk->at("choices").at(0).at("text").get<std::string>();
      if (chunk->contains("usage")) {
        CHECK(chunk->at("choices").at(0).at("finish_reason") == "length");
      }
    }
    CHECK(done);
    CHECK(events >= 2);
    CHECK(text == Detokenize(ExpectedTokens("stream me", 4)));
  }
  SECTION("a failing host is an error naming the host") {
    HttpReply reply = HttpExchange(port, Post("/v1/completions", R"({"prompt":"PFAIL x"})"));
    CHECK(reply.status == 429);  // the host said RESOURCE_EXHAUSTED
    StatusOr<json> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    const std::string message = body->at("error").at("message").get<std::string>();
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
      StatusOr<json> parsed = ParseJson(reply.body);
      REQUIRE(parsed.ok());
      CHECK_FALSE(parsed->at("error").at("message").get<std::string>().empty());
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

TEST_CASE("router http: malformed HTTP gets a clear 4xx or 5xx with a JSON error") {
  Deployment d;
  const int port = d.router->http_port();
  struct Case {
    std::string data;
    int status;
    std::string message;  // in the JSON error's message; empty: any
  };
  const std::vector<Case> cases = {
      {"\r\n\r\n", 400, ""},
      {"GET\r\n\r\n", 400, ""},
      {"GET / HTTP/1.1 extra\r\n\r\n", 400, ""},
      {"G(T / HTTP/1.1\r\n\r\n", 400, ""},
      {"GET / HTTP/2.0\r\n\r\n", 400, ""},
      {"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400,
       "malformed Content-Length"},
      {"POST /v1/completions HTTP/1.1\r\nContent-Length: 12abc\r\n\r\n", 400,
       "malformed Content-Length"},
      {"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", 400,
       "malformed Content-Length"},
      {"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400,
       "conflicting"},
      {"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501,
       "Content-Length"},
      {"POST /v1/completions HTTP/1.1\r\nExpect: something-else\r\nContent-Length: 2\r\n\r\n", 417,
       "unsupported Expect"},
      // Headers that never end are cut off at the limit (16 KiB + the 1 MiB body limit).
      {"GET / HTTP/1.1\r\n" + std::string(1100, 'X') + ": " + std::string(1000, 'a') + "\r\n" +
           [] {
             std::string many;
             for (int i = 0; i < 600; ++i)
               many += "H" + std::to_string(i) + ": " + std::string(2000, 'v') + "\r\n";
             return many;
           }(),
       431, "larger than"},
  };
  for (const Case& c : cases) {
    INFO(c.data.substr(0, 80));
    HttpReply reply = HttpExchange(port, c.data);
    CHECK(reply.status == c.status);
    StatusOr<json> body = ParseJson(reply.body);
    REQUIRE(body.ok());
    const std::string message = body->at("error").at("message").get<std::string>();
    CHECK_FALSE(message.empty());
    CHECK(Contains(message, c.message));
  }
  CHECK(d.prefill[0]->requests().empty());
  // A POST without Content-Length has an empty body (not one read until the client closes).
  HttpReply reply = HttpExchange(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(reply.status == 400);
  CHECK(Contains(reply.body, "malformed JSON"));
}

TEST_CASE("router http: one keep-alive connection carries many requests, pipelined too") {
  Deployment d;
  const int fd = Connect(d.router->http_port());
  auto read_response = [&](std::string* data) {
    const size_t end = ReadUntil(fd, data, "\r\n\r\n");
    REQUIRE(end != std::string::npos);
    const std::string head = data->substr(0, end);
    const size_t at = head.find("Content-Length: ");
    REQUIRE(at != std::string::npos);
    const size_t length = std::stoul(head.substr(at + 16));
    REQUIRE(ReadAtLeast(fd, data, end + 4 + length));
    std::string body = data->substr(end + 4, length);
    data->erase(0, end + 4 + length);
    CHECK(head.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
    CHECK_FALSE(Contains(head, "Connection: close"));
    return body;
  };
  std::string data;
  for (int i = 0; i < 5; ++i) {
    const std::string prompt = "keep " + std::to_string(i);
    const std::string req =
        Post("/v1/completions", R"({"prompt":")" + prompt + R"(","max_tokens":3})");
    REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
    StatusOr<json> body = ParseJson(read_response(&data));
    REQUIRE(body.ok());
    CHECK(body->at("choices").at(0).at("text") == Detokenize(ExpectedTokens(prompt, 3)));
  }
  // Three requests in one write: three answers, in order.
  const std::string three = "GET /health HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n" +
                            Post("/v1/completions", R"({"prompt":"pipe","max_tokens":2})");
  REQUIRE(::send(fd, three.data(), three.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(three.size()));
  CHECK(read_response(&data) == "ok\n");
  CHECK(Contains(read_response(&data), "pdlib_router_requests_total 5"));  // not the 3rd yet
  StatusOr<json> body = ParseJson(read_response(&data));
  REQUIRE(body.ok());
  CHECK(body->at("choices").at(0).at("text") == Detokenize(ExpectedTokens("pipe", 2)));
  ::close(fd);
  CHECK(d.decode[0]->requests().size() == 6);
}

TEST_CASE("router http: connections beyond the pool get a 503 at once") {
  Deployment d(1, 1, [](RouterOptions* o) { o->max_http_connections = 2; });
  const int port = d.router->http_port();
  const int a = Connect(port), b = Connect(port);
  // Both held by the pool (idle keep-alive connections); the third is turned away.
  REQUIRE(
      WaitFor([&] { return HttpExchange(port, "GET /health HTTP/1.1\r\n\r\n").status == 503; }));
  HttpReply reply = HttpExchange(port, "GET /health HTTP/1.1\r\n\r\n");
  CHECK(reply.status == 503);
  CHECK(Contains(reply.body, "too many connections (limit 2)"));
  ::close(a);
  ::close(b);
  CHECK(WaitFor([&] { return HttpExchange(port, "GET /health HTTP/1.1\r\n\r\n").status == 200; }));
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
