// The harness of pd-router's end-to-end tests. Fake prefill and decode hosts: service Host of
// pd_serving.proto on 127.0.0.1 with behaviour scripted by the prompt's first bytes, so that one
// deployment serves ordinary, failing and hanging requests side by side:
//   (default)  prefill: result ok (first token, kv_bytes = 100 per prompt token);
//              decode: streams ExpectedTokens(), then its result (transfer_us 7)
//   "PFAIL"    prefill: result not ok (RESOURCE_EXHAUSTED); decode waits for KV forever
//   "PHANG"    prefill and decode never answer
//   "PNORES"   prefill ends its stream without a result; decode waits forever
//   "DFAIL"    prefill ok; decode streams 2 tokens, then a result that is not ok (ABORTED)
//   "NOSTREAM" decode sends no token events, only the result with every output id
//   "BIG"      decode's tokens are ids >= 256
// Hosts that wait forever end when the router cancels the RPC (or its deadline passes).
//
// Deployment: fakes plus a Router over them, with test-friendly options. Clients:
// GenerateOverGrpc (Router.Generate) and HttpExchange (one raw HTTP exchange on a socket).
#ifndef PDLIB_TEST_EXAMPLES_ROUTER_TEST_HARNESS_H_
#define PDLIB_TEST_EXAMPLES_ROUTER_TEST_HARNESS_H_

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "examples/proto/pd_serving.grpc.pb.h"
#include "examples/router/router.h"
#include "lib/base/tsan.h"
#include "lib/control/grpc_runtime.h"

namespace pdlib::router::testing {

namespace pb = ::pdlib::serving;

inline std::string PromptText(const pb::HostGenerateRequest& r) {
  std::string s;
  for (int32_t id : r.prompt_ids()) s.push_back(static_cast<char>(id & 0xff));
  return s;
}

inline bool Starts(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// What the fake decode generates for a prompt: printable bytes, or ids >= 256 for "BIG".
inline std::vector<int32_t> ExpectedTokens(std::string_view prompt, int32_t max_new_tokens) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < max_new_tokens; ++i) {
    const int32_t base = static_cast<unsigned char>(prompt[static_cast<size_t>(i) % prompt.size()]);
    out.push_back(Starts(prompt, "BIG") ? 1000 + i : 'a' + (base + i) % 26);
  }
  return out;
}

class FakeHost;

// One Generate call.
class FakeGenerate final : public grpc::ServerWriteReactor<pb::HostEvent> {
 public:
  FakeGenerate(FakeHost* host, const pb::HostGenerateRequest& request);
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  void Next();
  FakeHost* const host_;
  std::mutex mu_;
  std::vector<pb::HostEvent> events_;  // guarded by mu_
  size_t next_ = 0;                    // guarded by mu_
  bool hang_ = false;                  // after the events, wait for the cancel
  bool writing_ = false;               // guarded by mu_
  bool finished_ = false;              // guarded by mu_
  bool cancelled_ = false;             // guarded by mu_
};

class FakeHost final : public pb::Host::CallbackService {
 public:
  // Listens on `address` (default: a free port on 127.0.0.1).
  FakeHost(std::string role, uint32_t bootstrap_port, const std::string& address = "127.0.0.1:0")
      : role_(std::move(role)), bootstrap_port_(bootstrap_port) {
    control::KeepCallbackQueueAlive();
    grpc::ServerBuilder builder;
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeHost() override { Kill(); }

  // Stops serving at once (as if the process died): open calls are cancelled.
  void Kill() {
    std::lock_guard<std::mutex> lock(kill_mu_);
    if (!server_) return;
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    PdlibTsanAcquire(this);
    server_.reset();
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  const std::string& role() const { return role_; }
  void set_queued(int32_t queued) { queued_.store(queued); }

  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* ctx, const pb::LoadRequest*,
                                    pb::LoadReply* reply) override {
    reply->set_role(role_);
    reply->set_tp_size(1);
    reply->set_pp_size(1);
    reply->set_running(0);
    reply->set_queued(queued_.load());
    if (role_ == "prefill") {
      reply->set_bootstrap_host("127.0.0.1");
      reply->set_bootstrap_port(bootstrap_port_);
    }
    reply->set_dp_size(1);
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    PdlibTsanRelease(this);  // pairs with the acquire in Kill()
    return reactor;
  }

  grpc::ServerWriteReactor<pb::HostEvent>* Generate(
      grpc::CallbackServerContext*, const pb::HostGenerateRequest* request) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(*request);
    }
    PdlibTsanRelease(this);  // pairs with the acquire in Kill()
    return new FakeGenerate(this, *request);
  }

  std::vector<pb::HostGenerateRequest> requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  std::atomic<int> cancelled{0};  // Generate calls that ended by cancellation
  std::atomic<int> open{0};       // Generate calls not yet done

  void CallDone() { PdlibTsanRelease(this); }

 private:
  const std::string role_;
  const uint32_t bootstrap_port_;
  int port_ = 0;
  std::atomic<int32_t> queued_{0};
  std::mutex kill_mu_;
  std::unique_ptr<grpc::Server> server_;
  std::mutex mu_;
  std::vector<pb::HostGenerateRequest> requests_;
};

