#include "examples/router/request.h"

#include <cstdint>

#include "examples/router/tokenizer.h"

namespace pdlib::router {

StatusOr<RouterRequest> MakeRouterRequest(std::span<const int32_t> prompt_ids,
                                          std::string_view prompt, int64_t max_new_tokens,
                                          int32_t default_max_new_tokens) {
  RouterRequest request;
  if (!prompt_ids.empty()) {
    for (size_t i = 0; i < prompt_ids.size(); ++i) {
      if (prompt_ids[i] < 0) {
        return Status::InvalidArgument("prompt token " + std::to_string(i) + " is " +
                                       std::to_string(prompt_ids[i]) + "; token ids must be >= 0");
      }
    }
    request.prompt_ids.assign(prompt_ids.begin(), prompt_ids.end());
  } else if (!prompt.empty()) {
    request.prompt_ids = Tokenize(prompt);
  } else {
    return Status::InvalidArgument("empty prompt: send prompt text or prompt token ids");
  }
  if (max_new_tokens < 0) {
    return Status::InvalidArgument("max_new_tokens is " + std::to_string(max_new_tokens) +
                                   "; it must be >= 1 (or 0 for the router's default, " +
                                   std::to_string(default_max_new_tokens) + ")");
  }
  if (max_new_tokens > INT32_MAX) {
    return Status::InvalidArgument("max_new_tokens " + std::to_string(max_new_tokens) +
                                   " is too large");
  }
  request.max_new_tokens =
      max_new_tokens == 0 ? default_max_new_tokens : static_cast<int32_t>(max_new_tokens);
  return request;
}

}  // namespace pdlib::router
