// pdlib::json::ParseStrict (kernels/src/json.h), the one JSON reader of the safetensors loader
// and the router: values of every type with exact integers, malformed input rejected with the
// byte offset, and the limits nlohmann-json does not enforce by itself (depth, duplicate keys).
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "json.h"

namespace pdlib::json {
namespace {

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

TEST_CASE("json: values of every type, integers exact") {
  StatusOr<nlohmann::json> v = ParseStrict(
      R"( {"s": "a\"b\\c\n\u00e9\ud83d\ude00", "i": -42, "f": 1.5e2, "t": true, "n": null,
          "a": [1, [2], {}], "u": 18446744073709551615, "big": 123456789012345678901} )");
  REQUIRE(v.ok());
  REQUIRE(v->is_object());
  CHECK(v->at("s").get<std::string>() == "a\"b\\c\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(AsInt64(v->at("i")) == -42);
  CHECK_FALSE(AsInt64(v->at("f")).has_value());
  CHECK(v->at("f").get<double>() == 150.0);
  CHECK(v->at("t").get<bool>());
  CHECK(v->at("n").is_null());
  CHECK(v->at("a").size() == 3);
  CHECK(AsInt64(v->at("a")[0]) == 1);
  // Offsets beyond 2^53 stay exact; beyond uint64 a literal is a double only.
  CHECK(v->at("u").is_number_unsigned());
  CHECK(v->at("u").get<uint64_t>() == 18446744073709551615ull);
  CHECK_FALSE(AsInt64(v->at("u")).has_value());  // beyond int64
  CHECK(v->at("big").is_number_float());
  CHECK_FALSE(AsInt64(v->at("big")).has_value());
  CHECK_FALSE(v->at("i").is_number_unsigned());  // negative: never an offset or a dimension
}

TEST_CASE("json: malformed input is rejected with the byte offset") {
  const std::vector<std::string> bad = {
      "",
      "{",
      "{\"a\" 1}",
      "{\"a\":1,}",
      "[1,]",
      "[1 2]",
      "01",
      "1.",
      "-",
      "1e",
      "[1e]",
      "\"abc",
      "\"\\x\"",
      "\"\\u12\"",
      "\"\\ud800\"",
      "\"a\x01\"",
      "tru",
      "{} {}",
      "nan",
      "1e999",
      "{1:2}",
      "'single'",
      "{\"a\":1,\"a\":2}",
      "\"\xff\"",
  };
  for (const std::string& text : bad) {
    INFO(text);
    StatusOr<nlohmann::json> v = ParseStrict(text);
    REQUIRE_FALSE(v.ok());
    CHECK(v.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(v.status().message(), "malformed JSON at byte"));
  }
  StatusOr<nlohmann::json> v = ParseStrict("{\"a\": 1, \"b\" 2}");
  REQUIRE_FALSE(v.ok());
  // The offset counts the bytes read up to and including the one in error (the '2').
  CHECK(Contains(v.status().message(), "at byte 14"));
  CHECK_FALSE(Contains(v.status().message(), "json.exception"));
}

TEST_CASE("json: duplicate keys are an error naming the key, at any depth") {
  StatusOr<nlohmann::json> v = ParseStrict(R"({"x": {"k": 1, "k": 2}})");
  REQUIRE_FALSE(v.ok());
  CHECK(Contains(v.status().message(), "duplicate key \"k\""));
  CHECK(Contains(v.status().message(), "at byte 18"));  // the second "k", its quotes included
  // The same key in sibling objects is fine.
  CHECK(ParseStrict(R"([{"k": 1}, {"k": 2}])").ok());
}

TEST_CASE("json: nesting is bounded, so hostile input cannot exhaust the stack") {
  StatusOr<nlohmann::json> deep = ParseStrict(std::string(100, '[') + std::string(100, ']'));
  REQUIRE_FALSE(deep.ok());
  CHECK(Contains(deep.status().message(), "nesting deeper than 32 levels"));
  CHECK(ParseStrict(std::string(32, '[') + std::string(32, ']')).ok());
  CHECK_FALSE(ParseStrict(std::string(33, '[') + std::string(33, ']')).ok());
  CHECK(ParseStrict(std::string(5, '[') + std::string(5, ']'), 5).ok());
  CHECK_FALSE(ParseStrict("{\"a\":" + std::string(5, '[') + std::string(5, ']') + "}", 5).ok());
  // A million-deep bomb fails fast at the limit instead of building anything.
  CHECK_FALSE(ParseStrict(std::string(1000000, '[')).ok());
}

}  // namespace
}  // namespace pdlib::json
