#include "examples/router/completions.h"

#include <vector>

#include "examples/router/json.h"
#include "examples/router/tokenizer.h"

namespace pdlib::router {
namespace {

constexpr std::string_view kModel = "pdlib-example";

Status BadField(std::string_view field, std::string_view what) {
  return Status::InvalidArgument("'" + std::string(field) + "' " + std::string(what));
}

void BeginCompletion(JsonWriter* w, uint64_t room, int64_t created) {
  w->BeginObject()
      .Key("id")
      .String("cmpl-" + std::to_string(room))
      .Key("object")
      .String("text_completion")
      .Key("created")
      .Int(created)
      .Key("model")
      .String(kModel);
}

void WriteChoices(JsonWriter* w, std::string_view text, const char* finish_reason) {
  w->Key("choices").BeginArray().BeginObject();
  w->Key("index").Int(0).Key("text").String(text).Key("logprobs").Null().Key("finish_reason");
  if (finish_reason != nullptr) {
    w->String(finish_reason);
  } else {
    w->Null();
  }
  w->EndObject().EndArray();
}

void WriteUsageAndPdlib(JsonWriter* w, const RequestResult& r) {
  const auto completion = static_cast<int64_t>(r.output_ids.size());
  w->Key("usage")
      .BeginObject()
      .Key("prompt_tokens")
      .Int(r.prompt_tokens)
      .Key("completion_tokens")
      .Int(completion)
      .Key("total_tokens")
      .Int(r.prompt_tokens + completion)
      .EndObject();
  w->Key("pdlib")
      .BeginObject()
      .Key("room")
      .Uint(r.room)
      .Key("ttft_us")
      .Int(r.ttft_us)
      .Key("latency_us")
      .Int(r.latency_us)
      .Key("transfer_us")
      .Int(r.transfer_us)
      .Key("kv_bytes")
      .Uint(r.kv_bytes)
      .Key("prefill")
      .String(r.prefill_host)
      .Key("decode")
      .String(r.decode_host)
      .Key("output_ids")
      .BeginArray();
  for (int32_t id : r.output_ids) w->Int(id);
  w->EndArray().EndObject();
}

}  // namespace

StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body,
                                                   int32_t default_max_new_tokens) {
  StatusOr<JsonValue> parsed = ParseJson(body);
  if (!parsed.ok()) return parsed.status();
  const JsonValue& root = *parsed;
  if (root.type != JsonValue::Type::kObject) {
    return Status::InvalidArgument("the request body must be a JSON object, not " +
                                   std::string(JsonTypeName(root.type)));
  }
  CompletionRequest out;

  const JsonValue* prompt = root.Find("prompt");
  std::vector<int32_t> ids;
  std::string text;
  if (prompt == nullptr || prompt->type == JsonValue::Type::kNull) {
    return BadField("prompt", "is missing");
  } else if (prompt->type == JsonValue::Type::kString) {
    if (prompt->string.empty()) return BadField("prompt", "is empty");
    text = prompt->string;
  } else if (prompt->type == JsonValue::Type::kArray) {
    if (prompt->items.empty()) return BadField("prompt", "is an empty array");
    for (size_t i = 0; i < prompt->items.size(); ++i) {
      const JsonValue& v = prompt->items[i];
      if (v.type == JsonValue::Type::kString || v.type == JsonValue::Type::kArray) {
        return BadField("prompt", "holds several prompts; batched prompts are not supported");
      }
      if (v.type != JsonValue::Type::kNumber || !v.is_int || v.int_value < 0 ||
          v.int_value > INT32_MAX) {
        return BadField("prompt", "element " + std::to_string(i) +
                                      " is not a token id (an integer in [0, 2147483647])");
      }
      ids.push_back(static_cast<int32_t>(v.int_value));
    }
  } else {
    return BadField("prompt", "must be a string or an array of token ids, not " +
                                  std::string(JsonTypeName(prompt->type)));
  }

  int64_t max_tokens = 0;  // the router's default
  if (const JsonValue* v = root.Find("max_tokens");
      v != nullptr && v->type != JsonValue::Type::kNull) {
    if (v->type != JsonValue::Type::kNumber || !v->is_int || v->int_value < 1 ||
        v->int_value > INT32_MAX) {
      return BadField("max_tokens", "must be an integer in [1, 2147483647]");
    }
    max_tokens = v->int_value;
  }

  if (const JsonValue* v = root.Find("stream"); v != nullptr && v->type != JsonValue::Type::kNull) {
    if (v->type != JsonValue::Type::kBool) return BadField("stream", "must be true or false");
    out.stream = v->boolean;
  }
  if (const JsonValue* v = root.Find("n"); v != nullptr && v->type != JsonValue::Type::kNull) {
    if (v->type != JsonValue::Type::kNumber || !v->is_int || v->int_value != 1) {
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
  JsonWriter w;
  BeginCompletion(&w, result.room, created);
  WriteChoices(&w, Detokenize(result.output_ids), FinishReason(result).data());
  WriteUsageAndPdlib(&w, result);
  w.EndObject();
  return w.str();
}

std::string FormatCompletionChunk(uint64_t room, int64_t created, std::string_view text) {
  JsonWriter w;
  BeginCompletion(&w, room, created);
  WriteChoices(&w, text, nullptr);
  w.EndObject();
  return "data: " + w.str() + "\n\n";
}

std::string FormatCompletionLastChunk(const RequestResult& result, int64_t created,
                                      std::string_view text) {
  JsonWriter w;
  BeginCompletion(&w, result.room, created);
  WriteChoices(&w, text, FinishReason(result).data());
  WriteUsageAndPdlib(&w, result);
  w.EndObject();
  return "data: " + w.str() + "\n\ndata: [DONE]\n\n";
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
  JsonWriter w;
  w.BeginObject().Key("error").BeginObject();
  w.Key("message").String(status.message());
  w.Key("type").String(HttpStatusFor(status.code()) == 400 ? "invalid_request_error"
                                                           : "server_error");
  w.Key("code").String(StatusCodeName(status.code()));
  if (result != nullptr && result->room != 0) {
    w.Key("pdlib")
        .BeginObject()
        .Key("room")
        .Uint(result->room)
        .Key("prefill")
        .String(result->prefill_host)
        .Key("decode")
        .String(result->decode_host)
        .Key("completion_tokens")
        .Int(static_cast<int64_t>(result->output_ids.size()))
        .EndObject();
  }
  w.EndObject().EndObject();
  return w.str();
}

}  // namespace pdlib::router
