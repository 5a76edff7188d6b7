#include "examples/router/http.h"

#include <algorithm>
#include <cctype>
#include <charconv>

namespace pdlib::router {
namespace {

HttpParseResult Fail(int status, std::string message) {
  HttpParseResult r;
  r.state = HttpParseResult::State::kError;
  r.error_status = status;
  r.error_message = std::move(message);
  return r;
}

// RFC 9110 token characters (method and header names).
bool IsTokenChar(char c) {
  if (std::isalnum(static_cast<unsigned char>(c))) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool IsToken(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), IsTokenChar);
}

std::string_view TrimSpace(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Printable for an error message: at most 64 bytes, control bytes as '?'.
std::string Printable(std::string_view s) {
  std::string out(s.substr(0, 64));
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  return out;
}

}  // namespace

const std::string* HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return &v;
  }
  return nullptr;
}

std::string_view HttpRequest::Path() const {
  std::string_view t = target;
  return t.substr(0, t.find('?'));
}

HttpParseResult ParseHttpRequest(std::string_view data, const HttpLimits& limits) {
  // The header block ends at the first empty line (CRLF CRLF, or bare LF line ends).
  size_t head_end = std::string_view::npos, body_start = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] != '\n') continue;
    if (i + 1 < data.size() && data[i + 1] == '\n') {
      head_end = i + 1;
      body_start = i + 2;
      break;
    }
    if (i + 2 < data.size() && data[i + 1] == '\r' && data[i + 2] == '\n') {
      head_end = i + 1;
      body_start = i + 3;
      break;
    }
  }
  if (head_end == std::string_view::npos) {
    if (data.size() > limits.max_header_bytes) {
      return Fail(431, "request header block is larger than " +
                           std::to_string(limits.max_header_bytes) + " bytes");
    }
    return {};
  }
  if (body_start > limits.max_header_bytes) {
    return Fail(431, "request header block is larger than " +
                         std::to_string(limits.max_header_bytes) + " bytes");
  }

  // Split the header block into lines, dropping the CR of CRLF.
  std::vector<std::string_view> lines;
  std::string_view head = data.substr(0, head_end);
  while (!head.empty()) {
    size_t nl = head.find('\n');
    std::string_view line = head.substr(0, nl);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    head.remove_prefix(nl == std::string_view::npos ? head.size() : nl + 1);
  }
  if (lines.empty() || lines[0].empty()) return Fail(400, "empty request line");

  HttpParseResult result;
  HttpRequest& req = result.request;
  {
    std::string_view line = lines[0];
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos) {
      return Fail(400, "malformed request line '" + Printable(line) +
                           "' (expected METHOD TARGET HTTP/1.1)");
    }
    std::string_view method = line.substr(0, sp1);
    std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    std::string_view version = line.substr(sp2 + 1);
    if (!IsToken(method)) return Fail(400, "malformed method '" + Printable(method) + "'");
    if (target.empty() || target[0] != '/') {
      return Fail(400, "request target '" + Printable(target) + "' must start with '/'");
    }
    for (char c : target) {
      if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
        return Fail(400, "request target contains a control or non-ASCII byte");
      }
    }
    if (version != "HTTP/1.1" && version != "HTTP/1.0") {
      return Fail(505, "unsupported HTTP version '" + Printable(version) + "'");
    }
    req.method = method;
    req.target = target;
    req.version = version;
  }

  bool has_length = false;
  size_t content_length = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    std::string_view line = lines[i];
    if (line.empty()) continue;  // the terminating empty line
    if (line[0] == ' ' || line[0] == '\t') {
      return Fail(400, "obsolete header line folding is not supported");
    }
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) {
      return Fail(400, "malformed header line '" + Printable(line) + "' (no ':')");
    }
    std::string_view name = line.substr(0, colon);
    if (!IsToken(name)) return Fail(400, "malformed header name '" + Printable(name) + "'");
    std::string_view value = TrimSpace(line.substr(colon + 1));
    for (char c : value) {
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f) {
        return Fail(400, "header '" + Printable(name) + "' contains a control byte");
      }
    }
    std::string lname = Lower(name);
    if (lname == "content-length") {
      size_t n = 0;
      auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
      if (value.empty() || ec != std::errc() || ptr != value.data() + value.size()) {
        return Fail(400, "malformed Content-Length '" + Printable(value) + "'");
      }
      if (has_length && n != content_length) return Fail(400, "conflicting Content-Length headers");
      has_length = true;
      content_length = n;
    } else if (lname == "transfer-encoding") {
      return Fail(501,
                  "Transfer-Encoding (chunked request bodies) is not supported; send the "
                  "body with a Content-Length");
    } else if (lname == "expect") {
      if (Lower(value) != "100-continue") {
        return Fail(417, "unsupported Expect '" + Printable(value) + "'");
      }
      req.expect_continue = true;
    }
    req.headers.emplace_back(std::move(lname), std::string(value));
  }

  if (content_length > limits.max_body_bytes) {
    return Fail(413, "request body of " + std::to_string(content_length) +
                         " bytes is larger than the limit of " +
                         std::to_string(limits.max_body_bytes) + " bytes");
  }
  result.headers_done = true;
  if (data.size() - body_start < content_length) return result;  // kIncomplete
  req.body = data.substr(body_start, content_length);
  result.state = HttpParseResult::State::kComplete;
  return result;
}

std::string_view HttpReason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

std::string FormatHttpStreamHead(int status, std::string_view content_type) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + std::string(HttpReason(status)) +
                    "\r\nContent-Type: " + std::string(content_type) +
                    "\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
  return out;
}

std::string FormatHttpResponse(int status, std::string_view content_type, std::string_view body) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + std::string(HttpReason(status)) +
                    "\r\nContent-Type: " + std::string(content_type) +
                    "\r\nContent-Length: " + std::to_string(body.size()) +
                    "\r\nConnection: close\r\n\r\n";
  out += body;
  return out;
}

}  // namespace pdlib::router
