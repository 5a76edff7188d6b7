#include "backends/verbs/verbs_device.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#ifdef PDLIB_VERBS_DMABUF
#include <cuda.h>
#endif

namespace pdlib {
inline namespace v1 {
namespace verbs {
namespace {

const char* PortStateName(ibv_port_state state) { return ibv_port_state_str(state); }

constexpr uint32_t kSoftRoceVendorId = 0xffffff;  // RXE_VENDOR_ID in the kernel's rdma_rxe

bool IsIpv4Mapped(const ibv_gid& gid) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw, kPrefix, sizeof(kPrefix)) == 0;
}

bool IsZero(const ibv_gid& gid) {
  return std::all_of(std::begin(gid.raw), std::end(gid.raw), [](uint8_t b) { return b == 0; });
}

// The GID index to use on a RoCE port: the option's, or the first RoCE v2 entry with an
// IPv4-mapped address (routable over IPv4 networks), else the first RoCE v2 entry, else 0.
StatusOr<int32_t> PickGidIndex(ibv_context* context, const ibv_port_attr& port_attr, uint8_t port,
                               int32_t requested, const std::string& label) {
  if (requested >= 0) {
    ibv_gid gid{};
    if (requested >= port_attr.gid_tbl_len || ibv_query_gid(context, port, requested, &gid) != 0 ||
        IsZero(gid)) {
      return Status::InvalidArgument("verbs: verbs.gid_index=" + std::to_string(requested) +
                                     " is not a valid GID on " + label + " (table of " +
                                     std::to_string(port_attr.gid_tbl_len) +
                                     " entries; see `show_gids` or `ibv_devinfo -v`)");
    }
    return requested;
  }
  int32_t first_v2 = -1;
  for (int32_t i = 0; i < port_attr.gid_tbl_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, port, static_cast<uint32_t>(i), &entry, 0) != 0) continue;
    if (entry.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    ibv_gid gid{};
    std::memcpy(gid.raw, entry.gid.raw, sizeof(gid.raw));
    if (IsZero(gid)) continue;
    if (IsIpv4Mapped(gid)) return i;
    if (first_v2 < 0) first_v2 = i;
  }
  return first_v2 >= 0 ? first_v2 : 0;
}

// Fills `device` for port `port` of the opened `context`, or says why the port is unusable.
Status SetUpPort(ibv_context* context, uint8_t port, const VerbsOptions& options, Device* device) {
  ibv_device_attr attr{};
  if (int rc = ibv_query_device(context, &attr); rc != 0) {
    return Status::Internal("verbs: ibv_query_device(" + device->name +
                            ") failed: " + ErrnoText(rc));
  }
  if (port < 1 || port > attr.phys_port_cnt) {
    return Status::InvalidArgument("verbs: " + device->name + " has no port " +
                                   std::to_string(port) + " (ports 1.." +
                                   std::to_string(attr.phys_port_cnt) + ")");
  }
  ibv_port_attr port_attr{};
  if (int rc = ibv_query_port(context, port, &port_attr); rc != 0) {
    return Status::Internal("verbs: ibv_query_port(" + device->name + ":" + std::to_string(port) +
                            ") failed: " + ErrnoText(rc));
  }
  device->port = port;
  device->soft_roce = attr.vendor_id == kSoftRoceVendorId;
  const std::string label = device->label();
  if (port_attr.state != IBV_PORT_ACTIVE) {
    return Status::Unavailable("verbs: port " + label + " is " + PortStateName(port_attr.state) +
                               ", not ACTIVE");
  }
  device->global = port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  device->lid = port_attr.lid;
  device->active_mtu = port_attr.active_mtu;
  auto gid_index =
      PickGidIndex(context, port_attr, port, device->global ? options.gid_index : 0, label);
  if (!gid_index.ok()) return gid_index.status();
  device->gid_index = *gid_index;
  ibv_gid gid{};
  if (ibv_query_gid(context, port, device->gid_index, &gid) == 0) {
    std::memcpy(device->gid.data(), gid.raw, 16);
  }
  if (device->global && IsZero(gid)) {
    return Status::Unavailable("verbs: " + label + " is RoCE but GID index " +
                               std::to_string(device->gid_index) +
                               " is empty (does its netdev have an IP address?)");
  }
  auto limits = EffectiveLimits(static_cast<uint32_t>(attr.max_sge), port_attr.max_msg_sz,
                                options.max_sge, options.max_message_bytes);
  if (!limits.ok()) return limits.status().WithPrefix(label);
  device->limits = *limits;
  // Devices that report no max_sge_rd (0) take max_sge for reads too.
  const int max_sge_rd = attr.max_sge_rd > 0 ? attr.max_sge_rd : attr.max_sge;
  auto read_limits = EffectiveLimits(static_cast<uint32_t>(max_sge_rd), port_attr.max_msg_sz,
                                     options.max_sge, options.max_message_bytes);
  if (!read_limits.ok()) return read_limits.status().WithPrefix(label);
  device->read_limits = *read_limits;
  device->read_limits.max_sge = std::min(device->read_limits.max_sge, device->limits.max_sge);
  device->responder_depth =
      std::clamp<uint32_t>(static_cast<uint32_t>(attr.max_qp_rd_atom), 1, 255);
  device->initiator_depth =
      std::clamp<uint32_t>(static_cast<uint32_t>(attr.max_qp_init_rd_atom), 1, 255);
  device->sq_depth = std::min<uint32_t>(options.sq_depth, static_cast<uint32_t>(attr.max_qp_wr));
  device->cq_depth = std::min<uint32_t>(options.cq_depth, static_cast<uint32_t>(attr.max_cqe));
  if (device->sq_depth < 2 || device->cq_depth < device->sq_depth) {
    return Status::FailedPrecondition(
        "verbs: " + label + " allows max_qp_wr " + std::to_string(attr.max_qp_wr) +
        " and max_cqe " + std::to_string(attr.max_cqe) + ": too small for a send queue of " +
        std::to_string(options.sq_depth) + " and a CQ of " + std::to_string(options.cq_depth));
  }
  return Status::OK();
}

// Opens `dev` and sets up `port` (0: the first active one). On success *out owns the context.
Status OpenOne(ibv_device* dev, uint8_t port, const VerbsOptions& options, Device* out) {
  out->name = ibv_get_device_name(dev);
  ContextPtr context(ibv_open_device(dev));
  if (!context) {
    return Status::Unavailable("verbs: cannot open " + out->name + ": " + ErrnoText(errno) +
                               " (is /dev/infiniband/uverbs* accessible?)");
  }
  Status s;
  if (port != 0) {
    s = SetUpPort(context.get(), port, options, out);
  } else {
    ibv_device_attr attr{};
    if (int rc = ibv_query_device(context.get(), &attr); rc != 0) {
      return Status::Internal("verbs: ibv_query_device(" + out->name +
                              ") failed: " + ErrnoText(rc));
    }
    s = Status::Unavailable("verbs: " + out->name + " has no port");
    for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
      s = SetUpPort(context.get(), p, options, out);
      if (s.ok() || s.code() != StatusCode::kUnavailable) break;
    }
  }
  if (!s.ok()) return s;
  out->context = std::move(context);
  return Status::OK();
}

