// What the router's front ends (gRPC service Router, HTTP /v1/completions) hand to its core and
// get back: the validated request and the outcome of one request. Plain values.
#ifndef PDLIB_EXAMPLES_ROUTER_REQUEST_H_
#define PDLIB_EXAMPLES_ROUTER_REQUEST_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::router {

// A request as the router dispatches it.
struct RouterRequest {
  std::vector<int32_t> prompt_ids;
  int32_t max_new_tokens = 0;
};

// Validates and tokenizes (tokenizer.h): `prompt_ids` when not empty, else `prompt`;
// max_new_tokens 0 means `default_max_new_tokens`. Errors are INVALID_ARGUMENT with a message
// for the client.
StatusOr<RouterRequest> MakeRouterRequest(std::span<const int32_t> prompt_ids,
                                          std::string_view prompt, int64_t max_new_tokens,
                                          int32_t default_max_new_tokens);

// How one request ended (mirrors GenerateResult in examples/proto/pd_serving.proto).
struct RequestResult {
  // OK, or why the request failed; the message names the failing host and its reason.
  Status status;
  uint64_t room = 0;         // 0 when the request was never dispatched
  std::string prefill_host;  // host:port of the picked hosts
  std::string decode_host;
  std::vector<int32_t> output_ids;  // every token sent to the client
  int64_t ttft_us = 0;              // request received until the first token was sent on (0: none)
  int64_t latency_us = 0;           // request received until the last token (or the failure)
  int64_t transfer_us = 0;          // from decode's HostResult
  // From prefill's HostResult (after its last forward); 0 when that result came later than
  // settle_time after decode finished (the router does not wait longer for a statistic).
  int64_t exposed_transfer_us = 0;
  uint64_t kv_bytes = 0;  // from prefill's HostResult
  int32_t prompt_tokens = 0;
  int32_t max_new_tokens = 0;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_REQUEST_H_
