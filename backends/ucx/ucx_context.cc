#include "backends/ucx/ucx_context.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "lib/base/log_internal.h"

extern char** environ;

namespace pdlib {
inline namespace v1 {
namespace ucx {
namespace {

// Contexts by configuration; an entry expires when its context's last user goes.
struct ContextCache {
  Mutex mu;
  std::map<std::string, std::weak_ptr<UcxContext>> by_key ABSL_GUARDED_BY(mu);
};

ContextCache& Cache() {
  static ContextCache* cache = new ContextCache();  // never destroyed: used until exit
  return *cache;
}

// What makes two contexts differ: the settings pdlib applies and the UCX_* environment, which
// ucp_config_read reads when the context is created.
std::string ConfigKey(const UcxOptions& options) {
  std::string key;
  for (const auto& [name, value] : options.ucx_config) key += name + "=" + value + "\n";
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (std::strncmp(*e, "UCX_", 4) == 0) env.emplace_back(*e);
  }
  std::sort(env.begin(), env.end());
  key += "--env--\n";
  for (const std::string& e : env) key += e + "\n";
  return key;
}

bool IsPdlibDefault(const std::string& name) {
  for (const UcxDefault& d : UcxDefaults()) {
    if (name == d.key) return true;
  }
  return false;
}

StatusOr<std::shared_ptr<UcxContext>> CreateContext(const UcxOptions& options, std::string key) {
  ucp_config_t* raw_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_config);
  if (st != UCS_OK) {
    return Status::FailedPrecondition("ucx: ucp_config_read failed: " + UcsStatusName(st) +
                                      "; check the UCX_* environment variables");
  }
  UcpConfigPtr config(raw_config);
  for (const auto& [name, value] : options.ucx_config) {
    st = ucp_config_modify(config.get(), name.c_str(), value.c_str());
    if (st == UCS_OK) continue;
    if (IsPdlibDefault(name)) {  // e.g. a transport this UCX build lacks: not the user's error
      PDLIB_LOG(kWarning, "ucx: default UCX_%s=%s not applied: %s", name, value, UcsStatusName(st));
      continue;
    }
    return Status::InvalidArgument("ucx: UCX setting " + name + "='" + value +
                                   "' rejected: " + UcsStatusName(st));
  }

  auto context = std::make_shared<UcxContext>();
  context->key = std::move(key);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  // AM: pdlib's own data path (ucx_transport.h, "Data paths") rides on active messages.
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.request_size = kRequestContextBytes;
  params.mt_workers_shared = 1;
  params.name = "pdlib";
  ucp_context_h raw_context = nullptr;
  st = ucp_init(&params, config.get(), &raw_context);
  if (st != UCS_OK) {
    auto setting = [&](const char* name) {
      auto it = options.ucx_config.find(name);
      if (it != options.ucx_config.end()) return it->second;
      const char* env = std::getenv((std::string("UCX_") + name).c_str());
      return env != nullptr ? std::string(env) + " (environment)" : std::string("UCX's default");
    };
    return Status::FailedPrecondition(
        "ucx: ucp_init failed: " + UcsStatusName(st) + " (UCX_TLS=" + setting("TLS") +
        ", UCX_NET_DEVICES=" + setting("NET_DEVICES") + " select no usable transport?)");
  }
  context->handle.reset(raw_context);
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(raw_context, &attr) == UCS_OK) {
    context->cuda_supported = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  char* text = nullptr;
  size_t text_size = 0;
  if (FILE* out = open_memstream(&text, &text_size); out != nullptr) {
    ucp_context_print_info(raw_context, out);
    std::fclose(out);
    for (const std::string& tl : ParseResourceTransports(std::string_view(text, text_size))) {
      context->rdma_transport |= tl.compare(0, 3, "rc_") == 0 || tl.compare(0, 3, "dc_") == 0;
      context->shm_mapping |= tl == "posix" || tl == "sysv";
      context->xpmem |= tl == "xpmem";
    }
    std::free(text);
  }
  return context;
}

// A pool UCX allocated. The mapping is shared with registrations of ranges inside it, so UCX
// frees the memory when the pool and every such registration are gone.
class UcxKVPool final : public KVPool {
 public:
  UcxKVPool(std::shared_ptr<UcxContext> context, void* data, uint64_t size, MemoryKind kind)
      : context_(std::move(context)), data_(data), size_(size), kind_(kind) {}
  ~UcxKVPool() override {
    std::shared_ptr<UcpMemh> memh;  // released after the lock (ucp_mem_unmap may take a while)
    MutexLock lock(&context_->mu);
    auto& all = context_->allocations;
    auto it = std::find_if(all.begin(), all.end(), [this](const UcxAllocationRecord& a) {
      return a.addr == reinterpret_cast<uintptr_t>(data_);
    });
    if (it != all.end()) {
      memh = std::move(it->memh);
      all.erase(it);
    }
  }
  UcxKVPool(const UcxKVPool&) = delete;
  UcxKVPool& operator=(const UcxKVPool&) = delete;

  void* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  MemoryKind kind() const override { return kind_; }
  std::string_view allocator() const override { return "ucx"; }

 private:
  std::shared_ptr<UcxContext> context_;
  void* data_;
  uint64_t size_;
  MemoryKind kind_;
};

}  // namespace

std::vector<std::string> ParseResourceTransports(std::string_view print_info) {
  std::vector<std::string> out;
  while (!print_info.empty()) {
    size_t eol = print_info.find('\n');
    std::string_view line = print_info.substr(0, eol);
    print_info = eol == std::string_view::npos ? std::string_view() : print_info.substr(eol + 1);
    if (line.find("resource") == std::string_view::npos) continue;
    size_t dashes = line.rfind("-- ");
    if (dashes == std::string_view::npos) continue;
    std::string_view resource = line.substr(dashes + 3);
    size_t slash = resource.find('/');
    if (slash == 0 || slash == std::string_view::npos) continue;
    out.emplace_back(resource.substr(0, slash));
  }
  return out;
}

std::shared_ptr<UcpMemh> UcxContext::FindAllocation(uintptr_t addr, uint64_t length) {
  MutexLock lock(&mu);
  for (const UcxAllocationRecord& a : allocations) {
    if (addr >= a.addr && addr + length <= a.addr + a.length) return a.memh;
  }
  return nullptr;
}

StatusOr<std::shared_ptr<UcxContext>> AcquireUcxContext(const UcxOptions& options) {
  std::string key = ConfigKey(options);
  ContextCache& cache = Cache();
  MutexLock lock(&cache.mu);
  std::erase_if(cache.by_key, [](const auto& entry) { return entry.second.expired(); });
  if (auto it = cache.by_key.find(key); it != cache.by_key.end()) {
    if (std::shared_ptr<UcxContext> live = it->second.lock()) return live;
  }
  auto created = CreateContext(options, key);
  if (!created.ok()) return created.status();
  cache.by_key[key] = *created;
  return created;
}

StatusOr<std::unique_ptr<KVPool>> AllocateUcxPool(std::shared_ptr<UcxContext> context,
                                                  uint64_t bytes, MemoryKind kind) {
  if (bytes == 0) return Status::InvalidArgument("ucx: cannot allocate 0 bytes");
  if (kind == MemoryKind::kCuda && !context->cuda_supported) {
    return Status::FailedPrecondition(
        "ucx: cannot allocate CUDA memory: this UCX reports no CUDA support (ucx_info -d lists "
        "no cuda_copy/cuda_ipc transport)");
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  params.memory_type = kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h raw = nullptr;
  ucs_status_t st = ucp_mem_map(context->handle.get(), &params, &raw);
  if (st != UCS_OK) {
    return Status::ResourceExhausted("ucx: ucp_mem_map could not allocate " +
                                     std::to_string(bytes) + " bytes: " + UcsStatusName(st));
  }
  auto memh = std::make_shared<UcpMemh>(context->handle.get(), raw);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(raw, &attr);
  if (st != UCS_OK) return Status::Internal("ucx: ucp_mem_query failed: " + UcsStatusName(st));
  {
    MutexLock lock(&context->mu);
    context->allocations.push_back(
        UcxAllocationRecord{reinterpret_cast<uintptr_t>(attr.address), attr.length, kind, memh});
  }
  return std::unique_ptr<KVPool>(
      new UcxKVPool(std::move(context), attr.address, attr.length, kind));
}

StatusOr<std::unique_ptr<KVPool>> AllocateUcxPoolFor(
    uint64_t bytes, MemoryKind kind, const std::map<std::string, std::string>& backend_options,
    Mode mode) {
  spi::TransportOptions options;
  options.options = backend_options;
  options.mode = mode;
  auto parsed = ParseUcxOptions(options, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) return parsed.status();
  auto context = AcquireUcxContext(*parsed);
  if (!context.ok()) return context.status();
  return AllocateUcxPool(std::move(*context), bytes, kind);
}

bool InForeignUcxPool(const UcxContext& context, uintptr_t addr, uint64_t length) {
  std::vector<std::shared_ptr<UcxContext>> others;
  {
    ContextCache& cache = Cache();
    MutexLock lock(&cache.mu);
    for (const auto& [key, weak] : cache.by_key) {
      if (auto other = weak.lock(); other && other.get() != &context) others.push_back(other);
    }
  }
  for (const auto& other : others) {
    if (other->FindAllocation(addr, length)) return true;
  }
  return false;
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib
