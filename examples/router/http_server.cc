#include "examples/router/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include "examples/router/json.h"
#include "lib/base/mutex.h"

namespace pdlib::router {
namespace {

using Clock = std::chrono::steady_clock;

int RemainingMs(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

std::string ErrorBody(std::string_view message) {
  std::string body = "{\"error\":{\"message\":";
  AppendJsonString(&body, message);
  body += ",\"type\":\"invalid_request_error\"}}";
  return body;
}

// Half-closes, then reads what the client still sends for a short while before closing, so
// that a response sent before the whole request was read (413, 408) is not lost to a reset.
void CloseGracefully(int fd) {
  ::shutdown(fd, SHUT_WR);
  const auto deadline = Clock::now() + std::chrono::milliseconds(200);
  char buf[4096];
  size_t drained = 0;
  while (drained < (1 << 20)) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, RemainingMs(deadline)) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
  ::close(fd);
}

}  // namespace

bool HttpConnection::SendAll(std::string_view data) {
  if (broken_) return false;
  const auto deadline = Clock::now() + write_timeout_;
  while (!data.empty()) {
    const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      const int left = RemainingMs(deadline);
      if (left > 0 && ::poll(&p, 1, left) > 0) continue;
    }
    broken_ = true;  // error, or the client does not read
    return false;
  }
  return true;
}

bool HttpConnection::Respond(int status, std::string_view content_type, std::string_view body) {
  responded_ = true;
  return SendAll(FormatHttpResponse(status, content_type, body));
}

bool HttpConnection::StartStream(int status, std::string_view content_type) {
  responded_ = true;
  return SendAll(FormatHttpStreamHead(status, content_type));
}

bool HttpConnection::SendStreamData(std::string_view data) { return SendAll(data); }

bool HttpConnection::Gone() {
  if (broken_) return true;
  pollfd p[2] = {{fd_, POLLIN | POLLRDHUP, 0}, {wake_fd_, POLLIN, 0}};
  if (::poll(p, 2, 0) <= 0) return false;
  if (p[1].revents & POLLIN) return true;  // shutting down
  // A client that half-closes after its request also counts as gone (curl does not).
  if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  if (p[0].revents & POLLIN) {
    char c;
    if (::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return true;
  }
  return false;
}

struct HttpServer::Rep {
  HttpServerOptions options;
  HttpHandler handler;
  int listen_fd = -1;
  int wake_fd = -1;  // an eventfd, written once at shutdown and never read: stays readable
  int32_t port = 0;
  std::thread acceptor;
  std::once_flag shutdown_once;

  struct Worker {
    std::thread thread;
    bool done = false;  // guarded by mu
  };
  Mutex mu;
  std::list<Worker> workers ABSL_GUARDED_BY(mu);
  int active ABSL_GUARDED_BY(mu) = 0;

  ~Rep() {
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void ReapWorkers() {
    std::vector<std::thread> finished;
    {
      MutexLock lock(&mu);
      for (auto it = workers.begin(); it != workers.end();) {
        if (it->done) {
          finished.push_back(std::move(it->thread));
          it = workers.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& t : finished) t.join();
  }

  void AcceptLoop() {
    while (true) {
      pollfd p[2] = {{listen_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
      const int n = ::poll(p, 2, 1000);  // wakes at least once a second to reap workers
      ReapWorkers();
      if (p[1].revents & POLLIN) return;
      if (n <= 0 || !(p[0].revents & POLLIN)) continue;
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        // EMFILE and friends: back off instead of spinning on a ready listen socket.
        if (errno != EINTR && errno != EAGAIN)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      {
        MutexLock lock(&mu);
        if (active < options.max_connections) {
          ++active;
          workers.emplace_back();
          Worker* w = &workers.back();  // list nodes do not move
          w->thread = std::thread([this, fd, w] {
            Serve(fd);
            MutexLock lock(&mu);
            w->done = true;
            --active;
          });
          continue;
        }
      }
      HttpConnection conn(fd, wake_fd, std::chrono::milliseconds(100));
      conn.Respond(503, "application/json",
                   ErrorBody("too many connections (limit " +
                             std::to_string(options.max_connections) + "); retry later"));
      ::close(fd);
    }
  }

  void Serve(int fd) {
    std::string buffer;
    HttpParseResult parsed;
    bool sent_continue = false;
    const auto deadline = Clock::now() + options.read_timeout;
    HttpConnection conn(fd, wake_fd, options.write_timeout);
    while (true) {
      parsed = ParseHttpRequest(buffer, options.limits);
      if (parsed.state != HttpParseResult::State::kIncomplete) break;
      if (parsed.headers_done && parsed.request.expect_continue && !sent_continue) {
        sent_continue = true;
        if (!conn.SendStreamData("HTTP/1.1 100 Continue\r\n\r\n")) break;
      }
      const int left = RemainingMs(deadline);
      if (left == 0) {
        conn.Respond(408, "application/json",
                     ErrorBody("the request did not arrive within " +
                               std::to_string(options.read_timeout.count()) + " ms"));
        break;
      }
      pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
      if (::poll(p, 2, left) < 0 && errno != EINTR) break;
      if (p[1].revents & POLLIN) break;  // shutting down
      if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char chunk[16384];
      const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) break;  // closed before the request was whole
      buffer.append(chunk, static_cast<size_t>(n));
    }
    if (parsed.state == HttpParseResult::State::kError) {
      conn.Respond(parsed.error_status, "application/json", ErrorBody(parsed.error_message));
    } else if (parsed.state == HttpParseResult::State::kComplete) {
      handler(parsed.request, &conn);
      if (!conn.responded()) {
        conn.Respond(500, "application/json", ErrorBody("the handler sent no response"));
      }
    }
    CloseGracefully(fd);
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

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(options.port);
  if (int rc = ::getaddrinfo(options.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::InvalidArgument("HTTP server: cannot resolve '" + options.host +
                                   "': " + ::gai_strerror(rc));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr && rep->listen_fd < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      rep->listen_fd = fd;
    } else {
      last_error = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (rep->listen_fd < 0) {
    return Status::Unavailable("HTTP server: cannot listen on " + options.host + ":" + port + ": " +
                               last_error);
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(rep->listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  rep->port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  rep->wake_fd = ::eventfd(0, EFD_CLOEXEC);
  if (rep->wake_fd < 0) {
    return Status::Internal(std::string("HTTP server: eventfd: ") + std::strerror(errno));
  }
  Rep* r = rep.get();
  rep->acceptor = std::thread([r] { r->AcceptLoop(); });
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
    if (rep_->acceptor.joinable()) rep_->acceptor.join();
    std::list<Rep::Worker> workers;
    {
      MutexLock lock(&rep_->mu);
      workers.swap(rep_->workers);
    }
    for (auto& w : workers) w.thread.join();
  });
}

int32_t HttpServer::port() const { return rep_->port; }

}  // namespace pdlib::router
