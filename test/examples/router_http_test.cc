// pd-router's /v1/completions bodies without sockets: requests (every bad field named), responses
// and errors. The JSON reader itself is tested by kernel_json_test, HTTP on the wire by
// router_http_server_test.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "examples/router/completions.h"
#include "kernels/src/json.h"

namespace pdlib::router {
namespace {

using nlohmann::json;

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace

TEST_CASE("router json: responses are valid UTF-8 and escape what JSON needs") {
  // Byte-level output can split characters: what is not valid UTF-8 becomes U+FFFD (a lone
  // byte, or a sequence cut short) and the rest is kept, so a client's parser never fails.
  const std::string chunk = FormatCompletionChunk(1, 2, "q\"b\\\n\t\x01 \xc3\xa9 \xff \xe2\x82");
  CHECK(Contains(chunk, R"("text":"q\"b\\\n\t\u0001 )"
                        "\xc3\xa9 \xef\xbf\xbd \xef\xbf\xbd\""));
  StatusOr<json> back = pdlib::json::ParseStrict(chunk.substr(6));  // after "data: "
  REQUIRE(back.ok());
  CHECK(back->at("choices")[0].at("text").get<std::string>() ==
        "q\"b\\\n\t\x01 \xc3\xa9 \xef\xbf\xbd \xef\xbf\xbd");
  // Fields keep the order OpenAI's responses have.
  CHECK(chunk.rfind(R"(data: {"id":"cmpl-1","object":"text_completion","created":2,)", 0) == 0);
}

TEST_CASE("router completions: a request with text or ids") {
  StatusOr<CompletionRequest> r =
      ParseCompletionRequest(R"({"prompt":"Hi","max_tokens":4,"model":"x","temperature":0})", 16);
  REQUIRE(r.ok());
  CHECK(r->request.prompt_ids == std::vector<int32_t>{'H', 'i'});
  CHECK(r->request.max_new_tokens == 4);
  CHECK_FALSE(r->stream);
  r = ParseCompletionRequest(R"({"prompt":[1,2,300],"stream":true,"n":1})", 16);
  REQUIRE(r.ok());
  CHECK(r->request.prompt_ids == std::vector<int32_t>{1, 2, 300});
  CHECK(r->request.max_new_tokens == 16);  // the default
  CHECK(r->stream);
  r = ParseCompletionRequest(R"({"prompt":"x","max_tokens":null})", 7);
  REQUIRE(r.ok());
  CHECK(r->request.max_new_tokens == 7);
}

TEST_CASE("router completions: bad requests name the field") {
  struct Case {
    std::string body;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"not json", "malformed JSON"},
      {"[1]", "must be a JSON object"},
      {"{}", "'prompt' is missing"},
      {R"({"prompt":""})", "'prompt' is empty"},
      {R"({"prompt":[]})", "empty array"},
      {R"({"prompt":7})", "must be a string or an array"},
      {R"({"prompt":["a","b"]})", "batched prompts are not supported"},
      {R"({"prompt":[1,-1]})", "element 1 is not a token id"},
      {R"({"prompt":[1,2.5]})", "element 1 is not a token id"},
      {R"({"prompt":[1,3000000000]})", "element 1 is not a token id"},
      {R"({"prompt":"x","max_tokens":-3})", "'max_tokens' must be an integer"},
      {R"({"prompt":"x","max_tokens":0})", "'max_tokens' must be an integer"},
      {R"({"prompt":"x","max_tokens":1.5})", "'max_tokens' must be an integer"},
      {R"({"prompt":"x","max_tokens":"8"})", "'max_tokens' must be an integer"},
      {R"({"prompt":"x","stream":"yes"})", "'stream' must be true or false"},
      {R"({"prompt":"x","n":2})", "'n' must be 1"},
  };
  for (const Case& c : cases) {
    INFO(c.body);
    StatusOr<CompletionRequest> r = ParseCompletionRequest(c.body, 16);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(r.status().message(), c.message));
  }
}

TEST_CASE("router completions: the response body") {
  RequestResult r;
  r.room = 77;
  r.prefill_host = "127.0.0.1:1";
  r.decode_host = "127.0.0.1:2";
  r.output_ids = {'o', 'k', 300};
  r.prompt_tokens = 5;
  r.max_new_tokens = 3;
  r.ttft_us = 10;
  r.latency_us = 20;
  r.transfer_us = 3;
  r.kv_bytes = 4096;
  StatusOr<json> body = pdlib::json::ParseStrict(FormatCompletion(r, 1700000000));
  REQUIRE(body.ok());
  CHECK(body->at("id") == "cmpl-77");
  CHECK(body->at("object") == "text_completion");
  CHECK(body->at("model") == "pdlib-example");
  const json& choice = body->at("choices").at(0);
  CHECK(choice.at("text") == "ok<300>");
  CHECK(choice.at("finish_reason") == "length");
  CHECK(choice.at("index") == 0);
  const json& usage = body->at("usage");
  CHECK(usage.at("prompt_tokens") == 5);
  CHECK(usage.at("completion_tokens") == 3);
  CHECK(usage.at("total_tokens") == 8);
  const json& pd = body->at("pdlib");
  CHECK(pd.at("ttft_us") == 10);
  CHECK(pd.at("kv_bytes") == 4096);
  CHECK(pd.at("prefill") == "127.0.0.1:1");
  CHECK(pd.at("decode") == "127.0.0.1:2");
  CHECK(pd.at("output_ids") == json::array({'o', 'k', 300}));

  r.max_new_tokens = 10;  // ended before the limit
  CHECK(FinishReason(r) == "stop");

  const std::string chunk = FormatCompletionChunk(77, 1, "ab");
  CHECK(chunk.rfind("data: {", 0) == 0);
  CHECK(chunk.substr(chunk.size() - 2) == "\n\n");
  const std::string last = FormatCompletionLastChunk(r, 1, "");
  CHECK(Contains(last, "\"finish_reason\":\"stop\""));
  CHECK(last.substr(last.size() - 14) == "data: [DONE]\n\n");
}

TEST_CASE("router completions: errors map to HTTP statuses with a JSON body") {
  CHECK(HttpStatusFor(StatusCode::kInvalidArgument) == 400);
  CHECK(HttpStatusFor(StatusCode::kResourceExhausted) == 429);
  CHECK(HttpStatusFor(StatusCode::kUnavailable) == 503);
  CHECK(HttpStatusFor(StatusCode::kDeadlineExceeded) == 504);
  CHECK(HttpStatusFor(StatusCode::kAborted) == 502);
  RequestResult r;
  r.room = 9;
  r.prefill_host = "p:1";
  StatusOr<json> body =
      pdlib::json::ParseStrict(FormatError(Status::Aborted("prefill host p:1 failed: \xff"), &r));
  REQUIRE(body.ok());
  REQUIRE(body->contains("error"));
  const json& error = body->at("error");
  CHECK(Contains(error.at("message").get<std::string>(), "prefill host p:1 failed"));
  CHECK(error.at("code") == "ABORTED");
  CHECK(error.at("type") == "server_error");
  CHECK(error.at("pdlib").at("room") == 9);
}

}  // namespace pdlib::router