// PD, completion channel and CQ of an opened device.
Status CreateQueues(Device* device) {
  ibv_context* ctx = device->context.get();
  device->pd.reset(ibv_alloc_pd(ctx));
  if (!device->pd) {
    return Status::Internal("verbs: ibv_alloc_pd(" + device->name +
                            ") failed: " + ErrnoText(errno));
  }
  device->channel.reset(ibv_create_comp_channel(ctx));
  if (!device->channel) {
    return Status::Internal("verbs: ibv_create_comp_channel(" + device->name +
                            ") failed: " + ErrnoText(errno));
  }
  // The progress thread drains channel events without blocking (it waits in epoll instead).
  const int flags = fcntl(device->channel->fd, F_GETFL);
  if (flags < 0 || fcntl(device->channel->fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return Status::Internal("verbs: cannot make the completion channel non-blocking: " +
                            ErrnoText(errno));
  }
  device->cq.reset(
      ibv_create_cq(ctx, static_cast<int>(device->cq_depth), nullptr, device->channel.get(), 0));
  if (!device->cq) {
    return Status::Internal("verbs: ibv_create_cq(" + device->name + ", " +
                            std::to_string(device->cq_depth) + ") failed: " + ErrnoText(errno));
  }
  device->cq_depth = static_cast<uint32_t>(std::min<int>(device->cq->cqe, device->cq_depth));
  return Status::OK();
}

}  // namespace

