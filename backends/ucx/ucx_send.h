// Sending a header (and a payload) that pdlib owns until UCX is done with them: the control
// messages of the "am" data path (close, ack, rail messages) and their echoes.
#ifndef PDLIB_BACKENDS_UCX_UCX_SEND_H_
#define PDLIB_BACKENDS_UCX_UCX_SEND_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace pdlib {
inline namespace v1 {
namespace ucx {

// Sends `header` and `payload` as one active message with id `id`; both are moved to the heap
// and live until UCX completes the send. False when the send failed at once (the peer is gone or
// failed); the callback-free result of a send done at once is true.
template <typename Header>
bool SendOwned(ucp_ep_h ep, unsigned id, const Header& header, std::vector<uint64_t> payload,
               uint32_t flags) {
  struct Message {
    Header header;
    std::vector<uint64_t> payload;
  };
  auto* owned = new Message{header, std::move(payload)};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = flags;
  param.cb.send = [](void* request, ucs_status_t, void* user_data) {
    delete static_cast<Message*>(user_data);
    ucp_request_free(request);
  };
  param.user_data = owned;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep, id, &owned->header, sizeof(Header), owned->payload.data(),
                      owned->payload.size() * sizeof(uint64_t), &param);
  if (UCS_PTR_IS_PTR(request)) return true;
  delete owned;
  return UCS_PTR_STATUS(request) == UCS_OK;
}

// A header-only eager message.
template <typename Header>
bool SendHeaderOnly(ucp_ep_h ep, unsigned id, const Header& header, uint32_t flags) {
  return SendOwned(ep, id, header, {}, flags);
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_SEND_H_
