// RAII owners for the libibverbs handles the backend creates (STYLE.md habit 4): each handle is
// owned from the moment the library returns it and released by exactly one call. Declaration
// order inside an owner's class decides teardown: MRs and QPs before CQs, CQs before their
// completion channel, everything before the PD, the PD before the device context.
#ifndef PDLIB_BACKENDS_VERBS_VERBS_HANDLES_H_
#define PDLIB_BACKENDS_VERBS_VERBS_HANDLES_H_

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

// "Cannot allocate memory (errno 12)": for messages.
inline std::string ErrnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

// Release calls that return an error code: a failure is logged, since a destructor cannot
// return it and the handle is unusable afterwards either way.
template <typename T, int (*kRelease)(T*)>
struct VerbsDeleter {
  void operator()(T* handle) const {
    if (int rc = kRelease(handle); rc != 0) {
      PDLIB_LOG(kWarning, "verbs: releasing a handle failed (%s): %s", __PRETTY_FUNCTION__,
                ErrnoText(rc < 0 ? -rc : rc));
    }
  }
};

using ContextPtr = std::unique_ptr<ibv_context, VerbsDeleter<ibv_context, ibv_close_device>>;
using PdPtr = std::unique_ptr<ibv_pd, VerbsDeleter<ibv_pd, ibv_dealloc_pd>>;
using CompChannelPtr =
    std::unique_ptr<ibv_comp_channel, VerbsDeleter<ibv_comp_channel, ibv_destroy_comp_channel>>;
using CqPtr = std::unique_ptr<ibv_cq, VerbsDeleter<ibv_cq, ibv_destroy_cq>>;
using QpPtr = std::unique_ptr<ibv_qp, VerbsDeleter<ibv_qp, ibv_destroy_qp>>;
using MrPtr = std::unique_ptr<ibv_mr, VerbsDeleter<ibv_mr, ibv_dereg_mr>>;

// The list from ibv_get_device_list.
struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};
using DeviceListPtr = std::unique_ptr<ibv_device*, DeviceListDeleter>;

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_VERBS_VERBS_HANDLES_H_
