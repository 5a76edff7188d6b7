#include "backends/ucx/ucx_options.h"

#include <algorithm>
#include <string_view>

#include "backends/common/backend_options.h"
#include "lib/rails/rails.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {
namespace {

constexpr std::string_view kConfigPrefix = "ucx.config.";

// Chosen on UCX 1.13.1 (Debian) with in-process loopback measurements; see the issue note.
constexpr UcxDefault kDefaults[] = {
    {"MM_ERROR_HANDLING", "y", "MM_ERROR_HANDLING,POSIX_ERROR_HANDLING,SYSV_ERROR_HANDLING",
     "shared memory (posix/sysv) does not advertise peer-failure support by default, and UCX "
     "then refuses it to endpoints with peer error handling ('no peer failure handler'), which "
     "pdlib always asks for; with it, UCX detects a dead peer process by its pid"},
    {"MM_SEG_SIZE", "33000", "MM_SEG_SIZE,POSIX_SEG_SIZE,SYSV_SEG_SIZE",
     "puts into memory UCX did not allocate are emulated with active messages of at most one "
     "segment; 8 KiB segments (default) cut a 32 KiB KV page into 4 messages (about 0.7x the "
     "throughput), 33000 moves it in one. Must stay below 64 KiB (see kMaxMmSegSize)"},
    {"TX_SEG_SIZE", "128k", "TCP_TX_SEG_SIZE,TCP_RX_SEG_SIZE,TX_SEG_SIZE,RX_SEG_SIZE",
     "tcp sends puts in segments of this size; the 8 KiB default costs a send call and a header "
     "per 8 KiB and gets about a quarter of the loopback throughput for 32 KiB writes"},
    {"RX_SEG_SIZE", "128k", "TCP_TX_SEG_SIZE,TCP_RX_SEG_SIZE,TX_SEG_SIZE,RX_SEG_SIZE",
     "tcp's receive segment must hold a whole send segment"},
    {"CONN_NB", "y", "TCP_CONN_NB,CONN_NB",
     "tcp connects with a blocking connect() by default: an endpoint to an address that does not "
     "answer (a partitioned link, a rail that died) would hold the progress thread, and every "
     "other connection with it, for seconds (measured: 3 s per attempt on a cut rail)"},
    {"KEEPALIVE_INTERVAL", "20s", "KEEPALIVE_INTERVAL",
     "UCX declares a silent peer dead after this; pdlib's own liveness (the control stream) fails "
     "requests long before. It stays well above a pause (GC, SIGSTOP): UCX 1.13 aborts a target "
     "process that, after such a pause, handles an emulated put on a connection the initiator "
     "closed meanwhile. Decode (a target only) gets 'inf': it never needs UCX to find a dead "
     "prefill"},
};

// UCX 1.13 keeps a shared-memory FIFO element's length in 16 bits: with segments larger than
// this, an active message of 64 KiB or more wraps and its data is silently lost (measured: a
// 64 KiB put with UCX_SYSV_SEG_SIZE=66000 completes, flushed, and never arrives).
constexpr uint64_t kMaxMmSegSize = 65535;
constexpr const char* kMmSegSizeVars[] = {"MM_SEG_SIZE", "POSIX_SEG_SIZE", "SYSV_SEG_SIZE"};

// Which transports (as UCX_TLS names them) a default concerns; a default for a transport that
// UCX_TLS leaves out is not applied (UCX would warn that nothing used it).
struct DefaultScope {
  const char* key;
  const char* transports;
};
constexpr DefaultScope kScopes[] = {
    {"MM_ERROR_HANDLING", "shm,sm,mm,posix,sysv"},
    {"MM_SEG_SIZE", "shm,sm,mm,posix,sysv"},
    {"TX_SEG_SIZE", "tcp"},
    {"RX_SEG_SIZE", "tcp"},
    {"CONN_NB", "tcp"},
};

// True when `name` is in the comma-separated `list`.
bool InList(std::string_view list, std::string_view name) {
  while (!list.empty()) {
    size_t comma = list.find(',');
    if (list.substr(0, comma) == name) return true;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return false;
}

// Whether the user chose any of `d.user_vars`, in the environment or as backend options.
bool UserChose(const UcxDefault& d, const std::map<std::string, std::string>& config,
               const EnvLookup& getenv_fn) {
  for (const auto& [name, value] : config) {
    if (name == d.key || InList(d.user_vars, name)) return true;
  }
  std::string_view list = d.user_vars;
  while (!list.empty()) {
    size_t comma = list.find(',');
    std::string env = "UCX_" + std::string(list.substr(0, comma));
    if (getenv_fn && getenv_fn(env.c_str()) != nullptr) return true;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return false;
}

std::string Join(const std::vector<std::string>& items, char sep) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += sep;
    out += item;
  }
  return out;
}

}  // namespace

