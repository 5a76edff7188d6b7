// EtcdWatch: one thread per watch reads etcd's Watch stream and reconnects it (etcd_client.h).
#include <thread>
#include <utility>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/control/etcd_client.h"
#include "lib/control/etcd_client_internal.h"
#include "lib/control/grpc_status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

using etcd_internal::CheckKeyValue;
using etcd_internal::Clock;
using etcd_internal::Endpoint;
using etcd_internal::KeyRange;
using etcd_internal::PrefixRange;
using etcd_internal::PrintableKey;
using etcd_internal::ToKeyValue;
using std::chrono::milliseconds;
namespace pb = ::etcdserverpb;

namespace {

// etcd closes a watch stream carrying this metadata when its member loses the cluster's leader
// (a partitioned member would otherwise keep the stream open and silent).
constexpr char kRequireLeaderKey[] = "hasleader";

// How one stream ended.
struct StreamEnd {
  Status status;           // why it ended (OK: stopped)
  bool created = false;    // etcd accepted the watch (the backoff starts over)
  bool compacted = false;  // the revision to resume from was compacted: resync
};

}  // namespace

struct EtcdWatch::Rep {
  std::shared_ptr<EtcdClient::Rep> client;
  std::string prefix;
  KeyRange range;
  EtcdWatchOptions options;
  Callback callback;
  std::thread thread;

  // Under client->mu, so that EtcdClient::Cancel() and Stop() wake the same pauses.
  bool stopped = false;                    // guarded by client->mu
  grpc::ClientContext* context = nullptr;  // the open stream's; guarded by client->mu
  std::string endpoint;                    // guarded by client->mu

  Status last_error;  // guarded by client->mu

  // The next revision to deliver (0: from now). The watch thread's own.
  int64_t next_revision = 0;
  // For revision() and streams_created(). Relaxed: progress figures, nothing else is published
  // through them.
  std::atomic<int64_t> delivered{0};
  std::atomic<int64_t> streams{0};

  bool Ending() {
    MutexLock lock(&client->mu);
    return stopped || client->cancelled;
  }

  // Sleeps for `pause` unless stopped or cancelled first.
  void Pause(milliseconds pause) {
    const Clock::time_point until = Clock::now() + pause;
    MutexLock lock(&client->mu);
    while (!stopped && !client->cancelled && Clock::now() < until) {
      client->wake.WaitFor(&client->mu, until - Clock::now());
    }
  }

  void Deliver(const EtcdWatchUpdate& update) {
    if (Ending()) return;  // nothing after Stop(), also when the callback called it
    delivered.store(update.revision, std::memory_order_relaxed);
    callback(update);
  }

  // etcd_internal::WaitConnected, in short waits so that Stop() is not held up.
  bool Connect(Endpoint& ep, Clock::time_point deadline) {
    constexpr milliseconds kSlice{50};
    while (!Ending() && Clock::now() < deadline) {
      if (etcd_internal::WaitConnected(*ep.channel, std::min(deadline, Clock::now() + kSlice))) {
        return true;
      }
    }
    return false;
  }

  void Run();
  StreamEnd RunStream(Endpoint& ep);
  // Reads the whole prefix and delivers it as a resync; false when that failed.
  bool Resync();
  // Checks and converts one response's events; the first bad one makes the stream fail.
  Status TakeEvents(const pb::WatchResponse& response, std::vector<EtcdWatchEvent>* events);
};

void EtcdWatch::Rep::Run() {
  const size_t n = client->endpoints.size();
  size_t index = client->preferred.load(std::memory_order_relaxed) % n;
  milliseconds backoff = options.initial_backoff;
  int64_t failures = 0;  // in a row; logged at 1, 2, 4, 8... so that a lasting outage is quiet
  while (!Ending()) {
    Endpoint& ep = *client->endpoints[index];
    StreamEnd end = RunStream(ep);
    if (Ending()) break;
    if (end.created) {
      backoff = options.initial_backoff;
      failures = 0;
    }
    if (end.compacted) {
      PDLIB_LOG(kWarning,
                "etcd watch on %s: revision %d was compacted on %s; reading the prefix again",
                PrintableKey(prefix), next_revision, ep.address);
      if (Resync()) continue;
    } else {
      ++failures;
      if ((failures & (failures - 1)) == 0) {
        PDLIB_LOG(kWarning, "etcd watch on %s: stream to %s ended (%d in a row): %s; reconnecting",
                  PrintableKey(prefix), ep.address, failures, end.status.message());
      }
      MutexLock lock(&client->mu);
      last_error = end.status;
      index = (index + 1) % n;
    }
    Pause(backoff);
    backoff = std::min(backoff * 2, options.max_backoff);
  }
}

