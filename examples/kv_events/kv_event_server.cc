#include "examples/kv_events/kv_event_server.h"

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "examples/kv_events/kv_events.grpc.pb.h"
#include "lib/base/tsan.h"
#include "lib/control/grpc_runtime.h"

namespace pdlib::sched {
namespace {

namespace pb = ::pdlib::examples::kv_events::v1;

void ToProto(const KVEvent& e, pb::KVEvent* out) {
  out->set_seq(e.seq);
  out->set_timestamp_us(e.timestamp_us);
  switch (e.type) {
    case KVEventType::kBlockStored: {
      pb::BlockStored* b = out->mutable_block_stored();
      b->set_room(e.room);
      b->set_page_size(e.page_size);
      b->mutable_pages()->Add(e.pages.begin(), e.pages.end());
      break;
    }
    case KVEventType::kBlockRemoved: {
      pb::BlockRemoved* b = out->mutable_block_removed();
      b->set_room(e.room);
      b->set_page_size(e.page_size);
      b->mutable_pages()->Add(e.pages.begin(), e.pages.end());
      break;
    }
    case KVEventType::kAllBlocksCleared:
      out->mutable_all_blocks_cleared()->set_page_size(e.page_size);
      break;
  }
}

StatusOr<KVEvent> FromProto(const pb::KVEvent& in) {
  KVEvent e;
  e.seq = in.seq();
  e.timestamp_us = in.timestamp_us();
  switch (in.event_case()) {
    case pb::KVEvent::kBlockStored:
      e.type = KVEventType::kBlockStored;
      e.room = in.block_stored().room();
      e.page_size = in.block_stored().page_size();
      e.pages.assign(in.block_stored().pages().begin(), in.block_stored().pages().end());
      break;
    case pb::KVEvent::kBlockRemoved:
      e.type = KVEventType::kBlockRemoved;
      e.room = in.block_removed().room();
      e.page_size = in.block_removed().page_size();
      e.pages.assign(in.block_removed().pages().begin(), in.block_removed().pages().end());
      break;
    case pb::KVEvent::kAllBlocksCleared:
      e.type = KVEventType::kAllBlocksCleared;
      e.page_size = in.all_blocks_cleared().page_size();
      break;
    default:
      return Status::InvalidArgument("KV event seq " + std::to_string(in.seq()) +
                                     " carries no event (newer server?)");
  }
  return e;
}

// One subscriber. Lock order: publisher lock (listener calls) -> mu_. gRPC calls (StartWrite,
// Finish) are made outside mu_, since a reaction may run inline.
class EventStream final : public grpc::ServerWriteReactor<pb::EventBatch> {
 public:
  EventStream(KVEventPublisher* publisher, uint64_t from_seq, size_t max_pending)
      : publisher_(publisher), max_pending_(max_pending) {
    PdlibTsanRelease(this);
    {
      std::lock_guard<std::mutex> lock(mu_);
      KVEventPublisher::Subscription sub =
          publisher_->Subscribe(from_seq, [this](const KVEvent& e) { OnEvent(e); });
      sub_id_ = sub.id;
      missed_ = sub.missed;
      pending_ = std::move(sub.replay);
    }
    // The first batch goes out even when empty: it carries `missed` and tells the client that
    // the subscription is live.
    Flush(/*force=*/true);
  }

  void OnWriteDone(bool ok) override {
    PdlibTsanAcquire(this);
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok) EndLocked(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
    }
    Flush(/*force=*/false);
  }

  void OnCancel() override {
    PdlibTsanAcquire(this);
    {
      std::lock_guard<std::mutex> lock(mu_);
      EndLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    }
    Flush(/*force=*/false);
  }

  void OnDone() override {
    PdlibTsanAcquire(this);
    // After Unsubscribe returns no listener call is running or will run.
    publisher_->Unsubscribe(sub_id_);
    // Pairs with the acquire after Server::Wait() in Shutdown: the engine may destroy the
    // publisher once the server is shut down (gRPC orders this, invisibly to TSan).
    PdlibTsanRelease(publisher_);
    delete this;
  }

 private:
  void OnEvent(const KVEvent& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ending_) return;
      if (pending_.size() >= max_pending_) {
        EndLocked(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                               "subscriber fell " + std::to_string(pending_.size()) +
                                   " events behind; resubscribe from seq " +
                                   std::to_string(pending_.front().seq)));
      } else {
        pending_.push_back(e);
      }
    }
    Flush(/*force=*/false);
  }

  void EndLocked(grpc::Status status) {
    if (ending_) return;
    ending_ = true;
    end_status_ = std::move(status);
    pending_.clear();
  }

  // Starts the next write, or the Finish once the stream is ending and no write is in flight.
  void Flush(bool force) {
    bool write = false, finish = false;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_ || finished_) return;
      if (ending_) {
        finished_ = finish = true;
        status = end_status_;
      } else if (!pending_.empty() || force) {
        out_.Clear();
        out_.set_missed(missed_);
        missed_ = 0;
        for (const KVEvent& e : pending_) ToProto(e, out_.add_events());
        pending_.clear();
        writing_ = write = true;
      }
    }
    PdlibTsanRelease(this);
    if (write) StartWrite(&out_);
    if (finish) Finish(status);
  }

  KVEventPublisher* const publisher_;
  const size_t max_pending_;
  uint64_t sub_id_ = 0;
  std::mutex mu_;
  std::vector<KVEvent> pending_;  // guarded by mu_
  uint64_t missed_ = 0;           // guarded by mu_
  bool writing_ = false;          // guarded by mu_
  bool ending_ = false;           // guarded by mu_
  bool finished_ = false;         // guarded by mu_
  grpc::Status end_status_;       // guarded by mu_
  pb::EventBatch out_;            // owned by the write in flight
};