std::span<const UcxDefault> UcxDefaults() { return kDefaults; }

StatusOr<std::vector<std::string>> AutoRails(const spi::TransportOptions& options,
                                             const std::string& tls,
                                             const std::string& sysfs_root) {
  // tcp alone (the names UCX_TLS may use for it) rides network interfaces; anything else may
  // take an RDMA transport, whose devices UCX names NAME:PORT.
  bool tcp_only = !tls.empty() && tls.front() != '^';
  for (size_t at = 0; tcp_only && at <= tls.size();) {
    const size_t comma = std::min(tls.find(',', at), tls.size());
    const std::string word = tls.substr(at, comma - at);
    tcp_only = word == "tcp" || word == "self" || word == "sm" || word == "shm" ||
               word == "posix" || word == "sysv" || word == "cma" || word == "mm";
    at = comma + 1;
  }
  rails::RailQuery query;
  query.sysfs_root = sysfs_root;
  query.kind = tcp_only ? rails::NicKind::kNet : rails::NicKind::kRdma;
  query.memory = options.memory_pci_address.empty()
                     ? rails::MemoryLocation::Host(options.memory_numa_node)
                     : rails::MemoryLocation::Pci(options.memory_pci_address);
  query.explicit_names = options.nic_names;  // nic_names, when given, are the rails
  auto choice = rails::SelectRails(query);
  if (!choice.ok()) return choice.status().WithPrefix("ucx: ucx.rails=auto");
  std::vector<std::string> out;
  for (const rails::Rail& rail : choice->rails) {
    if (out.size() == kMaxRails) break;
    const bool has_port = rail.name.find(':') != std::string::npos;
    out.push_back(tcp_only || has_port ? rail.name : rail.name + ":1");
  }
  if (out.empty()) {
    return Status::NotFound(
        "ucx: ucx.rails=auto found no " +
        std::string(tcp_only ? "network interface" : "RDMA device") + " on PCI under " +
        sysfs_root +
        " (virtual interfaces such as veths and Soft-RoCE count only when named): list the rails "
        "in ucx.rails or nic_names");
  }
  return out;
}

