// The UCX backend's pure pieces, tested without UCX: option parsing (precedence of backend
// options, the environment and pdlib's defaults). Chunk splitting and the in-flight window are
// the transport toolkit's (test/backends/transport_toolkit_test.cc).
#include "backends/ucx/ucx_options.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backends/ucx/ucx_context.h"
#include "pdlib/spi/transport.h"
#include "test/support/sysfs_tree.h"

namespace spi = pdlib::spi;
namespace ucx = pdlib::ucx;
using pdlib::StatusCode;

TEST_CASE("ucx options: shortcuts, pass-through, defaults and the user's environment") {
  std::map<std::string, std::string> env;
  auto lookup = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };

  SECTION("defaults apply when the user chose nothing") {
    auto parsed = ucx::ParseUcxOptions({}, lookup);
    REQUIRE(parsed.ok());
    for (const ucx::UcxDefault& d : ucx::UcxDefaults()) {
      INFO(d.key);
      CHECK(parsed->ucx_config.at(d.key) == d.value);
      CHECK(std::string(d.why).size() > 20);  // every default says why
    }
    CHECK(parsed->max_inflight_bytes > 0);
    CHECK(parsed->max_inflight_read_bytes >= parsed->max_inflight_bytes);
    CHECK(parsed->chunk_bytes > 0);
    CHECK(parsed->flush == ucx::FlushMode::kEndpoint);
  }

  SECTION("the environment wins over pdlib's defaults, for related variables too") {
    env["UCX_TCP_TX_SEG_SIZE"] = "256k";
    env["UCX_POSIX_ERROR_HANDLING"] = "n";
    auto parsed = ucx::ParseUcxOptions({}, lookup);
    REQUIRE(parsed.ok());
    CHECK(parsed->ucx_config.count("TX_SEG_SIZE") == 0);
    CHECK(parsed->ucx_config.count("RX_SEG_SIZE") == 0);  // must not undercut the user's TX size
    CHECK(parsed->ucx_config.count("MM_ERROR_HANDLING") == 0);
    CHECK(parsed->ucx_config.count("MM_SEG_SIZE") == 1);
  }

  SECTION("backend options win over everything") {
    spi::TransportOptions options;
    options.nic_names = {"mlx5_0:1", "mlx5_1:1"};
    options.options = {{"ucx.tls", "rc_verbs,sm"},
                       {"ucx.config.UCX_RX_SEG_SIZE", "1m"},
                       {"ucx.config.RNDV_THRESH", "8k"},
                       {"ucx.max_inflight_bytes", "16M"},
                       {"ucx.max_inflight_read_bytes", "32M"},
                       {"ucx.chunk_bytes", "256k"},
                       {"ucx.busy_poll_us", "5"},
                       {"ucx.stall_timeout_ms", "0"},
                       {"ucx.flush", "worker"},
                       {"ucx.data_path", "put"},
                       {"ucx.am_chunk_bytes", "8k"},
                       {"other.backend.key", "ignored"}};
    env["UCX_TLS"] = "tcp";
    auto parsed = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(parsed.ok());
    CHECK(parsed->ucx_config.at("TLS") == "rc_verbs,sm");
    CHECK(parsed->ucx_config.at("NET_DEVICES") == "mlx5_0:1,mlx5_1:1");
    CHECK(parsed->ucx_config.at("RX_SEG_SIZE") == "1m");
    CHECK(parsed->ucx_config.count("TX_SEG_SIZE") == 0);
    CHECK(parsed->ucx_config.at("RNDV_THRESH") == "8k");
    CHECK(parsed->max_inflight_bytes == uint64_t{16} << 20);
    CHECK(parsed->max_inflight_read_bytes == uint64_t{32} << 20);
    CHECK(parsed->chunk_bytes == uint64_t{256} << 10);
    CHECK(parsed->busy_poll_us == 5);
    CHECK(parsed->stall_timeout_ms == 0);
    CHECK(parsed->flush == ucx::FlushMode::kWorker);
    CHECK(parsed->data_path == ucx::DataPath::kPut);
    CHECK(parsed->am_chunk_bytes == uint64_t{8} << 10);
  }

  SECTION("the data path and byte sizes are checked") {
    for (auto [key, value] :
         std::vector<std::pair<std::string, std::string>>{{"ucx.data_path", "rdma"},
                                                          {"ucx.am_chunk_bytes", "0"},
                                                          {"ucx.chunk_bytes", "0"},
                                                          {"ucx.am_chunk_bytes", "lots"}}) {
      INFO(key << "=" << value);
      spi::TransportOptions options;
      options.options = {{key, value}};
      auto parsed = ucx::ParseUcxOptions(options, lookup);
      REQUIRE_FALSE(parsed.ok());
      CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
      CHECK(std::string(parsed.status().message()).find(key) != std::string::npos);
    }
    spi::TransportOptions none;
    auto parsed = ucx::ParseUcxOptions(none, lookup);
    REQUIRE(parsed.ok());
    CHECK(parsed->data_path == ucx::DataPath::kAuto);
    CHECK(parsed->am_chunk_bytes == uint64_t{32} << 10);
  }

  SECTION("defaults for a transport that UCX_TLS leaves out are not applied") {
    auto with_tls = [&](const std::string& tls) {
      spi::TransportOptions options;
      options.options["ucx.tls"] = tls;
      auto parsed = ucx::ParseUcxOptions(options, lookup);
      REQUIRE(parsed.ok());
      return parsed->ucx_config;
    };
    CHECK(with_tls("shm").count("TX_SEG_SIZE") == 0);
    CHECK(with_tls("shm").count("MM_SEG_SIZE") == 1);
    CHECK(with_tls("tcp").count("TX_SEG_SIZE") == 1);
    CHECK(with_tls("tcp").count("MM_ERROR_HANDLING") == 0);
    CHECK(with_tls("^tcp").count("TX_SEG_SIZE") == 0);
    CHECK(with_tls("^tcp").count("MM_SEG_SIZE") == 1);
    CHECK(with_tls("rc_verbs,sm").count("MM_SEG_SIZE") == 1);
    CHECK(with_tls("all").count("TX_SEG_SIZE") == 1);
    CHECK(with_tls("tcp").count("KEEPALIVE_INTERVAL") == 1);  // not transport-specific
    // tcp connects without blocking the progress thread (a dead rail's address does not answer).
    CHECK(with_tls("tcp").at("CONN_NB") == "y");
    CHECK(with_tls("shm").count("CONN_NB") == 0);
    env["UCX_TLS"] = "tcp";
    auto parsed = ucx::ParseUcxOptions({}, lookup);
    REQUIRE(parsed.ok());
    CHECK(parsed->ucx_config.count("MM_SEG_SIZE") == 0);
  }

  SECTION("shared-memory segments of 64 KiB or more are refused (UCX 1.13 loses data)") {
    spi::TransportOptions options;
    options.options["ucx.config.MM_SEG_SIZE"] = "66000";
    auto parsed = ucx::ParseUcxOptions(options, lookup);
    REQUIRE_FALSE(parsed.ok());
    CHECK(std::string(parsed.status().message()).find("MM_SEG_SIZE") != std::string::npos);
    env["UCX_POSIX_SEG_SIZE"] = "128k";
    CHECK(ucx::ParseUcxOptions({}, lookup).status().code() == StatusCode::kInvalidArgument);
    env["UCX_POSIX_SEG_SIZE"] = "65000";
    CHECK(ucx::ParseUcxOptions({}, lookup).ok());
  }

  SECTION("decode (a target only) runs without UCX keepalive; prefill checks every 20 s") {
    spi::TransportOptions options;
    options.mode = pdlib::Mode::kDecode;
    auto decode = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(decode.ok());
    CHECK(decode->ucx_config.at("KEEPALIVE_INTERVAL") == "inf");
    options.mode = pdlib::Mode::kPrefill;
    auto prefill = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(prefill.ok());
    CHECK(prefill->ucx_config.at("KEEPALIVE_INTERVAL") == "20s");
    env["UCX_KEEPALIVE_INTERVAL"] = "5s";  // the user's choice stands, on either side
    options.mode = pdlib::Mode::kDecode;
    auto chosen = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(chosen.ok());
    CHECK(chosen->ucx_config.count("KEEPALIVE_INTERVAL") == 0);
  }

  SECTION("ucx.net_devices wins over nic_names") {
    spi::TransportOptions options;
    options.nic_names = {"eth0"};
    options.options = {{"ucx.net_devices", "lo"}};
    auto parsed = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(parsed.ok());
    CHECK(parsed->ucx_config.at("NET_DEVICES") == "lo");
  }

  SECTION("ucx.rails: one device per rail; rail 0's is the main context's") {
    spi::TransportOptions options;
    options.nic_names = {"mlx5_0:1"};  // ucx.rails wins over nic_names
    options.options = {{"ucx.rails", "eth0,eth1,eth2"}, {"ucx.tls", "tcp"}};
    auto parsed = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(parsed.ok());
    CHECK(parsed->rails == std::vector<std::string>{"eth0", "eth1", "eth2"});
    CHECK(parsed->ucx_config.at("NET_DEVICES") == "eth0");
    CHECK(ucx::RailOptions(*parsed, 0).ucx_config.at("NET_DEVICES") == "eth0");
    CHECK(ucx::RailOptions(*parsed, 2).ucx_config.at("NET_DEVICES") == "eth2");
    CHECK(ucx::RailOptions(*parsed, 2).ucx_config.at("TLS") == "tcp");  // the rest is shared
    auto none = ucx::ParseUcxOptions({}, lookup);
    REQUIRE(none.ok());
    CHECK(none->rails.empty());
    // A dead rail: declared after 3 s of silence, probed every second, by default.
    CHECK(none->rail_stall_ms == 3000);
    CHECK(none->rail_retry_ms == 1000);
    spi::TransportOptions tuned;
    tuned.options = {{"ucx.rail_stall_ms", "0"}, {"ucx.rail_retry_ms", "250"}};
    auto t = ucx::ParseUcxOptions(tuned, lookup);
    REQUIRE(t.ok());
    CHECK(t->rail_stall_ms == 0);  // never: a rail's stall is the connection's
    CHECK(t->rail_retry_ms == 250);

    for (auto [extra_key, value] : std::vector<std::pair<std::string, std::string>>{
             {"ucx.net_devices", "eth0"},            // two ways to say which devices
             {"ucx.config.NET_DEVICES", "eth0"},     // the same, spelled out
             {"ucx.rails", "eth0,,eth1"},            // an empty entry
             {"ucx.rails", "eth0,eth1,eth0"},        // a device twice
             {"ucx.rails", "a,b,c,d,e,f,g,h,i"}}) {  // more than kMaxRails
      spi::TransportOptions bad;
      bad.options = {{"ucx.rails", "eth0,eth1"}};
      bad.options[extra_key] = value;
      INFO(extra_key << "=" << value);
      auto refused = ucx::ParseUcxOptions(bad, lookup);
      REQUIRE_FALSE(refused.ok());
      CHECK(refused.status().code() == StatusCode::kInvalidArgument);
      CHECK(std::string(refused.status().message()).find("ucx.rails") != std::string::npos);
    }
  }

  SECTION("ucx.rails=auto: the NICs closest to the KV pool, from sysfs") {
    pdlib_test::SysfsTree sys;
    sys.AddPci("pci0000:00/0000:00:01.0/0000:01:00.0", "0");
    sys.AddRdma("pci0000:00/0000:00:01.0/0000:01:00.0", "mlx5_0", 1, "ens1f0");
    sys.AddPci("pci0000:80/0000:80:01.0/0000:81:00.0", "1");
    sys.AddRdma("pci0000:80/0000:80:01.0/0000:81:00.0", "mlx5_1", 1, "ens2f0");
    sys.AddPci("pci0000:80/0000:80:02.0/0000:82:00.0", "1");
    sys.AddNet("pci0000:80/0000:80:02.0/0000:82:00.0", "ens3f0");
    sys.AddVirtualNet("lo");
    spi::TransportOptions options;
    options.memory_numa_node = 1;
    options.options = {{"ucx.rails", "auto"}, {"ucx.sysfs_root", sys.root()}, {"ucx.tls", "tcp"}};
    auto tcp = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(tcp.ok());
    CHECK(tcp->rails == std::vector<std::string>{"ens2f0", "ens3f0"});  // node 1's interfaces
    CHECK(tcp->ucx_config.at("NET_DEVICES") == "ens2f0");
    options.options["ucx.tls"] = "rc_verbs,ud_verbs:aux";  // RDMA: devices, on port 1
    auto rdma = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(rdma.ok());
    CHECK(rdma->rails == std::vector<std::string>{"mlx5_1:1"});
    options.memory_numa_node = 0;
    rdma = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(rdma.ok());
    CHECK(rdma->rails == std::vector<std::string>{"mlx5_0:1"});
    // nic_names, when given, are the rails.
    options.nic_names = {"mlx5_1:1", "mlx5_0:1"};
    rdma = ucx::ParseUcxOptions(options, lookup);
    REQUIRE(rdma.ok());
    CHECK(rdma->rails == std::vector<std::string>{"mlx5_1:1", "mlx5_0:1"});
    // Nothing on PCI (veths, lo): refused, saying how to name them.
    pdlib_test::SysfsTree bare;
    bare.AddVirtualNet("lo");
    bare.AddVirtualNet("eth0");
    spi::TransportOptions none;
    none.options = {{"ucx.rails", "auto"}, {"ucx.sysfs_root", bare.root()}, {"ucx.tls", "tcp"}};
    auto refused = ucx::ParseUcxOptions(none, lookup);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == StatusCode::kNotFound);
    CHECK(std::string(refused.status().message()).find("list the rails") != std::string::npos);
    none.options["ucx.net_devices"] = "eth0";
    refused = ucx::ParseUcxOptions(none, lookup);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  }

  SECTION("mistakes are refused with the key in the message") {
    for (auto [key, value] :
         std::vector<std::pair<std::string, std::string>>{{"ucx.tsl", "tcp"},
                                                          {"ucx.chunk_bytes", "12q"},
                                                          {"ucx.max_inflight_bytes", "-1"},
                                                          {"ucx.busy_poll_us", "abc"},
                                                          {"ucx.stall_timeout_ms", "99999999999"},
                                                          {"ucx.flush", "sometimes"},
                                                          {"ucx.rail_retry_ms", "5"},
                                                          {"ucx.rail_stall_ms", "soon"},
                                                          {"ucx.config.", "x"}}) {
      spi::TransportOptions options;
      options.options[key] = value;
      auto parsed = ucx::ParseUcxOptions(options, lookup);
      INFO(key << "=" << value);
      REQUIRE_FALSE(parsed.ok());
      CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
      CHECK(std::string(parsed.status().message()).find(key) != std::string::npos);
    }
  }

  SECTION("byte sizes") {
    CHECK(*ucx::ParseByteSize("65536") == 65536);
    CHECK(*ucx::ParseByteSize("64k") == 65536);
    CHECK(*ucx::ParseByteSize("64K") == 65536);
    CHECK(*ucx::ParseByteSize("4M") == uint64_t{4} << 20);
    CHECK(*ucx::ParseByteSize("1gb") == uint64_t{1} << 30);
    CHECK_FALSE(ucx::ParseByteSize("").ok());
    CHECK_FALSE(ucx::ParseByteSize("k").ok());
    CHECK_FALSE(ucx::ParseByteSize("1t").ok());
    CHECK_FALSE(ucx::ParseByteSize("1kk").ok());
    CHECK_FALSE(ucx::ParseByteSize("99999999999999999999").ok());
    CHECK_FALSE(ucx::ParseByteSize("17179869184g").ok());
  }
}

TEST_CASE("ucx reads the transports of a context from ucp_context_print_info") {
  const char* info =
      "#\n# UCP context\n#\n#     component 0  :  self\n"
      "#            md 1  :  component 1  tcp \n"
      "#      resource 0  :  md 0  dev 0  flags -- self/memory0\n"
      "#      resource 1  :  md 1  dev 1  flags -- tcp/lo\n"
      "#      resource 3  :  md 2  dev 3  flags -- posix/memory\n"
      "#      resource 7  :  md 5  dev 4  flags -- rc_mlx5/mlx5_0:1\n"
      "#      resource 8  :  md 5  dev 4  flags -- nothing\n";
  CHECK(ucx::ParseResourceTransports(info) ==
        std::vector<std::string>{"self", "tcp", "posix", "rc_mlx5"});
  CHECK(ucx::ParseResourceTransports("").empty());
}
