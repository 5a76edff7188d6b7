// pd-router's HTTP/JSON layer without sockets: request parsing (every malformed input gets a
// clear 4xx), the JSON reader and writer, and the /v1/completions bodies.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "examples/router/completions.h"
#include "examples/router/http.h"
#include "examples/router/json.h"

namespace pdlib::router {
namespace {

using State = HttpParseResult::State;

HttpParseResult Parse(std::string_view data, HttpLimits limits = {}) {
  return ParseHttpRequest(data, limits);
}

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace

TEST_CASE("router http: a complete POST with a body") {
  const std::string req =
      "POST /v1/completions?x=1 HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
      "Content-Length: 13\r\n\r\n{\"prompt\":1}xEXTRA";
  HttpParseResult r = Parse(req);
  REQUIRE(r.state == State::kComplete);
  CHECK(r.request.method == "POST");
  CHECK(r.request.target == "/v1/completions?x=1");
  CHECK(r.request.Path() == "/v1/completions");
  CHECK(r.request.version == "HTTP/1.1");
  CHECK(r.request.body == "{\"prompt\":1}x");  // exactly Content-Length bytes
  REQUIRE(r.request.Header("content-type") != nullptr);
  CHECK(*r.request.Header("content-type") == "application/json");
  CHECK(r.request.Header("Content-Type") == nullptr);  // names are lower-cased
}

TEST_CASE("router http: incomplete input asks for more, at every prefix") {
  const std::string req = "POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
  for (size_t n = 0; n < req.size(); ++n) {
    HttpParseResult r = Parse(req.substr(0, n));
    INFO("prefix " << n);
    CHECK(r.state == State::kIncomplete);
    CHECK(r.headers_done == (n >= req.size() - 5));
  }
  CHECK(Parse(req).state == State::kComplete);
}

TEST_CASE("router http: bare LF line ends and no body") {
  HttpParseResult r = Parse("GET /health HTTP/1.0\nAccept: */*\n\n");
  REQUIRE(r.state == State::kComplete);
  CHECK(r.request.method == "GET");
  CHECK(r.request.body.empty());
}

TEST_CASE("router http: Expect 100-continue is reported once the headers are in") {
  HttpParseResult r = Parse("POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n");
  CHECK(r.state == State::kIncomplete);
  CHECK(r.headers_done);
  CHECK(r.request.expect_continue);
  r = Parse("POST / HTTP/1.1\r\nExpect: something-else\r\n\r\n");
  CHECK(r.state == State::kError);
  CHECK(r.error_status == 417);
}

TEST_CASE("router http: malformed requests get a clear 4xx or 5xx") {
  struct Case {
    std::string data;
    int status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"\r\n\r\n", 400, "empty request line"},
      {"GET\r\n\r\n", 400, "malformed request line"},
      {"GET / HTTP/1.1 extra\r\n\r\n", 400, "malformed request line"},
      {"G(T / HTTP/1.1\r\n\r\n", 400, "malformed method"},
      {"GET nope HTTP/1.1\r\n\r\n", 400, "must start with '/'"},
      {"GET / HTTP/2.0\r\n\r\n", 505, "unsupported HTTP version"},
      {"GET / HTTP/1.1\r\nNoColon\r\n\r\n", 400, "no ':'"},
      {"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400, "malformed header name"},
      {"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", 400, "folding"},
      {"GET / HTTP/1.1\r\nA: b\x01\r\n\r\n", 400, "control byte"},
      {"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "malformed Content-Length"},
      {"POST / HTTP/1.1\r\nContent-Length: 12abc\r\n\r\n", 400, "malformed Content-Length"},
      {"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", 400,
       "malformed Content-Length"},
      {"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "conflicting"},
      {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501, "Content-Length"},
  };
  for (const Case& c : cases) {
    INFO(c.data);
    HttpParseResult r = Parse(c.data);
    REQUIRE(r.state == State::kError);
    CHECK(r.error_status == c.status);
    CHECK(Contains(r.error_message, c.message));
  }
}

TEST_CASE("router http: size limits answer 413 and 431 before buffering it all") {
  HttpLimits limits;
  limits.max_header_bytes = 64;
  limits.max_body_bytes = 10;
  // The body limit is checked from Content-Length alone, before the body arrives.
  HttpParseResult r = Parse("POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n", limits);
  REQUIRE(r.state == State::kError);
  CHECK(r.error_status == 413);
  CHECK(Contains(r.error_message, "limit of 10 bytes"));
  // Headers that never end are cut off at the limit.
  r = Parse("GET / HTTP/1.1\r\nX: " + std::string(100, 'a'), limits);
  REQUIRE(r.state == State::kError);
  CHECK(r.error_status == 431);
  r = Parse("GET / HTTP/1.1\r\nX: " + std::string(100, 'a') + "\r\n\r\n", limits);
  REQUIRE(r.state == State::kError);
  CHECK(r.error_status == 431);
}

TEST_CASE("router http: responses carry length, type and Connection: close") {
  const std::string resp = FormatHttpResponse(404, "application/json", "{}");
  CHECK(resp ==
        "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
        "Connection: close\r\n\r\n{}");
  CHECK(Contains(FormatHttpStreamHead(200, "text/event-stream"), "text/event-stream"));
}

TEST_CASE("router json: values of every type") {
  StatusOr<JsonValue> v = ParseJson(
      R"( {"s": "a\"b\\c\n\u00e9\ud83d\ude00", "i": -42, "f": 1.5e2, "t": true, "n": null,
          "a": [1, [2], {}], "big": 123456789012345678901} )");
  REQUIRE(v.ok());
  CHECK(v->type == JsonValue::Type::kObject);
  CHECK(v->Find("s")->string == "a\"b\\c\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(v->Find("i")->is_int);
  CHECK(v->Find("i")->int_value == -42);
  CHECK_FALSE(v->Find("f")->is_int);
  CHECK(v->Find("f")->number == 150.0);
  CHECK(v->Find("t")->boolean);
  CHECK(v->Find("n")->type == JsonValue::Type::kNull);
  CHECK(v->Find("a")->items.size() == 3);
  CHECK_FALSE(v->Find("big")->is_int);  // beyond int64: a double only
  CHECK(v->Find("missing") == nullptr);
}

TEST_CASE("router json: malformed input is rejected with the byte offset") {
  const std::vector<std::string> bad = {
      "",          "{",           "{\"a\" 1}", "{\"a\":1,}", "[1,]",  "[1 2]",
      "01",        "1.",          "-",         "1e",         "\"abc", "\"\\x\"",
      "\"\\u12\"", "\"\\ud800\"", "\"a\x01\"", "tru",        "{} {}", "{\"a\":1,\"a\":2}",
      "nan",       "1e999",       "{1:2}",     "'single'",
  };
  for (const std::string& text : bad) {
    INFO(text);
    StatusOr<JsonValue> v = ParseJson(text);
    REQUIRE_FALSE(v.ok());
    CHECK(v.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(v.status().message(), "malformed JSON at byte"));
  }
  // Nesting is bounded, so hostile input cannot exhaust the stack.
  StatusOr<JsonValue> deep = ParseJson(std::string(100, '[') + std::string(100, ']'));
  REQUIRE_FALSE(deep.ok());
  CHECK(Contains(deep.status().message(), "nesting deeper than 32"));
  CHECK(ParseJson(std::string(32, '[') + std::string(32, ']')).ok());
}

TEST_CASE("router json: the writer escapes and always emits valid UTF-8") {
  std::string out;
  AppendJsonString(&out, "q\"b\\\n\t\x01\x7f \xc3\xa9 \xff \xe2\x82");
  CHECK(out == "\"q\\\"b\\\\\\n\\t\\u0001\\u007f \xc3\xa9 \xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd\"");
  JsonWriter w;
  w.BeginObject().Key("a").Int(-1).Key("b").BeginArray().Uint(2).Bool(false).Null().EndArray();
  w.Key("c").String("x").EndObject();
  CHECK(w.str() == R"({"a":-1,"b":[2,false,null],"c":"x"})");
  // What the writer writes, the reader reads back.
  StatusOr<JsonValue> back = ParseJson(out);
  REQUIRE(back.ok());
  CHECK(back->string == "q\"b\\\n\t\x01\x7f \xc3\xa9 \xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd");
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
  StatusOr<JsonValue> body = ParseJson(FormatCompletion(r, 1700000000));
  REQUIRE(body.ok());
  CHECK(body->Find("id")->string == "cmpl-77");
  CHECK(body->Find("object")->string == "text_completion");
  CHECK(body->Find("model")->string == "pdlib-example");
  const JsonValue& choice = body->Find("choices")->items.at(0);
  CHECK(choice.Find("text")->string == "ok<300>");
  CHECK(choice.Find("finish_reason")->string == "length");
  CHECK(choice.Find("index")->int_value == 0);
  const JsonValue* usage = body->Find("usage");
  CHECK(usage->Find("prompt_tokens")->int_value == 5);
  CHECK(usage->Find("completion_tokens")->int_value == 3);
  CHECK(usage->Find("total_tokens")->int_value == 8);
  const JsonValue* pd = body->Find("pdlib");
  CHECK(pd->Find("ttft_us")->int_value == 10);
  CHECK(pd->Find("kv_bytes")->int_value == 4096);
  CHECK(pd->Find("prefill")->string == "127.0.0.1:1");
  CHECK(pd->Find("decode")->string == "127.0.0.1:2");
  CHECK(pd->Find("output_ids")->items.size() == 3);

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
  StatusOr<JsonValue> body =
      ParseJson(FormatError(Status::Aborted("prefill host p:1 failed: \xff"), &r));
  REQUIRE(body.ok());
  const JsonValue* error = body->Find("error");
  REQUIRE(error != nullptr);
  CHECK(Contains(error->Find("message")->string, "prefill host p:1 failed"));
  CHECK(error->Find("code")->string == "ABORTED");
  CHECK(error->Find("type")->string == "server_error");
  CHECK(error->Find("pdlib")->Find("room")->int_value == 9);
}

}  // namespace pdlib::router