StreamEnd EtcdWatch::Rep::RunStream(Endpoint& ep) {
  StreamEnd end;
  const Clock::time_point dial_deadline = Clock::now() + client->options.dial_timeout;
  if (!Connect(ep, dial_deadline)) {
    end.status = Status::Unavailable(
        absl::StrFormat("not connected within %d ms", client->options.dial_timeout.count()));
    return end;
  }
  if (Status s = client->EnsureToken(ep, dial_deadline); !s.ok()) {
    end.status = s;
    return end;
  }
  grpc::ClientContext context;
  context.AddMetadata(kRequireLeaderKey, "true");
  client->AttachToken(ep, &context);
  {
    MutexLock lock(&client->mu);
    if (stopped || client->cancelled) return end;
    client->in_flight.insert(&context);
    this->context = &context;
    endpoint = ep.address;
  }
  auto stream = ep.watch->Watch(&context);
  streams.fetch_add(1, std::memory_order_relaxed);

  pb::WatchRequest request;
  pb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(range.key);
  create->set_range_end(range.range_end);
  create->set_start_revision(next_revision);
  create->set_prev_kv(options.prev_kv);

  pb::WatchResponse response;
  int64_t watch_id = -1;
  if (stream->Write(request)) {
    while (stream->Read(&response)) {
      if (!end.created) {
        if (!response.created()) {
          end.status = Status::Internal("first answer on a watch stream is not its creation");
          break;
        }
        end.created = true;
        watch_id = response.watch_id();
        if (!response.canceled()) {
          MutexLock lock(&client->mu);
          last_error = Status::OK();
        }
        // From "now": the watch starts after the revision etcd created it at.
        if (next_revision == 0 && !response.canceled()) {
          next_revision = response.header().revision() + 1;
        }
      } else if (response.watch_id() != watch_id) {
        continue;  // not ours (this stream carries one watch)
      }
      if (response.compact_revision() > 0) {
        end.compacted = true;
        break;
      }
      if (response.canceled()) {
        Status s = Status::Aborted(absl::StrFormat("etcd cancelled the watch: %s",
                                                   response.cancel_reason().substr(0, 256)));
        client->ForgetTokenIfInvalid(ep, Status::Unauthenticated(response.cancel_reason()));
        end.status = s;
        break;
      }
      if (response.events_size() == 0) continue;
      EtcdWatchUpdate update;
      if (Status s = TakeEvents(response, &update.events); !s.ok()) {
        end.status = s;
        break;
      }
      update.revision = update.events.back().kv.mod_revision;
      next_revision = update.revision + 1;
      Deliver(update);
    }
  }
  context.TryCancel();
  Status finish = FromGrpcStatus(stream->Finish());
  if (end.status.ok() && !end.compacted) {
    end.status = finish.ok() ? Status::Unavailable("the server closed the stream") : finish;
  }
  client->ForgetTokenIfInvalid(ep, finish);
  {
    MutexLock lock(&client->mu);
    client->in_flight.erase(&context);
    this->context = nullptr;
    endpoint.clear();
  }
  return end;
}