inline FakeGenerate::FakeGenerate(FakeHost* host, const pb::HostGenerateRequest& request)
    : host_(host) {
  host_->open.fetch_add(1);
  const std::string prompt = PromptText(request);
  const bool prefill = host->role() == "prefill";
  const std::vector<int32_t> tokens = ExpectedTokens(prompt, request.max_new_tokens());
  auto result = [&](bool ok) {
    pb::HostEvent e;
    pb::HostResult* r = e.mutable_result();
    r->set_ok(ok);
    if (prefill) {
      r->add_output_ids(tokens.at(0));
      r->set_kv_bytes(100 * static_cast<uint64_t>(request.prompt_ids_size()));
      r->set_first_token_us(1);
    } else {
      r->mutable_output_ids()->Add(tokens.begin(), tokens.end());
      r->set_transfer_us(7);
    }
    return e;
  };
  auto token = [&](int32_t i) {
    pb::HostEvent e;
    e.mutable_token()->set_token_id(tokens.at(static_cast<size_t>(i)));
    e.mutable_token()->set_index(i);
    return e;
  };
  if (prefill) {
    if (Starts(prompt, "PFAIL")) {
      pb::HostEvent e;
      e.mutable_result()->set_ok(false);
      e.mutable_result()->set_code(8);  // RESOURCE_EXHAUSTED
      e.mutable_result()->set_reason("fake prefill: no KV pages for this prompt");
      events_.push_back(e);
    } else if (Starts(prompt, "PHANG")) {
      hang_ = true;
    } else if (!Starts(prompt, "PNORES")) {
      events_.push_back(result(true));
    }
  } else {
    if (Starts(prompt, "PFAIL") || Starts(prompt, "PHANG") || Starts(prompt, "PNORES")) {
      hang_ = true;  // the KV never comes
    } else if (Starts(prompt, "DFAIL")) {
      events_.push_back(token(0));
      events_.push_back(token(1));
      pb::HostEvent e;
      e.mutable_result()->set_ok(false);
      e.mutable_result()->set_code(10);  // ABORTED
      e.mutable_result()->set_reason("fake decode: KV transfer aborted");
      events_.push_back(e);
    } else {
      if (!Starts(prompt, "NOSTREAM")) {
        for (int32_t i = 0; i < request.max_new_tokens(); ++i) events_.push_back(token(i));
      }
      events_.push_back(result(true));
    }
  }
  PdlibTsanRelease(this);
  Next();
}

inline void FakeGenerate::Next() {
  bool write = false, finish = false;
  grpc::Status status = grpc::Status::OK;
  const pb::HostEvent* event = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (writing_ || finished_) return;
    if (cancelled_) {
      finished_ = finish = true;
      status = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    } else if (next_ < events_.size()) {
      event = &events_[next_++];
      writing_ = write = true;
    } else if (!hang_) {
      finished_ = finish = true;
    }
  }
  PdlibTsanRelease(this);
  if (write) StartWrite(event);
  if (finish) Finish(status);
}

inline void FakeGenerate::OnWriteDone(bool ok) {
  PdlibTsanAcquire(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;
  }
  Next();
}

inline void FakeGenerate::OnCancel() {
  PdlibTsanAcquire(this);
  host_->cancelled.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
  }
  Next();
}

inline void FakeGenerate::OnDone() {
  PdlibTsanAcquire(this);
  host_->open.fetch_sub(1);
  host_->CallDone();
  delete this;
}

using Clock = std::chrono::steady_clock;

struct Deployment {
  std::vector<std::unique_ptr<FakeHost>> prefill;
  std::vector<std::unique_ptr<FakeHost>> decode;
  std::unique_ptr<Router> router;

  explicit Deployment(int prefills = 1, int decodes = 1,
                      const std::function<void(RouterOptions*)>& tweak = nullptr) {
    for (int i = 0; i < prefills; ++i)
      prefill.push_back(std::make_unique<FakeHost>("prefill", 40000 + i));
    for (int i = 0; i < decodes; ++i) decode.push_back(std::make_unique<FakeHost>("decode", 0));
    RouterOptions options = Options();
    if (tweak) tweak(&options);
    StatusOr<std::unique_ptr<Router>> r = Router::Start(options);
    if (!r.ok()) FAIL(r.status().ToString());
    router = *std::move(r);
  }

  RouterOptions Options() const {
    RouterOptions o;
    for (const auto& h : prefill) o.prefill_hosts.push_back(h->address());
    for (const auto& h : decode) o.decode_hosts.push_back(h->address());
    o.seed = 1;
    o.default_max_new_tokens = 6;
    o.request_timeout = std::chrono::milliseconds(10000);
    o.settle_time = std::chrono::milliseconds(1000);  // generous: TSan runs are slow
    o.startup_timeout = std::chrono::milliseconds(10000);
    o.load_poll_interval = std::chrono::milliseconds(100);
    return o;
  }