std::string ListDeviceNames() {
  int n = 0;
  DeviceListPtr list(ibv_get_device_list(&n));
  std::string names;
  for (int i = 0; list && i < n; ++i) {
    names += (names.empty() ? "" : ", ") + std::string(ibv_get_device_name(list.get()[i]));
  }
  return names.empty() ? "none" : names;
}

StatusOr<std::vector<std::unique_ptr<Device>>> OpenDevices(const VerbsOptions& options) {
  int n = 0;
  DeviceListPtr list(ibv_get_device_list(&n));
  if (!list || n == 0) {
    return Status::FailedPrecondition(
        "verbs: no RDMA device found (ibv_get_device_list lists none: load a driver such as "
        "mlx5_ib, or create a Soft-RoCE device with `rdma link add rxe0 type rxe netdev eth0`)");
  }
  std::vector<std::unique_ptr<Device>> devices;
  if (options.devices.empty()) {
    std::string why;
    for (int i = 0; i < n; ++i) {
      auto device = std::make_unique<Device>();
      Status s = OpenOne(list.get()[i], 0, options, device.get());
      if (s.ok()) {
        devices.push_back(std::move(device));
        break;
      }
      why += (why.empty() ? "" : "; ") + std::string(s.message());
    }
    if (devices.empty()) {
      return Status::FailedPrecondition("verbs: no RDMA device has an active port: " + why);
    }
  } else {
    for (const DeviceSpec& spec : options.devices) {
      ibv_device* found = nullptr;
      for (int i = 0; i < n && !found; ++i) {
        if (spec.name == ibv_get_device_name(list.get()[i])) found = list.get()[i];
      }
      if (!found) {
        return Status::NotFound("verbs: no RDMA device named '" + spec.name +
                                "' (present: " + ListDeviceNames() + ")");
      }
      auto device = std::make_unique<Device>();
      Status s = OpenOne(found, spec.port, options, device.get());
      if (!s.ok()) return s;
      devices.push_back(std::move(device));
    }
  }
  for (auto& device : devices) {
    if (Status s = CreateQueues(device.get()); !s.ok()) return s;
  }
  return devices;
}

Status PortActive(const Device& device) {
  ibv_port_attr attr{};
  if (int rc = ibv_query_port(device.context.get(), device.port, &attr); rc != 0) {
    return Status::Unavailable("verbs: ibv_query_port(" + device.label() +
                               ") failed: " + ErrnoText(rc));
  }
  if (attr.state != IBV_PORT_ACTIVE) {
    return Status::Unavailable("verbs: port " + device.label() + " is " +
                               PortStateName(attr.state) + ", not ACTIVE");
  }
  return Status::OK();
}

StatusOr<QpPtr> CreateRcQp(Device& device) {
  ibv_qp_init_attr init{};
  init.send_cq = device.cq.get();
  init.recv_cq = device.cq.get();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signalling (SendQueueBudget)
  init.cap.max_send_wr = device.sq_depth;
  init.cap.max_recv_wr = 1;  // writes only: nothing is ever received
  init.cap.max_send_sge = device.limits.max_sge;
  init.cap.max_recv_sge = 1;
  QpPtr qp(ibv_create_qp(device.pd.get(), &init));
  if (!qp) {
    return Status::ResourceExhausted("verbs: ibv_create_qp on " + device.label() + " (send queue " +
                                     std::to_string(device.sq_depth) + ", " +
                                     std::to_string(device.limits.max_sge) +
                                     " SGEs) failed: " + ErrnoText(errno));
  }
  if (Status s = MoveToInit(qp.get(), device); !s.ok()) return s;
  return qp;
}