Status EtcdWatch::Rep::TakeEvents(const pb::WatchResponse& response,
                                  std::vector<EtcdWatchEvent>* events) {
  int64_t min_revision = next_revision;
  for (const mvccpb::Event& e : response.events()) {
    const bool deleted = e.type() == mvccpb::Event::DELETE;
    if (!deleted && e.type() != mvccpb::Event::PUT) {
      return Status::Internal(absl::StrFormat("event of unknown type %d", e.type()));
    }
    if (Status s = CheckKeyValue(e.kv(), client->options, deleted); !s.ok()) return s;
    const std::string& key = e.kv().key();
    const bool inside =
        key >= range.key && (range.range_end == std::string_view("\0", 1) || key < range.range_end);
    if (!inside) {
      return Status::Internal(
          absl::StrFormat("event for key %s outside the watched prefix", PrintableKey(key)));
    }
    // The first event is at the revision the stream was asked for or later; the others follow
    // in order (a Txn's share one revision).
    if (e.kv().mod_revision() < min_revision) {
      return Status::Internal(absl::StrFormat("event at revision %d, expected %d or later",
                                              e.kv().mod_revision(), min_revision));
    }
    min_revision = e.kv().mod_revision();
    EtcdWatchEvent event;
    event.type = deleted ? EtcdWatchEvent::Type::kDelete : EtcdWatchEvent::Type::kPut;
    event.kv = ToKeyValue(e.kv());
    if (e.has_prev_kv() && !e.prev_kv().key().empty()) {
      if (Status s = CheckKeyValue(e.prev_kv(), client->options, false); !s.ok()) return s;
      event.prev_kv = ToKeyValue(e.prev_kv());
    }
    events->push_back(std::move(event));
  }
  return Status::OK();
}

bool EtcdWatch::Rep::Resync() {
  StatusOr<EtcdRange> snapshot =
      client->RangeOf(range, client->DeadlineFor(EtcdClient::kDefaultTimeout));
  if (!snapshot.ok()) {
    PDLIB_LOG(kWarning, "etcd watch on %s: resync failed: %s", PrintableKey(prefix),
              snapshot.status().message());
    return false;
  }
  EtcdWatchUpdate update;
  update.resynced = true;
  update.snapshot = std::move(snapshot->kvs);
  update.revision = snapshot->revision;
  next_revision = snapshot->revision + 1;
  Deliver(update);
  return true;
}

EtcdWatch::EtcdWatch(std::shared_ptr<Rep> rep) : rep_(std::move(rep)) {}

EtcdWatch::~EtcdWatch() { Stop(); }

void EtcdWatch::Stop() {
  {
    MutexLock lock(&rep_->client->mu);
    rep_->stopped = true;
    if (rep_->context != nullptr) rep_->context->TryCancel();
    rep_->client->wake.SignalAll();
  }
  if (!rep_->thread.joinable()) return;
  if (rep_->thread.get_id() == std::this_thread::get_id()) {
    // From the callback: the thread ends once it returns, holding its own reference to rep_.
    rep_->thread.detach();
    return;
  }
  rep_->thread.join();
}

int64_t EtcdWatch::revision() const { return rep_->delivered.load(std::memory_order_relaxed); }

std::string EtcdWatch::endpoint() const {
  MutexLock lock(&rep_->client->mu);
  return rep_->endpoint;
}

Status EtcdWatch::last_error() const {
  MutexLock lock(&rep_->client->mu);
  return rep_->last_error;
}

int64_t EtcdWatch::streams_created() const { return rep_->streams.load(std::memory_order_relaxed); }

StatusOr<std::unique_ptr<EtcdWatch>> EtcdClient::WatchPrefix(std::string_view prefix,
                                                             const EtcdWatchOptions& options,
                                                             EtcdWatch::Callback callback) {
  if (prefix.size() > rep_->options.max_key_bytes) {
    return Status::InvalidArgument(
        absl::StrFormat("etcd watch prefix is %d bytes, over max_key_bytes %d", prefix.size(),
                        rep_->options.max_key_bytes));
  }
  if (options.start_revision < 0 || options.initial_backoff.count() <= 0 ||
      options.max_backoff < options.initial_backoff) {
    return Status::InvalidArgument(absl::StrFormat(
        "etcd watch options: start_revision %d must not be negative, initial_backoff %d ms "
        "positive and at most max_backoff %d ms",
        options.start_revision, options.initial_backoff.count(), options.max_backoff.count()));
  }
  if (!callback) return Status::InvalidArgument("etcd watch needs a callback");
  if (rep_->Cancelled()) return rep_->CancelledStatus("Watch");

  auto rep = std::make_shared<EtcdWatch::Rep>();
  rep->client = rep_;
  rep->prefix = std::string(prefix);
  rep->range = PrefixRange(prefix);
  rep->options = options;
  rep->callback = std::move(callback);
  rep->next_revision = options.start_revision;
  // The thread holds its own reference: a watch stopped from its callback outlives the object.
  rep->thread = std::thread([rep] { rep->Run(); });
  return std::unique_ptr<EtcdWatch>(new EtcdWatch(std::move(rep)));
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
