#include "pdlib/status.h"

#include <catch2/catch.hpp>
#include <string>

using pdlib::Status;
using pdlib::StatusCode;
using pdlib::StatusOr;

TEST_CASE("OK status is empty and cheap") {
  Status s;
  CHECK(s.ok());
  CHECK(s.code() == StatusCode::kOk);
  CHECK(s.message().empty());
  CHECK(s.ToString() == "OK");
  CHECK(sizeof(Status) == sizeof(void*));
}

TEST_CASE("named factories set code and message") {
  Status s = Status::OutOfRange("page index 812 out of range [0, 512)");
  CHECK_FALSE(s.ok());
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message() == "page index 812 out of range [0, 512)");
  CHECK(s.ToString() == "OUT_OF_RANGE: page index 812 out of range [0, 512)");
  CHECK(Status::Unavailable("x").code() == StatusCode::kUnavailable);
  CHECK(Status::DeadlineExceeded("x").code() == StatusCode::kDeadlineExceeded);
  // Numbering follows google/rpc/code.proto.
  CHECK(static_cast<int>(StatusCode::kUnavailable) == 14);
  CHECK(static_cast<int>(StatusCode::kDataLoss) == 15);
  CHECK(pdlib::StatusCodeName(StatusCode::kAborted) == "ABORTED");
}

TEST_CASE("an error with code OK stays OK") {
  Status s(StatusCode::kOk, "ignored");
  CHECK(s.ok());
  CHECK(s.message().empty());
}

TEST_CASE("copy is deep, move leaves OK") {
  Status a = Status::Internal("boom");
  Status b = a;
  CHECK(b == a);
  Status c = std::move(a);
  CHECK(c.code() == StatusCode::kInternal);
  CHECK(c.message() == "boom");
  b = Status::OK();
  CHECK(b.ok());
  CHECK(c.message() == "boom");
}

TEST_CASE("WithPrefix adds context to errors only") {
  CHECK(Status::NotFound("room 3").WithPrefix("decode").ToString() == "NOT_FOUND: decode: room 3");
  CHECK(Status::OK().WithPrefix("decode").ok());
}

TEST_CASE("StatusOr holds a value or an error") {
  StatusOr<std::string> v = std::string("abc");
  REQUIRE(v.ok());
  CHECK(*v == "abc");
  CHECK(v->size() == 3);
  StatusOr<int> e = Status::NotFound("nope");
  CHECK_FALSE(e.ok());
  CHECK(e.status().code() == StatusCode::kNotFound);
  StatusOr<int> bad = Status::OK();  // a programming error becomes kInternal, not a value
  CHECK(bad.status().code() == StatusCode::kInternal);
}