StatusOr<UcxOptions> ParseUcxOptions(const spi::TransportOptions& options,
                                     const EnvLookup& getenv_fn) {
  UcxOptions out;
  // Pacing defaults: see backends/common/inflight_window.h for why these exist and the issue note
  // for the figures.
  out.max_inflight_bytes = uint64_t{4} << 20;
  // Reads on the "am" path free their window only when the replies arrived, a round trip later
  // than a send completes, so they get more room. Measured on a loaded 2-core machine, tcp on lo,
  // pull only: 4, 16 and 64 MiB all gave 10-13.5 Gbit/s (within noise); 16 MiB leaves room for a
  // longer round trip between hosts at the cost of at most 16 MiB of reply copies on the target.
  out.max_inflight_read_bytes = uint64_t{16} << 20;
  out.chunk_bytes = uint64_t{1} << 20;
  out.busy_poll_us = 20;
  out.stall_timeout_ms = 30000;
  out.am_chunk_bytes = uint64_t{32} << 10;
  // A TCP link partitioned for a second comes back about 0.5 s after the heal (retransmission
  // backoff), so a rail is declared down only after a longer silence than that.
  out.rail_stall_ms = 3000;
  out.rail_retry_ms = 1000;

  toolkit::OptionParser parser("ucx");
  parser.On("ucx.tls", [&](const std::string&, const std::string& value) {
    out.ucx_config["TLS"] = value;
    return Status::OK();
  });
  parser.On("ucx.net_devices", [&](const std::string&, const std::string& value) {
    out.ucx_config["NET_DEVICES"] = value;
    return Status::OK();
  });
  parser.OnPrefix(std::string(kConfigPrefix), "ucx.config.<NAME>",
                  [&](const std::string& key, const std::string& value) {
                    std::string name = key.substr(kConfigPrefix.size());
                    if (name.empty()) {
                      return Status::InvalidArgument("ucx: option '" + key + "' names no variable");
                    }
                    if (name.compare(0, 4, "UCX_") == 0) name = name.substr(4);
                    out.ucx_config[name] = value;
                    return Status::OK();
                  });
  parser.Bytes("ucx.max_inflight_bytes", &out.max_inflight_bytes);
  parser.Bytes("ucx.max_inflight_read_bytes", &out.max_inflight_read_bytes);
  parser.Bytes("ucx.chunk_bytes", &out.chunk_bytes);
  parser.Number("ucx.busy_poll_us", &out.busy_poll_us, 0, 1000000);
  parser.Number("ucx.stall_timeout_ms", &out.stall_timeout_ms, 0, 24u * 3600 * 1000);
  parser.Choice("ucx.flush", &out.flush,
                {{"ep", FlushMode::kEndpoint}, {"worker", FlushMode::kWorker}});
  parser.Choice("ucx.data_path", &out.data_path,
                {{"auto", DataPath::kAuto}, {"am", DataPath::kAm}, {"put", DataPath::kPut}});
  parser.Bytes("ucx.am_chunk_bytes", &out.am_chunk_bytes);
  parser.Number("ucx.rail_stall_ms", &out.rail_stall_ms, 0, 24u * 3600 * 1000);
  parser.Number("ucx.rail_retry_ms", &out.rail_retry_ms, 10, 3600u * 1000);
  bool rails_auto = false;
  std::string sysfs_root = "/sys";
  parser.On("ucx.sysfs_root", [&](const std::string&, const std::string& value) {
    if (value.empty()) return Status::InvalidArgument("ucx: ucx.sysfs_root is empty");
    sysfs_root = value;
    return Status::OK();
  });
  parser.On("ucx.rails", [&](const std::string&, const std::string& value) {
    out.rails.clear();
    rails_auto = value == "auto";
    if (rails_auto) return Status::OK();
    size_t start = 0;
    while (start <= value.size()) {
      const size_t comma = std::min(value.find(',', start), value.size());
      std::string device = value.substr(start, comma - start);
      if (device.empty()) {
        return Status::InvalidArgument("ucx: ucx.rails='" + value +
                                       "' has an empty entry (a comma-separated device list)");
      }
      if (std::find(out.rails.begin(), out.rails.end(), device) != out.rails.end()) {
        return Status::InvalidArgument("ucx: ucx.rails='" + value + "' names " + device + " twice");
      }
      out.rails.push_back(std::move(device));
      start = comma + 1;
    }
    if (out.rails.size() > kMaxRails) {
      return Status::InvalidArgument("ucx: ucx.rails='" + value + "' lists " +
                                     std::to_string(out.rails.size()) + " rails; at most " +
                                     std::to_string(kMaxRails));
    }
    return Status::OK();
  });
  if (Status s = parser.Parse(options.options); !s.ok()) return s;
  if (rails_auto) {
    if (out.ucx_config.count("NET_DEVICES")) {
      return Status::InvalidArgument(
          "ucx: ucx.rails and ucx.net_devices (or ucx.config.NET_DEVICES) both given: rails set "
          "each rail's devices; use one of them");
    }
    const auto tls = out.ucx_config.find("TLS");
    const char* env_tls = getenv_fn ? getenv_fn("UCX_TLS") : nullptr;
    auto rails = AutoRails(options,
                           tls != out.ucx_config.end() ? tls->second
                           : env_tls != nullptr        ? env_tls
                                                       : "",
                           sysfs_root);
    if (!rails.ok()) return rails.status();
    out.rails = std::move(*rails);
  }
  if (!out.rails.empty()) {
    if (out.ucx_config.count("NET_DEVICES")) {
      return Status::InvalidArgument(
          "ucx: ucx.rails and ucx.net_devices (or ucx.config.NET_DEVICES) both given: rails set "
          "each rail's devices; use one of them");
    }
    out.ucx_config["NET_DEVICES"] = out.rails.front();  // rail 0: the main context
  }
  if (!out.ucx_config.count("NET_DEVICES") && !options.nic_names.empty()) {
    out.ucx_config["NET_DEVICES"] = Join(options.nic_names, ',');
  }
  for (const char* var : kMmSegSizeVars) {
    const char* env = getenv_fn ? getenv_fn(("UCX_" + std::string(var)).c_str()) : nullptr;
    auto it = out.ucx_config.find(var);
    const char* value = it != out.ucx_config.end() ? it->second.c_str() : env;
    if (value == nullptr) continue;
    auto bytes = ParseByteSize(value);
    if (bytes.ok() && *bytes > kMaxMmSegSize) {
      return Status::InvalidArgument(
          std::string("ucx: ") + var + "=" + value + " is above " + std::to_string(kMaxMmSegSize) +
          " bytes: UCX 1.13's shared-memory transport loses messages of 64 KiB or more; use a "
          "smaller segment (pdlib's default is 33000)");
    }
  }

  // UCX_TLS as UCX will see it: the backend option, else the environment, else "all".
  std::string tls = "all";
  if (auto it = out.ucx_config.find("TLS"); it != out.ucx_config.end()) {
    tls = it->second;
  } else if (const char* env = getenv_fn ? getenv_fn("UCX_TLS") : nullptr; env != nullptr) {
    tls = env;
  }
  const bool negated = !tls.empty() && tls[0] == '^';
  std::string_view tls_list = negated ? std::string_view(tls).substr(1) : std::string_view(tls);
  auto in_scope = [&](const UcxDefault& d) {
    for (const DefaultScope& scope : kScopes) {
      if (std::string_view(scope.key) != d.key) continue;
      if (InList(tls_list, "all")) return true;
      bool named = false;
      std::string_view transports = scope.transports;
      while (!transports.empty()) {
        size_t comma = transports.find(',');
        named |= InList(tls_list, transports.substr(0, comma));
        if (comma == std::string_view::npos) break;
        transports.remove_prefix(comma + 1);
      }
      return negated ? !named : named;
    }
    return true;  // not transport-specific
  };

  std::map<std::string, std::string> defaults;
  for (const UcxDefault& d : kDefaults) {
    if (in_scope(d) && !UserChose(d, out.ucx_config, getenv_fn)) defaults[d.key] = d.value;
  }
  if (auto k = defaults.find("KEEPALIVE_INTERVAL");
      k != defaults.end() && options.mode == Mode::kDecode) {
    k->second = "inf";  // see kDefaults
  }
  out.ucx_config.merge(defaults);
  return out;
}

UcxOptions RailOptions(const UcxOptions& options, size_t rail) {
  UcxOptions out = options;
  if (rail < options.rails.size()) out.ucx_config["NET_DEVICES"] = options.rails[rail];
  return out;
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib
