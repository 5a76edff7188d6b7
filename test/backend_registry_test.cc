#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/str_split.h"
#include "pdlib/backends.h"
#include "pdlib/spi/transport.h"

// PDLIB_CONFIGURED_BACKENDS is the comma-separated list CMake enabled at configure time.
TEST_CASE("every backend enabled at configure time is registered") {
  std::vector<std::string> configured = absl::StrSplit(PDLIB_CONFIGURED_BACKENDS, ',');
  REQUIRE_FALSE(configured.empty());
  auto listed = pdlib::ListBackends();
  auto builtin = pdlib::BuiltinBackends();
  for (const auto& name : configured) {
    INFO("backend " << name);
    CHECK(std::find(listed.begin(), listed.end(), name) != listed.end());
    CHECK(std::find(builtin.begin(), builtin.end(), name) != builtin.end());
  }
  CHECK(builtin.size() == configured.size());
  CHECK(std::find(listed.begin(), listed.end(), "fake") != listed.end());
}

TEST_CASE("an unknown backend name lists the known ones") {
  auto t = pdlib::spi::CreateTransport("nosuch", {});
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().code() == pdlib::StatusCode::kNotFound);
  std::string msg(t.status().message());
  CHECK(msg.find("unknown backend 'nosuch'") != std::string::npos);
  CHECK(msg.find("fake") != std::string::npos);
}

TEST_CASE("out-of-tree backends register by name and version") {
  int created = 0;
  auto factory = [&](const pdlib::spi::TransportOptions&)
      -> pdlib::StatusOr<std::unique_ptr<pdlib::spi::Transport>> {
    ++created;
    return pdlib::Status::Unimplemented("test backend creates nothing");
  };
  REQUIRE(pdlib::spi::RegisterTransport("registry_test_backend", factory).ok());
  CHECK(pdlib::spi::RegisterTransport("registry_test_backend", factory).code() ==
        pdlib::StatusCode::kAlreadyExists);
  CHECK(pdlib::spi::RegisterTransport("fake", factory).code() == pdlib::StatusCode::kAlreadyExists);
  CHECK(pdlib::spi::RegisterTransport("old_backend", factory, 0).code() ==
        pdlib::StatusCode::kFailedPrecondition);
  auto listed = pdlib::ListBackends();
  CHECK(std::find(listed.begin(), listed.end(), "registry_test_backend") != listed.end());
  auto t = pdlib::spi::CreateTransport("registry_test_backend", {});
  CHECK(created == 1);
  CHECK(t.status().code() == pdlib::StatusCode::kUnimplemented);
  CHECK(std::string(t.status().message()).find("registry_test_backend") != std::string::npos);
}