  std::string grpc_target() const { return "127.0.0.1:" + std::to_string(router->grpc_port()); }
};

struct GrpcOutcome {
  grpc::Status status;
  std::vector<pb::HostToken> tokens;
  bool has_result = false;
  pb::GenerateResult result;
};

inline GrpcOutcome GenerateOverGrpc(const std::string& target, const pb::GenerateRequest& request,
                                    grpc::ClientContext* ctx = nullptr) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = pb::Router::NewStub(channel);
  grpc::ClientContext own;
  if (ctx == nullptr) ctx = &own;
  GrpcOutcome out;
  auto reader = stub->Generate(ctx, request);
  pb::GenerateEvent event;
  while (reader->Read(&event)) {
    if (event.has_token()) {
      REQUIRE_FALSE(out.has_result);  // no token after the result
      out.tokens.push_back(event.token());
    } else if (event.has_result()) {
      out.has_result = true;
      out.result = event.result();
    }
  }
  out.status = reader->Finish();
  return out;
}

inline pb::GenerateRequest TextRequest(const std::string& prompt, int32_t max_new_tokens = 0) {
  pb::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  return r;
}

inline std::vector<int32_t> Ids(const google::protobuf::RepeatedField<int32_t>& f) {
  return {f.begin(), f.end()};
}

inline bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

template <typename Cond>
bool WaitFor(Cond cond, std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  const auto deadline = Clock::now() + timeout;
  while (!cond()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

struct HttpReply {
  int status = 0;
  std::string head;
  std::string body;
  bool chunked = false;  // Transfer-Encoding: chunked; `body` is the data of its chunks
  int chunks = 0;        // with `chunked`: how many, the last (empty) one included
};

inline int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

// Reads from `fd` until `data` holds at least `n` bytes or the peer closes; false if it closed.
inline bool ReadAtLeast(int fd, std::string* data, size_t n) {
  char buf[4096];
  while (data->size() < n) {
    const ssize_t got = ::recv(fd, buf, sizeof(buf), 0);
    if (got <= 0) return false;
    data->append(buf, static_cast<size_t>(got));
  }
  return true;
}

// Reads from `fd` until `data` contains `needle`; its position, or npos if the peer closed.
inline size_t ReadUntil(int fd, std::string* data, std::string_view needle, size_t from = 0) {
  while (true) {
    const size_t at = data->find(needle, from);
    if (at != std::string::npos) return at;
    if (!ReadAtLeast(fd, data, data->size() + 1)) return std::string::npos;
  }
}

// Sends `raw` to 127.0.0.1:port and reads one response: its head, and its body by
// Content-Length, by chunks (de-chunked into `body`, `chunked` set) or until the server closes.
// The server keeps connections alive, so the end of the response is not the end of the stream.
inline HttpReply HttpExchange(int port, const std::string& raw) {
  const int fd = Connect(port);
  size_t sent = 0;
  while (sent < raw.size()) {
    const ssize_t n = ::send(fd, raw.data() + sent, raw.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer (413) and close before reading everything
    sent += static_cast<size_t>(n);
  }
  HttpReply reply;
  std::string data;
  const size_t end = ReadUntil(fd, &data, "\r\n\r\n");
  if (end == std::string::npos) {
    ::close(fd);
    return reply;
  }
  reply.head = data.substr(0, end);
  data.erase(0, end + 4);
  if (reply.head.rfind("HTTP/1.1 ", 0) == 0) reply.status = std::stoi(reply.head.substr(9, 3));
  std::string lower = reply.head;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
    reply.chunked = true;
    while (true) {  // size line, data, CRLF; a size of 0 ends the body
      const size_t line_end = ReadUntil(fd, &data, "\r\n");
      REQUIRE(line_end != std::string::npos);
      const size_t size = std::stoul(data.substr(0, line_end), nullptr, 16);
      REQUIRE(ReadAtLeast(fd, &data, line_end + 2 + size + 2));
      REQUIRE(data.substr(line_end + 2 + size, 2) == "\r\n");
      reply.body += data.substr(line_end + 2, size);
      ++reply.chunks;
      data.erase(0, line_end + 2 + size + 2);
      if (size == 0) break;
    }
  } else if (const size_t at = lower.find("\r\ncontent-length: "); at != std::string::npos) {
    const size_t length = std::stoul(lower.substr(at + 18));
    ReadAtLeast(fd, &data, length);
    reply.body = data.substr(0, length);
  } else {
    ReadAtLeast(fd, &data, SIZE_MAX);
    reply.body = data;
  }
  ::close(fd);
  return reply;
}

inline std::string Post(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

}  // namespace pdlib::router::testing

#endif  // PDLIB_TEST_EXAMPLES_ROUTER_TEST_HARNESS_H_
