#include "examples/router/completions.h"

#include <optional>
#include <vector>

#include "examples/router/tokenizer.h"
#include "kernels/src/json.h"

namespace pdlib::router {
namespace {

using nlohmann::json;
// Responses keep their fields in the order written (id, object, created, model, choices, ...).
using Object = nlohmann::ordered_json;

constexpr std::string_view kModel = "pdlib-example";

Status BadField(std::string_view field, std::string_view what) {
  return Status::InvalidArgument("'" + std::string(field) + "' " + std::string(what));
}

// One line of JSON that is valid UTF-8 whatever bytes the strings hold: byte-level output can
// split a character, and such bytes become U+FFFD (`output_ids` stays exact).
std::string Dump(const Object& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

Object Completion(uint64_t room, int64_t created) {
  return Object{{"id", "cmpl-" + std::to_string(room)},
                {"object", "text_completion"},
                {"created", created},
                {"model", kModel}};
}

void AddChoices(Object* o, std::string_view text, const char* finish_reason) {
  Object choice{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (finish_reason != nullptr) choice["finish_reason"] = finish_reason;
  (*o)["choices"] = Object::array({std::move(choice)});
}

void AddUsageAndPdlib(Object* o, const RequestResult& r) {
  const auto completion = static_cast<int64_t>(r.output_ids.size());
  (*o)["usage"] = Object{{"prompt_tokens", r.prompt_tokens},
                         {"completion_tokens", completion},
                         {"total_tokens", r.prompt_tokens + completion}};
  (*o)["pdlib"] = Object{{"room", r.room},
                         {"ttft_us", r.ttft_us},
                         {"latency_us", r.latency_us},
                         {"transfer_us", r.transfer_us},
                         {"exposed_transfer_us", r.exposed_transfer_us},
                         {"kv_bytes", r.kv_bytes},
                         {"prefill", r.prefill_host},
                         {"decode", r.decode_host},
                         {"output_ids", r.output_ids}};
}

// The member `key` of an object, or nullptr when absent or null (null means "not given").
const json* Given(const json& object, const char* key) {
  auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

}  // namespace

StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body,
                                                   int32_t default_max_new_tokens) {
  StatusOr<json> parsed = pdlib::json::ParseStrict(body);
  if (!parsed.ok()) return parsed.status();
  const json& root = *parsed;
  if (!root.is_object()) {
    return Status::InvalidArgument("the request body must be a JSON object, not " +
                                   std::string(root.type_name()));
  }
  CompletionRequest out;

  const json* prompt = Given(root, "prompt");
  std::vector<int32_t> ids;
  std::string text;
  if (prompt == nullptr) {
    return BadField("prompt", "is missing");
  } else if (prompt->is_string()) {
    text = prompt->get<std::string>();
    if (text.empty()) return BadField("prompt", "is empty");
  } else if (prompt->is_array()) {
    if (prompt->empty()) return BadField("prompt", "is an empty array");
    for (size_t i = 0; i < prompt->size(); ++i) {
      const json& v = (*prompt)[i];
      if (v.is_string() || v.is_array()) {
        return BadField("prompt", "holds several prompts; batched prompts are not supported");
      }
      const std::optional<int64_t> id = pdlib::json::AsInt64(v);
      if (!id || *id < 0 || *id > INT32_MAX) {
        return BadField("prompt", "element " + std::to_string(i) +
                                      " is not a token id (an integer in [0, 2147483647])");
      }
      ids.push_back(static_cast<int32_t>(*id));
    }
  } else {
    return BadField("prompt", "must be a string or an array of token ids, not " +
                                  std::string(prompt->type_name()));
  }

  int64_t max_tokens = 0;  // the router's default
  if (const json* v = Given(root, "max_tokens")) {
    const std::optional<int64_t> n = pdlib::json::AsInt64(*v);
    if (!n || *n < 1 || *n > INT32_MAX) {
      return BadField("max_tokens", "must be an integer in [1, 2147483647]");
    }
    max_tokens = *n;
  }
  if (const json* v = Given(root, "stream")) {
    if (!v->is_boolean()) return BadField("stream", "must be true or false");
    out.stream = v->get<bool>();
  }
  if (const json* v = Given(root, "n")) {
    if (pdlib::json::AsInt64(*v) != 1) {
      return BadField("n", "must be 1 (one completion per request)");
    }
  }

  StatusOr<RouterRequest> request =
      MakeRouterRequest(ids, text, max_tokens, default_max_new_tokens);
  if (!request.ok()) return request.status();
  out.request = *std::move(request);
  return out;
}

std::string_view FinishReason(const RequestResult& result) {
  return static_cast<int64_t>(result.output_ids.size()) >= result.max_new_tokens ? "length"
                                                                                 : "stop";
}

std::string FormatCompletion(const RequestResult& result, int64_t created) {
  Object o = Completion(result.room, created);
  AddChoices(&o, Detokenize(result.output_ids), FinishReason(result).data());
  AddUsageAndPdlib(&o, result);
  return Dump(o);
}

std::string FormatCompletionChunk(uint64_t room, int64_t created, std::string_view text) {
  Object o = Completion(room, created);
  AddChoices(&o, text, nullptr);
  return "data: " + Dump(o) + "\n\n";
}

std::string FormatCompletionLastChunk(const RequestResult& result, int64_t created,
                                      std::string_view text) {
  Object o = Completion(result.room, created);
  AddChoices(&o, text, FinishReason(result).data());
  AddUsageAndPdlib(&o, result);
  return "data: " + Dump(o) + "\n\ndata: [DONE]\n\n";
}

int HttpStatusFor(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: return 400;
    case StatusCode::kResourceExhausted: return 429;
    case StatusCode::kUnavailable:
    case StatusCode::kCancelled: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    default: return 502;
  }
}

std::string FormatError(const Status& status, const RequestResult* result) {
  Object error{
      {"message", status.message()},
      {"type", HttpStatusFor(status.code()) == 400 ? "invalid_request_error" : "server_error"},
      {"code", StatusCodeName(status.code())}};
  if (result != nullptr && result->room != 0) {
    error["pdlib"] = Object{{"room", result->room},
                            {"prefill", result->prefill_host},
                            {"decode", result->decode_host},
                            {"completion_tokens", static_cast<int64_t>(result->output_ids.size())}};
  }
  return Dump(Object{{"error", std::move(error)}});
}

}  // namespace pdlib::router