class KVEventService final : public pb::KVEvents::CallbackService {
 public:
  KVEventService(KVEventPublisher* publisher, size_t max_pending)
      : publisher_(publisher), max_pending_(max_pending) {}

  grpc::ServerWriteReactor<pb::EventBatch>* Subscribe(
      grpc::CallbackServerContext* /*ctx*/, const pb::SubscribeRequest* request) override {
    return new EventStream(publisher_, request->from_seq(), max_pending_);
  }

 private:
  KVEventPublisher* const publisher_;
  const size_t max_pending_;
};

}  // namespace

struct KVEventServer::Rep {
  std::string host;
  int32_t port = 0;
  KVEventPublisher* publisher = nullptr;
  std::unique_ptr<KVEventService> service;
  std::unique_ptr<grpc::Server> server;
  std::once_flag shutdown_once;
};

StatusOr<std::unique_ptr<KVEventServer>> KVEventServer::Start(const KVEventServerOptions& options,
                                                              KVEventPublisher* publisher) {
  if (publisher == nullptr) return Status::InvalidArgument("KV event server: no publisher");
  if (options.host.empty()) return Status::InvalidArgument("KV event server: empty host");
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument("KV event server: port " + std::to_string(options.port) +
                                   " out of range [0, 65535]");
  }
  if (options.max_pending_events < 1) {
    return Status::InvalidArgument("KV event server: max_pending_events must be >= 1");
  }
  control::KeepCallbackQueueAlive();  // a callback-API server: see lib/control/grpc_runtime.h
  auto rep = std::make_unique<Rep>();
  rep->host = options.host;
  rep->publisher = publisher;
  rep->service = std::make_unique<KVEventService>(publisher, options.max_pending_events);
  const std::string address = options.host + ":" + std::to_string(options.port);
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &rep->port);
  builder.RegisterService(rep->service.get());
  rep->server = builder.BuildAndStart();
  if (rep->server == nullptr || rep->port == 0) {
    return Status::Unavailable("KV event server: cannot listen on " + address +
                               " (port in use, or host not a local address?)");
  }
  return std::unique_ptr<KVEventServer>(new KVEventServer(std::move(rep)));
}

KVEventServer::KVEventServer(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

KVEventServer::~KVEventServer() { Shutdown(); }

void KVEventServer::Shutdown() {
  std::call_once(rep_->shutdown_once, [this] {
    // Subscriptions never end by themselves: cancel them at once, then wait for their reactors.
    rep_->server->Shutdown(std::chrono::system_clock::now());
    rep_->server->Wait();
    PdlibTsanAcquire(rep_->publisher);
  });
}

int32_t KVEventServer::port() const { return rep_->port; }

std::string KVEventServer::address() const { return rep_->host + ":" + std::to_string(rep_->port); }

Status SubscribeKVEvents(const KVEventSubscribeOptions& options,
                         const std::function<bool(const KVEvent&)>& on_event,
                         const std::function<void(uint64_t)>& on_missed) {
  auto channel = grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials());
  auto stub = pb::KVEvents::NewStub(channel);
  grpc::ClientContext ctx;
  pb::SubscribeRequest request;
  request.set_from_seq(options.from_seq);

  // Idle watchdog: cancels the call when no batch arrived for idle_timeout.
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false, timed_out = false;
  auto last = std::chrono::steady_clock::now();
  std::thread watchdog;
  if (options.idle_timeout.count() > 0) {
    watchdog = std::thread([&] {
      std::unique_lock<std::mutex> lock(mu);
      while (!stop) {
        const auto deadline = last + options.idle_timeout;
        if (std::chrono::steady_clock::now() >= deadline) {
          timed_out = true;
          ctx.TryCancel();
          return;
        }
        cv.wait_until(lock, deadline);
      }
    });
  }
  auto stop_watchdog = [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (watchdog.joinable()) watchdog.join();
  };

  std::unique_ptr<grpc::ClientReader<pb::EventBatch>> reader = stub->Subscribe(&ctx, request);
  pb::EventBatch batch;
  bool first = true, stopped_by_caller = false;
  Status bad;
  while (!stopped_by_caller && bad.ok() && reader->Read(&batch)) {
    {
      std::lock_guard<std::mutex> lock(mu);
      last = std::chrono::steady_clock::now();
    }
    if (first && on_missed) on_missed(batch.missed());
    first = false;
    for (const pb::KVEvent& pe : batch.events()) {
      StatusOr<KVEvent> e = FromProto(pe);
      if (!e.ok()) {
        bad = e.status();
        break;
      }
      if (!on_event(*e)) {
        stopped_by_caller = true;
        break;
      }
    }
  }
  if (stopped_by_caller || !bad.ok()) {
    ctx.TryCancel();
    while (reader->Read(&batch)) {
    }
  }
  grpc::Status status = reader->Finish();
  stop_watchdog();
  if (!bad.ok()) return bad;
  if (stopped_by_caller) return Status::OK();
  if (timed_out) {
    return Status::DeadlineExceeded("no KV event from " + options.target + " for " +
                                    std::to_string(options.idle_timeout.count()) + " ms");
  }
  if (status.ok()) return Status::OK();
  return Status(static_cast<StatusCode>(status.error_code()),
                "KV event stream from " + options.target + ": " + status.error_message());
}

}  // namespace pdlib::sched