Status MoveToInit(ibv_qp* qp, const Device& device) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = device.port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (int rc = ibv_modify_qp(qp, &attr,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
      rc != 0) {
    return Status::Internal("verbs: moving a QP on " + device.label() +
                            " to INIT failed: " + ErrnoText(rc));
  }
  return Status::OK();
}

Status ResetRcQp(ibv_qp* qp, const Device& device, const QpAddress& remote, uint32_t local_psn,
                 const VerbsOptions& options) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RESET;
  if (int rc = ibv_modify_qp(qp, &attr, IBV_QP_STATE); rc != 0) {
    return Status::Internal("verbs: resetting QP " + std::to_string(qp->qp_num) + " on " +
                            device.label() + " failed: " + ErrnoText(rc));
  }
  if (Status s = MoveToInit(qp, device); !s.ok()) return s;
  return ConnectRcQp(qp, device, remote, local_psn, options);
}

QpAddress LocalAddress(const Device& device, const ibv_qp& qp, uint32_t psn) {
  QpAddress a;
  a.qp_num = qp.qp_num;
  a.psn = psn & 0xffffff;
  a.lid = device.lid;
  a.mtu = static_cast<uint8_t>(device.active_mtu);
  a.global = device.global;
  a.port = device.port;
  a.rd_atomic = static_cast<uint8_t>(device.responder_depth);
  a.gid = device.gid;
  return a;
}

uint8_t RcRetryCount(const Device& device, const VerbsOptions& options) {
  return device.soft_roce && options.retry_cnt == 7 ? 6 : options.retry_cnt;
}

Status ConnectRcQp(ibv_qp* qp, const Device& device, const QpAddress& remote, uint32_t local_psn,
                   const VerbsOptions& options) {
  if (remote.global != device.global) {
    return Status::FailedPrecondition("verbs: " + device.label() + " is " +
                                      (device.global ? "RoCE" : "InfiniBand") +
                                      " but the peer's QP " + std::to_string(remote.qp_num) +
                                      " is on " + (remote.global ? "RoCE" : "InfiniBand"));
  }
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = static_cast<ibv_mtu>(std::min<int>(device.active_mtu, remote.mtu));
  attr.dest_qp_num = remote.qp_num;
  attr.rq_psn = remote.psn;
  attr.max_dest_rd_atomic = static_cast<uint8_t>(device.responder_depth);
  attr.min_rnr_timer = 12;
  attr.ah_attr.port_num = device.port;
  attr.ah_attr.dlid = remote.lid;
  if (remote.global) {
    attr.ah_attr.is_global = 1;
    std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(device.gid_index);
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.grh.traffic_class = options.traffic_class;
  }
  if (int rc = ibv_modify_qp(qp, &attr,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
      rc != 0) {
    return Status::Unavailable("verbs: moving QP " + std::to_string(qp->qp_num) + " on " +
                               device.label() + " to RTR towards QP " +
                               std::to_string(remote.qp_num) + " failed: " + ErrnoText(rc));
  }
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = options.timeout;
  attr.retry_cnt = RcRetryCount(device, options);
  attr.rnr_retry = 7;
  attr.sq_psn = local_psn & 0xffffff;
  attr.max_rd_atomic = static_cast<uint8_t>(ReadDepth(device.initiator_depth, remote.rd_atomic));
  if (int rc = ibv_modify_qp(qp, &attr,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                 IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
      rc != 0) {
    return Status::Unavailable("verbs: moving QP " + std::to_string(qp->qp_num) + " on " +
                               device.label() + " to RTS failed: " + ErrnoText(rc));
  }
  return Status::OK();
}

bool CudaRegistrationPossible() {
#ifdef PDLIB_VERBS_DMABUF
  return true;
#else
  struct stat st {};
  return stat("/sys/module/nvidia_peermem", &st) == 0 || stat("/sys/module/nv_peer_mem", &st) == 0;
#endif
}

namespace {

// Remote read: pull, where the initiator reads the target's regions (issue #29).
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

#ifdef PDLIB_VERBS_DMABUF
// The CUDA driver is loaded at run time, so that pdlib still loads on hosts without it.
struct CudaDriver {
  using InitFn = CUresult (*)(unsigned int);
  using GetHandleFn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                   unsigned long long);
  InitFn init = nullptr;
  GetHandleFn get_handle = nullptr;
  std::string error;
};

const CudaDriver& Driver() {
  static const CudaDriver driver = [] {
    CudaDriver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("cannot load libcuda.so.1: ") + dlerror();
      return d;
    }
    d.init = reinterpret_cast<CudaDriver::InitFn>(dlsym(lib, "cuInit"));
    d.get_handle =
        reinterpret_cast<CudaDriver::GetHandleFn>(dlsym(lib, "cuMemGetHandleForAddressRange"));
    if (d.init == nullptr || d.get_handle == nullptr) {
      d.error = "libcuda.so.1 lacks cuMemGetHandleForAddressRange (driver older than CUDA 11.7)";
    } else if (CUresult r = d.init(0); r != CUDA_SUCCESS) {
      d.error = "cuInit failed with CUresult " + std::to_string(static_cast<int>(r));
    }
    return d;
  }();
  return driver;
}

// ibv_reg_dmabuf_mr over a dma-buf of the CUDA range; the MR's iova is the device address, so
// peers write to the addresses the engine registered.
StatusOr<MrPtr> RegisterDmabuf(Device& device, uint64_t addr, uint64_t length) {
  const CudaDriver& driver = Driver();
  if (!driver.error.empty()) return Status::FailedPrecondition(driver.error);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t base = addr & ~(page - 1);
  const uint64_t span = ((addr + length + page - 1) & ~(page - 1)) - base;
  int fd = -1;
  CUresult r = driver.get_handle(&fd, static_cast<CUdeviceptr>(base), span,
                                 CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS || fd < 0) {
    return Status::FailedPrecondition("cuMemGetHandleForAddressRange failed with CUresult " +
                                      std::to_string(static_cast<int>(r)) +
                                      " (dma-buf needs an open kernel module driver)");
  }
  MrPtr mr(ibv_reg_dmabuf_mr(device.pd.get(), addr - base, length, addr, fd, kAccess));
  const int err = errno;
  close(fd);
  if (!mr) return Status::FailedPrecondition("ibv_reg_dmabuf_mr failed: " + ErrnoText(err));
  return mr;
}
#endif

}  // namespace

