// RAII owners for the UCX (ucp) handles the backend creates (STYLE.md habit 4): each handle is
// owned from the moment UCX returns it and released by exactly one call. The owners do not make
// UCX thread-safe: every handle here is created, used and destroyed on the transport's progress
// thread (or, for the context and worker, before it starts and after it has been joined).
#ifndef PDLIB_BACKENDS_UCX_UCX_HANDLES_H_
#define PDLIB_BACKENDS_UCX_UCX_HANDLES_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {

// "UCS_ERR_CONNECTION_RESET (Connection reset by remote peer)": names the status for messages.
inline std::string UcsStatusName(ucs_status_t status) {
  return std::string(ucs_status_string(status)) + " (ucs_status " +
         std::to_string(static_cast<int>(status)) + ")";
}

// Handles released by a one-argument UCX call.
template <typename T, auto kRelease>
struct UcxDeleter {
  void operator()(T* handle) const { kRelease(handle); }
};
using UcpConfigPtr = std::unique_ptr<ucp_config_t, UcxDeleter<ucp_config_t, ucp_config_release>>;
// ucp_context_h and ucp_worker_h are pointers to opaque structs.
using UcpContextPtr =
    std::unique_ptr<std::remove_pointer_t<ucp_context_h>,
                    UcxDeleter<std::remove_pointer_t<ucp_context_h>, ucp_cleanup>>;
using UcpWorkerPtr =
    std::unique_ptr<std::remove_pointer_t<ucp_worker_h>,
                    UcxDeleter<std::remove_pointer_t<ucp_worker_h>, ucp_worker_destroy>>;
using UcpRkeyPtr = std::unique_ptr<std::remove_pointer_t<ucp_rkey_h>,
                                   UcxDeleter<std::remove_pointer_t<ucp_rkey_h>, ucp_rkey_destroy>>;
using UcpRkeyBufferPtr = std::unique_ptr<void, UcxDeleter<void, ucp_rkey_buffer_release>>;

// A ucp_mem_map registration (or allocation); unmapped on destruction.
class UcpMemh {
 public:
  UcpMemh() = default;
  UcpMemh(ucp_context_h context, ucp_mem_h memh) : context_(context), memh_(memh) {}
  UcpMemh(UcpMemh&& other) noexcept
      : context_(other.context_), memh_(std::exchange(other.memh_, nullptr)) {}
  UcpMemh& operator=(UcpMemh&& other) noexcept {
    if (this != &other) {
      Reset();
      context_ = other.context_;
      memh_ = std::exchange(other.memh_, nullptr);
    }
    return *this;
  }
  ~UcpMemh() { Reset(); }

  ucp_mem_h get() const { return memh_; }
  explicit operator bool() const { return memh_ != nullptr; }
  void Reset() {
    // ucp_mem_unmap fails only for a handle it does not know; nothing useful to do then.
    if (memh_ != nullptr) (void)ucp_mem_unmap(context_, std::exchange(memh_, nullptr));
  }

 private:
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

// The worker's address (what a peer's ucp_ep_create needs); released back to the worker.
class UcpWorkerAddress {
 public:
  UcpWorkerAddress() = default;
  UcpWorkerAddress(ucp_worker_h worker, ucp_address_t* address, size_t length)
      : worker_(worker), address_(address), length_(length) {}
  UcpWorkerAddress(UcpWorkerAddress&& other) noexcept
      : worker_(other.worker_),
        address_(std::exchange(other.address_, nullptr)),
        length_(other.length_) {}
  UcpWorkerAddress& operator=(UcpWorkerAddress&& other) noexcept {
    if (this != &other) {
      Reset();
      worker_ = other.worker_;
      address_ = std::exchange(other.address_, nullptr);
      length_ = other.length_;
    }
    return *this;
  }
  ~UcpWorkerAddress() { Reset(); }

  const uint8_t* data() const { return reinterpret_cast<const uint8_t*>(address_); }
  size_t size() const { return length_; }
  void Reset() {
    if (address_ != nullptr) ucp_worker_release_address(worker_, std::exchange(address_, nullptr));
  }

 private:
  ucp_worker_h worker_ = nullptr;
  ucp_address_t* address_ = nullptr;
  size_t length_ = 0;
};

// An endpoint. The transport closes endpoints asynchronously (ucp_ep_close_nbx, then progress
// until the close request completes) and calls Release() to take the handle for that; the
// destructor is the fallback for paths that never started a close: it force-closes and
// progresses the worker until UCX is done with the endpoint.
class UcpEp {
 public:
  UcpEp() = default;
  UcpEp(ucp_worker_h worker, ucp_ep_h ep) : worker_(worker), ep_(ep) {}
  UcpEp(UcpEp&& other) noexcept : worker_(other.worker_), ep_(std::exchange(other.ep_, nullptr)) {}
  UcpEp& operator=(UcpEp&& other) noexcept {
    if (this != &other) {
      Reset();
      worker_ = other.worker_;
      ep_ = std::exchange(other.ep_, nullptr);
    }
    return *this;
  }
  ~UcpEp() { Reset(); }

  ucp_ep_h get() const { return ep_; }
  explicit operator bool() const { return ep_ != nullptr; }
  ucp_ep_h Release() { return std::exchange(ep_, nullptr); }
  void Reset() {
    if (ep_ == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t request = ucp_ep_close_nbx(std::exchange(ep_, nullptr), &param);
    if (UCS_PTR_IS_PTR(request)) {
      while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(request);
    }
  }

 private:
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
};

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_HANDLES_H_
