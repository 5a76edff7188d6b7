#include "examples/router/http_server.h"

#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

namespace pdlib::router {
namespace {

using Clock = std::chrono::steady_clock;

std::string ErrorBody(std::string_view message) {
  const nlohmann::json body = {
      {"error", {{"message", message}, {"type", "invalid_request_error"}}}};
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

int ToPollMs(std::chrono::milliseconds d) {
  return static_cast<int>(std::clamp<int64_t>(d.count(), 0, 1 << 30));
}

// Polls `fd` for `events` and the shutdown eventfd. 1: ready, 0: timed out, -1: shutting down
// or an error.
int WaitFd(int fd, short events, int wake_fd, int timeout_ms) {
  pollfd p[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    const int n = ::poll(p, 2, timeout_ms);
    if (n < 0 && errno == EINTR) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0,
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
      continue;
    }
    if (n < 0 || (p[1].revents & POLLIN)) return -1;
    if (n == 0) return 0;
    return 1;  // ready, or POLLHUP/POLLERR, which the next recv/send reports
  }
}

// The connection a pool thread is serving: what the handler, the checks before routing and the
// error handler need to know about it, since httplib hands them only the request.
struct Connection {
  int fd = -1;
  int wake_fd = -1;
  bool close_after = false;  // the response was sent before the whole request was read
  bool too_large = false;    // the request outgrew max_header_bytes + max_body_bytes
};
thread_local Connection* t_connection = nullptr;
// Set on the accept thread while it answers a connection the pool has no thread for.
thread_local bool t_reject = false;

bool ConnectionGone() {
  Connection* c = t_connection;
  if (c == nullptr) return true;
  pollfd p[2] = {{c->fd, POLLIN | POLLRDHUP, 0}, {c->wake_fd, POLLIN, 0}};
  if (::poll(p, 2, 0) <= 0) return false;
  if (p[1].revents & POLLIN) return true;  // shutting down
  // A client that half-closes after its request also counts as gone (curl does not).
  if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  if (p[0].revents & POLLIN) {
    char c1;  // a pipelined next request is not a departure
    if (::recv(c->fd, &c1, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return true;
  }
  return false;
}

// httplib's view of one connection's socket: buffered reads (its line reader reads a byte at a
// time), timeouts that also end at shutdown, and a byte budget per request.
class SocketStream final : public httplib::Stream {
 public:
  SocketStream(Connection* c, const HttpServerOptions& o)
      : c_(c),
        read_ms_(ToPollMs(o.read_timeout)),
        write_ms_(ToPollMs(o.write_timeout)),
        budget_(o.max_header_bytes + o.max_body_bytes) {}

  void StartRequest() { consumed_ = 0; }
  bool Buffered() const { return off_ < len_; }

  bool is_readable() const override {
    return Buffered() || WaitFd(c_->fd, POLLIN, c_->wake_fd, read_ms_) == 1;
  }
  bool is_writable() const override { return WaitFd(c_->fd, POLLOUT, c_->wake_fd, write_ms_) == 1; }

  ssize_t read(char* ptr, size_t size) override {
    if (!Buffered()) {
      if (WaitFd(c_->fd, POLLIN, c_->wake_fd, read_ms_) != 1) return -1;
      const ssize_t n = ::recv(c_->fd, buf_, sizeof(buf_), 0);
      if (n <= 0) return n;
      off_ = 0;
      len_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, len_ - off_);
    consumed_ += n;
    if (consumed_ > budget_) {
      c_->too_large = true;
      return -1;
    }
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    while (true) {
      const ssize_t n = ::send(c_->fd, ptr, size, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0 || errno == EINTR) {
        if (n >= 0) return n;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
      if (WaitFd(c_->fd, POLLOUT, c_->wake_fd, write_ms_) != 1) return -1;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(&::getpeername, &ip, &port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(&::getsockname, &ip, &port);
  }
  int socket() const override { return c_->fd; }

 private:
  void AddressOf(int (*get)(int, sockaddr*, socklen_t*), std::string* ip, int* port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    char host[64] = "";
    *port = -1;
    if (get(c_->fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    if (addr.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      *port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      *port = ntohs(a->sin6_port);
    }
    *ip = host;
  }

  Connection* const c_;
  const int read_ms_;
  const int write_ms_;
  const size_t budget_;
  size_t consumed_ = 0;
  char buf_[16384];
  size_t off_ = 0, len_ = 0;
};

// Half-closes, then reads what the client still sends for a short while before closing, so
// that a response sent before the whole request was read (413) is not lost to a reset.
void CloseGracefully(int fd) {
  ::shutdown(fd, SHUT_WR);
  const auto deadline = Clock::now() + std::chrono::milliseconds(200);
  char buf[4096];
  size_t drained = 0;
  while (drained < (1 << 20)) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
  ::close(fd);
}

// The pool: `size` threads, one per connection served. A connection beyond that is answered
// 503 on the accept thread (t_reject) rather than queued behind keep-alive connections that may
// stay for minutes.
class BoundedPool final : public httplib::TaskQueue {
 public:
  explicit BoundedPool(int size) : size_(size), pool_(static_cast<size_t>(size)) {}
  void enqueue(std::function<void()> fn) override {
    // Relaxed: the count only admits or turns away; the pool's own lock orders the work.
    if (busy_.load(std::memory_order_relaxed) >= size_) {
      t_reject = true;
      fn();
      t_reject = false;
      return;
    }
    busy_.fetch_add(1, std::memory_order_relaxed);
    pool_.enqueue([this, fn = std::move(fn)] {
      fn();
      busy_.fetch_sub(1, std::memory_order_relaxed);
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  const int size_;
  std::atomic<int> busy_{0};
  httplib::ThreadPool pool_;
};

class Responder final : public HttpResponder {
 public:
  explicit Responder(httplib::Response* res) : res_(res) {}
  void Respond(int status, std::string_view content_type, std::string body) override {
    res_->status = status;
    res_->body = std::move(body);
    res_->set_header("Content-Type", std::string(content_type));
  }
  void Stream(std::string_view content_type, std::function<void(HttpStream*)> producer) override {
    res_->status = 200;
    res_->set_header("Cache-Control", "no-cache");
    res_->set_chunked_content_provider(
        std::string(content_type),
        [producer = std::move(producer)](size_t /*offset*/, httplib::DataSink& sink) {
          class SinkStream final : public HttpStream {
           public:
            explicit SinkStream(httplib::DataSink* sink) : sink_(sink) {}
            bool Write(std::string_view data) override {
              if (broken_ || data.empty()) return !broken_;
              broken_ = !sink_->write(data.data(), data.size());
              return !broken_;
            }
            bool Gone() override { return broken_ || ConnectionGone(); }
            bool broken() const { return broken_; }

           private:
            httplib::DataSink* const sink_;
            bool broken_ = false;
          } stream(&sink);
          producer(&stream);
          if (stream.broken()) return false;  // httplib closes the connection
          sink.done();
          return true;
        });
  }
  bool Gone() override { return ConnectionGone(); }

 private:
  httplib::Response* const res_;
};

}  // namespace

struct HttpServer::Rep {
  // httplib::Server with the connection loop of our own (process_and_close_socket is the
  // library's hook for it, as its TLS server uses): the keep-alive wait ends at shutdown, and
  // the Connection is known to the thread that serves it.
  class Server final : public httplib::Server {
   public:
    explicit Server(Rep* rep) : rep_(rep) {}
    int listen_fd() const { return svr_sock_; }

   private:
    bool process_and_close_socket(int sock) override {
      Connection conn{.fd = sock, .wake_fd = rep_->wake_fd};
      SocketStream stream(&conn, rep_->options);
      if (t_reject) {
        const std::string body =
            ErrorBody("too many connections (limit " +
                      std::to_string(rep_->options.max_connections) + "); retry later");
        const std::string response =
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            "Content-Length: " +
            std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
        ::send(sock, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(sock);
        return true;
      }
      // httplib writes a response's head and body separately: without this, Nagle holds the
      // body back until the client's delayed ACK of the head (40 ms).
      const int one = 1;
      ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      t_connection = &conn;
      const int idle_ms = ToPollMs(rep_->options.keep_alive_timeout);
      bool ok = true;
      while (true) {
        if (!stream.Buffered() && WaitFd(sock, POLLIN, rep_->wake_fd, idle_ms) != 1) break;
        bool closed = false;
        stream.StartRequest();
        ok = process_request(stream, /*close_connection=*/false, closed, {});
        if (!ok || closed || conn.close_after) break;
      }
      t_connection = nullptr;
      if (conn.close_after) {
        CloseGracefully(sock);
      } else {
        ::close(sock);
      }
      return ok;
    }

    Rep* const rep_;
  };

  HttpServerOptions options;
  HttpHandler handler;
  int wake_fd = -1;  // an eventfd, written once at shutdown and never read: stays readable
  int32_t port = 0;
  std::unique_ptr<Server> server;
  std::thread listener;
  std::once_flag shutdown_once;

  ~Rep() {
    if (wake_fd >= 0) ::close(wake_fd);
  }

  // What the headers alone decide, before a body is read: 0 to go on, or an error status with
  // `message`.
  int CheckHead(const httplib::Request& req, std::string* message) const {
    if (req.has_header("Transfer-Encoding")) {
      *message =
          "Transfer-Encoding (chunked request bodies) is not supported; send the body with a "
          "Content-Length";
      return 501;
    }
    if (req.has_header("Expect")) {
      std::string v = req.get_header_value("Expect");
      std::transform(v.begin(), v.end(), v.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (v != "100-continue") {
        *message = "unsupported Expect '" + v.substr(0, 64) + "'";
        return 417;
      }
    }
    const size_t lengths = req.get_header_value_count("Content-Length");
    uint64_t length = 0;
    for (size_t i = 0; i < lengths; ++i) {
      const std::string v = req.get_header_value("Content-Length", i);
      uint64_t n = 0;
      auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
      if (v.empty() || ec != std::errc() || ptr != v.data() + v.size()) {
        *message = "malformed Content-Length '" + v.substr(0, 64) + "'";
        return 400;
      }
      if (i > 0 && n != length) {
        *message = "conflicting Content-Length headers";
        return 400;
      }
      length = n;
    }
    if (length > options.max_body_bytes) {
      *message = "request body of " + std::to_string(length) +
                 " bytes is larger than the limit of " + std::to_string(options.max_body_bytes) +
                 " bytes";
      return 413;
    }
    return 0;
  }

  void Handle(const httplib::Request& req, httplib::Response& res) {
    HttpRequest request{.method = req.method, .path = req.path, .body = req.body};
    Responder responder(&res);
    handler(request, &responder);
    if (res.status == -1) {
      res.status = 500;
      res.set_content(ErrorBody("the handler sent no response"), "application/json");
    }
  }

  void Configure() {
    Server& s = *server;
    s.new_task_queue = [this] { return new BoundedPool(options.max_connections); };
    s.set_payload_max_length(options.max_body_bytes);
    s.set_expect_100_continue_handler([this](const httplib::Request& req, httplib::Response& res) {
      std::string message;
      const int status = CheckHead(req, &message);
      if (status == 0) return 100;
      res.status = status;
      res.set_content(ErrorBody(message), "application/json");
      res.set_header("Connection", "close");
      if (t_connection != nullptr) t_connection->close_after = true;
      return status;
    });
    s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      std::string message;
      const int status = CheckHead(req, &message);
      if (status != 0) {
        res.status = status;
        res.set_content(ErrorBody(message), "application/json");
        res.set_header("Connection", "close");
        if (t_connection != nullptr) t_connection->close_after = true;
        return httplib::Server::HandlerResponse::Handled;
      }
      if (req.method == "POST" && !req.has_header("Content-Length")) {
        // No body (httplib would read one until the connection closes).
        Handle(req, res);
        return httplib::Server::HandlerResponse::Handled;
      }
      if (req.method != "POST" && req.method != "PUT" && req.method != "PATCH" &&
          req.method != "DELETE" && req.has_header("Content-Length") &&
          req.get_header_value("Content-Length") != "0" && t_connection != nullptr) {
        t_connection->close_after = true;  // a body httplib will not read for this method
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    auto handle = [this](const httplib::Request& req, httplib::Response& res) { Handle(req, res); };
    s.Get(".*", handle).Post(".*", handle).Put(".*", handle).Patch(".*", handle);
    s.Delete(".*", handle).Options(".*", handle);
    // httplib's own errors (a malformed request line or header, a target over 8 KiB, a body it
    // could not read) come without a body: give them the JSON one and end the connection, whose
    // input can no longer be trusted.
    s.set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const httplib::Request&, httplib::Response& res) {
          if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
          std::string message = "malformed HTTP request (request line or headers)";
          if (t_connection != nullptr && t_connection->too_large) {
            res.status = 431;
            message = "request larger than " +
                      std::to_string(options.max_header_bytes + options.max_body_bytes) + " bytes";
          } else if (res.status == 414) {
            message = "request target too long";
          } else if (res.status == 413) {
            message = "request body larger than the limit of " +
                      std::to_string(options.max_body_bytes) + " bytes";
          } else if (res.status == 404) {
            message = "not found";
          }
          res.set_content(ErrorBody(message), "application/json");
          if (t_connection != nullptr) t_connection->close_after = true;
          return httplib::Server::HandlerResponse::Handled;
        }));
    s.set_exception_handler(
        [](const httplib::Request& /*req*/, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown exception";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          res.status = 500;
          res.set_content(ErrorBody("internal error: " + what), "application/json");
        });
  }
};

HttpServer::HttpServer(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                        HttpHandler handler) {
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument("HTTP port " + std::to_string(options.port) +
                                   " out of range [0, 65535]");
  }
  if (options.max_connections < 1) {
    return Status::InvalidArgument("HTTP server: max_connections must be >= 1");
  }
  auto rep = std::make_unique<Rep>();
  rep->options = options;
  rep->handler = std::move(handler);
  rep->wake_fd = ::eventfd(0, EFD_CLOEXEC);
  if (rep->wake_fd < 0) {
    return Status::Internal(std::string("HTTP server: eventfd: ") + std::strerror(errno));
  }
  rep->server = std::make_unique<Rep::Server>(rep.get());
  rep->Configure();
  errno = 0;
  if (options.port == 0) {
    rep->port = rep->server->bind_to_any_port(options.host);
  } else {
    rep->port = rep->server->bind_to_port(options.host, options.port) ? options.port : -1;
  }
  if (rep->port <= 0) {
    return Status::Unavailable("HTTP server: cannot listen on " + options.host + ":" +
                               std::to_string(options.port) + ": " +
                               (errno != 0 ? std::strerror(errno) : "bind failed"));
  }
  // httplib listens with a backlog of 5; a burst of clients connecting at once would see SYNs
  // dropped and retried a second later. Listening again only raises the backlog.
  ::listen(rep->server->listen_fd(), 128);
  Rep::Server* server = rep->server.get();
  rep->listener = std::thread([server] { server->listen_after_bind(); });
  // Shutdown() may come at once; stop() works only once the accept loop runs.
  for (int i = 0; i < 50000 && !server->is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(rep)));
}

HttpServer::~HttpServer() { Shutdown(); }

void HttpServer::Shutdown() {
  std::call_once(rep_->shutdown_once, [this] {
    const uint64_t one = 1;
    if (::write(rep_->wake_fd, &one, sizeof(one)) != sizeof(one)) {
      // An eventfd write of 1 cannot fail short of a bug; nothing else would wake the threads.
      std::abort();
    }
    rep_->server->stop();  // closes the listening socket; the accept loop joins the pool
    if (rep_->listener.joinable()) rep_->listener.join();
  });
}

int32_t HttpServer::port() const { return rep_->port; }

}  // namespace pdlib::router