StatusOr<MrPtr> RegisterRegion(Device& device, const spi::MemoryRegion& region) {
  const uint64_t addr = reinterpret_cast<uint64_t>(region.addr);
  if (region.kind == MemoryKind::kCuda) {
    std::string dmabuf_error = "pdlib was built without CUDA, so dma-buf registration is off";
#ifdef PDLIB_VERBS_DMABUF
    auto mr = RegisterDmabuf(device, addr, region.length);
    if (mr.ok()) return mr;
    dmabuf_error = mr.status().message();
#endif
    // Peer memory: the kernel resolves the device address through nvidia_peermem.
    MrPtr mr_peer(
        ibv_reg_mr(device.pd.get(), const_cast<void*>(region.addr), region.length, kAccess));
    if (mr_peer) return mr_peer;
    const int err = errno;
    return Status::FailedPrecondition(
        "verbs: cannot register CUDA memory (" + std::to_string(region.length) + " bytes on GPU " +
        std::to_string(region.device_id) + ") on " + device.label() + ": dma-buf: " + dmabuf_error +
        "; peer memory: ibv_reg_mr failed: " + ErrnoText(err) +
        (CudaRegistrationPossible() ? "" : " (nvidia_peermem is not loaded)"));
  }
  MrPtr mr(ibv_reg_mr(device.pd.get(), const_cast<void*>(region.addr), region.length, kAccess));
  if (!mr) {
    const int err = errno;
    std::string hint;
    if (err == ENOMEM || err == EPERM || err == EAGAIN) {
      hint = " (pinned memory is limited by `ulimit -l`; raise the memlock limit)";
    }
    return Status::ResourceExhausted("verbs: ibv_reg_mr of " + std::to_string(region.length) +
                                     " bytes at " + std::to_string(addr) + " on " + device.label() +
                                     " failed: " + ErrnoText(err) + hint);
  }
  return mr;
}

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib
