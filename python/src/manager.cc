// KVManager, KVSender, KVReceiver, metrics and PollAndAllReduce for Python.
//
// Lifetime. C++ requires every handle to be destroyed before its manager; Python's garbage
// collector promises no order, and close() may come from any thread. So a manager lives in a
// ManagerState shared by the Python manager and all its handles, which also keeps the Python
// options (and with them the registered numpy arrays / tensors) alive. close() on the manager
// takes every live handle's C++ object away under the GIL, waits until no call that released the
// GIL is still inside pdlib (the `inflight` counters), then destroys the handles and the manager
// without the GIL. A handle whose C++ object is gone answers poll() with the state it had (a
// non-terminal one becomes Failed, as C++ fails the rooms of a destroyed manager) and raises
// pdlib.ClosedError from calls that would do work.
//
// GIL. poll() and pages_reusable() keep the GIL: they are one atomic load, and releasing and
// re-taking the GIL would cost more. Every other call into pdlib releases it.
#include <pybind11/stl.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <vector>

#include "pdlib/kv_manager.h"
#include "pdlib/poll_reduce.h"
#include "python/src/binding.h"

namespace pdlib_py {
namespace {

class HandleBase;

// Everything one Python KVManager and its handles share.
class ManagerState {
 public:
  ManagerState(std::unique_ptr<pdlib::KVManager> manager, py::object keepalive)
      : manager_(std::move(manager)), keepalive_(std::move(keepalive)) {
    mode_ = manager_->mode();
  }
  // Runs when the Python manager and every handle are gone, with the GIL held (from a
  // deallocation). pdlib's threads may call the log sink, which takes the GIL: release it.
  ~ManagerState() {
    {
      py::gil_scoped_release release;
      manager_.reset();
    }
    keepalive_ = py::object();
  }

  // Counts a call that is about to use the C++ manager or `handle` without the GIL. False when
  // the manager is closed (nothing may be touched then).
  bool Enter(HandleBase* handle);
  void Exit(HandleBase* handle);

  // The C++ manager while open, else null. Read under the GIL; valid without it between
  // Enter() and Exit().
  pdlib::KVManager* manager() const { return closed_ ? nullptr : manager_.get(); }
  pdlib::Mode mode() const { return mode_; }
  bool closed() const { return closed_; }

  void Register(HandleBase* handle) {
    std::lock_guard lock(mu_);
    handles_.insert(handle);
  }
  void Unregister(HandleBase* handle) {
    std::lock_guard lock(mu_);
    handles_.erase(handle);
  }
  // Waits (without the GIL) until `handle` has no call in flight.
  void WaitIdle(HandleBase* handle);

  // Called with the GIL held; returns with it held.
  void Close();

 private:
  std::mutex mu_;
  std::condition_variable idle_;
  bool closed_ = false;  // written under mu_ and the GIL
  int inflight_ = 0;     // calls between Enter and Exit, all handles and the manager
  std::unordered_set<HandleBase*> handles_;
  std::unique_ptr<pdlib::KVManager> manager_;
  py::object keepalive_;
  pdlib::Mode mode_;
};

// The C++ handle of one request and the Python-visible state it leaves when closed.
class HandleBase {
 public:
  HandleBase(std::shared_ptr<ManagerState> state, uint64_t room)
      : state_(std::move(state)), room_(room) {}
  virtual ~HandleBase() = default;

  pdlib::KVPoll Poll() const { return pollable_ != nullptr ? pollable_->Poll() : closed_state_; }
  bool PagesReusable() const {
    return pollable_ != nullptr ? pollable_->PagesReusable() : closed_reusable_;
  }
  uint64_t room() const { return room_; }
  bool closed() const { return pollable_ == nullptr; }
  ManagerState& state() { return *state_; }
  const pdlib::KVPollable* pollable() const { return pollable_; }

  py::object FailureReason() {
    if (pollable_ == nullptr) return ErrorFromStatus(closed_reason_);
    pdlib::Status s;
    {
      Call call(this, "handle");
      const pdlib::KVPollable* h = pollable_;  // read under the GIL: close() may null it
      py::gil_scoped_release release;
      s = h->FailureReason();
    }
    return ErrorFromStatus(s);
  }

  // Takes the C++ handle away (GIL held) and remembers what poll() should keep answering.
  // `why` is the reason a non-terminal request now reads as Failed.
  virtual std::unique_ptr<pdlib::KVPollable> Detach(const char* why) = 0;

  // Destroys the C++ handle now (aborting a request that is not terminal). Idempotent.
  void Close() {
    if (pollable_ == nullptr) return;
    state_->Unregister(this);
    std::unique_ptr<pdlib::KVPollable> h = Detach("handle closed");
    py::gil_scoped_release release;
    state_->WaitIdle(this);
    h.reset();
  }

  int inflight = 0;  // guarded by ManagerState::mu_

  // Counts one call that releases the GIL (see ManagerState::Enter); raises ClosedError when
  // the handle or its manager is closed.
  class Call {
   public:
    Call(HandleBase* h, const char* what) : h_(h) {
      if (h_->pollable_ == nullptr || !h_->state_->Enter(h_)) ThrowClosed(what);
    }
    ~Call() { h_->state_->Exit(h_); }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    HandleBase* h_;
  };

 protected:
  void Remember(const pdlib::KVPollable& h, const char* why) {
    closed_state_ = h.Poll();
    closed_reusable_ = h.PagesReusable();
    if (closed_state_ == pdlib::KVPoll::kFailed) {
      closed_reason_ = h.FailureReason();
    } else if (closed_state_ != pdlib::KVPoll::kSuccess) {
      closed_state_ = pdlib::KVPoll::kFailed;
      closed_reason_ = pdlib::Status::Cancelled("room " + std::to_string(room_) + ": " + why);
      closed_reusable_ = false;  // pdlib decides; TakeReusableRooms() says when
    }
    pollable_ = nullptr;
  }

  std::shared_ptr<ManagerState> state_;
  const pdlib::KVPollable* pollable_ = nullptr;
  uint64_t room_;
  pdlib::KVPoll closed_state_ = pdlib::KVPoll::kFailed;
  bool closed_reusable_ = false;
  pdlib::Status closed_reason_;
};

template <typename T>
class Handle final : public HandleBase {
 public:
  Handle(std::shared_ptr<ManagerState> state, std::unique_ptr<T> handle)
      : HandleBase(std::move(state), handle->room()), handle_(std::move(handle)) {
    pollable_ = handle_.get();
    state_->Register(this);
  }
  // Python dropped the last reference: destroy the C++ handle unless close() took it.
  ~Handle() override { Close(); }

  std::unique_ptr<pdlib::KVPollable> Detach(const char* why) override {
    Remember(*handle_, why);
    return std::move(handle_);
  }
  T* get() const { return handle_.get(); }

 private:
  std::unique_ptr<T> handle_;
};

using Sender = Handle<pdlib::KVSender>;
using Receiver = Handle<pdlib::KVReceiver>;

bool ManagerState::Enter(HandleBase* handle) {
  std::lock_guard lock(mu_);
  if (closed_) return false;
  ++inflight_;
  if (handle != nullptr) ++handle->inflight;
  return true;
}

void ManagerState::Exit(HandleBase* handle) {
  std::lock_guard lock(mu_);
  --inflight_;
  if (handle != nullptr) --handle->inflight;
  idle_.notify_all();
}

void ManagerState::WaitIdle(HandleBase* handle) {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [&] { return handle->inflight == 0; });
}

void ManagerState::Close() {
  std::vector<std::unique_ptr<pdlib::KVPollable>> handles;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    for (HandleBase* h : handles_) handles.push_back(h->Detach("manager closed"));
    handles_.clear();
  }
  std::unique_ptr<pdlib::KVManager> manager;
  {
    py::gil_scoped_release release;
    std::unique_lock lock(mu_);
    idle_.wait(lock, [&] { return inflight_ == 0; });
    lock.unlock();
    handles.clear();
    manager = std::move(manager_);
    manager.reset();
  }
  keepalive_ = py::object();
}

// Every manager state not yet destroyed, so that interpreter exit can close them all (atexit in
// pdlib/__init__.py). Touched under the GIL only.
std::vector<std::weak_ptr<ManagerState>>& LiveStates() {
  static auto* live = new std::vector<std::weak_ptr<ManagerState>>();
  return *live;
}

void CloseAllManagers() {
  std::vector<std::shared_ptr<ManagerState>> states;
  for (auto& weak : LiveStates()) {
    if (auto s = weak.lock()) states.push_back(std::move(s));
  }
  LiveStates().clear();
  for (auto& s : states) s->Close();
}

// The Python KVManager: a shared_ptr so handles can hold the state.
class PyManager {
 public:
  explicit PyManager(std::shared_ptr<ManagerState> state) : state_(std::move(state)) {}
  ~PyManager() = default;  // the state outlives us while handles exist

  static std::shared_ptr<PyManager> Create(py::object options) {
    pdlib::KVManagerOptions o = ToOptions(options);
    pdlib::StatusOr<std::unique_ptr<pdlib::KVManager>> created = pdlib::Status::Internal("unset");
    {
      py::gil_scoped_release release;
      created = pdlib::KVManager::Create(o);
    }
    if (!created.ok()) ThrowStatus(created.status());
    auto state = std::make_shared<ManagerState>(std::move(*created), std::move(options));
    auto& live = LiveStates();
    std::erase_if(live, [](const std::weak_ptr<ManagerState>& w) { return w.expired(); });
    live.push_back(state);
    return std::make_shared<PyManager>(std::move(state));
  }

  // Runs f(manager) without the GIL, counted so close() waits for it.
  template <typename F>
  auto WithManager(F f) {
    pdlib::KVManager* m = state_->manager();
    if (m == nullptr || !state_->Enter(nullptr)) ThrowClosed("KVManager");
    struct Exit {
      ManagerState* s;
      ~Exit() { s->Exit(nullptr); }
    } exit{state_.get()};
    py::gil_scoped_release release;
    return f(m);
  }

  py::object CreateSender(py::handle room_obj) {
    const uint64_t room = ToU64(room_obj, "room");
    auto sender = WithManager([&](pdlib::KVManager* m) { return m->CreateSender(room); });
    if (!sender.ok()) ThrowStatus(sender.status());
    return py::cast(std::make_unique<Sender>(state_, std::move(*sender)));
  }

  static pdlib::BootstrapAddress ParseAddress(py::handle bootstrap) {
    pdlib::BootstrapAddress address;
    py::tuple parsed =
        py::module_::import("pdlib._options").attr("parse_bootstrap_address")(bootstrap);
    address.host = parsed[0].cast<std::string>();
    address.port = parsed[1].cast<uint16_t>();
    return address;
  }

  void Connect(py::handle bootstrap, double timeout) {
    const pdlib::BootstrapAddress address = ParseAddress(bootstrap);
    if (!(timeout >= 0) || timeout > 1e6) {
      throw py::value_error("timeout " + std::to_string(timeout) + " must be in [0, 1e6] s");
    }
    const auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
    pdlib::Status st = WithManager([&](pdlib::KVManager* m) { return m->Connect(address, ms); });
    if (!st.ok()) ThrowStatus(st);
  }

  py::object CreateReceiver(py::handle bootstrap, py::handle room_obj, py::handle dp_rank_obj) {
    const pdlib::BootstrapAddress address = ParseAddress(bootstrap);
    const uint64_t room = ToU64(room_obj, "room");
    std::optional<int32_t> dp_rank;
    if (!dp_rank_obj.is_none()) {
      dp_rank = static_cast<int32_t>(ToInt(dp_rank_obj, "prefill_dp_rank", 0, INT32_MAX));
    }
    auto receiver =
        WithManager([&](pdlib::KVManager* m) { return m->CreateReceiver(address, room, dp_rank); });
    if (!receiver.ok()) ThrowStatus(receiver.status());
    return py::cast(std::make_unique<Receiver>(state_, std::move(*receiver)));
  }

  std::shared_ptr<ManagerState> state_;
};

// A ProcessGroup whose AllReduceMin calls Python: a callable, or an object with an
// all_reduce_min(values) method, given a fresh int32 numpy array that it reduces in place or
// whose reduced values it returns. A Python exception is kept and re-raised by the caller.
class PyProcessGroup final : public pdlib::ProcessGroup {
 public:
  explicit PyProcessGroup(py::object group) : group_(std::move(group)) {
    // torch-like groups have size() and rank() methods; plain objects may have int attributes.
    size_ = Attribute("size", 2);
    rank_ = Attribute("rank", 0);
    fn_ = py::hasattr(group_, "all_reduce_min") ? group_.attr("all_reduce_min") : group_;
    if (!PyCallable_Check(fn_.ptr())) {
      ThrowType("group: expected a callable or an object with all_reduce_min(values)");
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  pdlib::Status AllReduceMin(std::span<int32_t> values) override {
    py::gil_scoped_acquire acquire;
    try {
      // A copy rather than a view of pdlib's vector: Python may keep the array after the call.
      py::array_t<int32_t> array(static_cast<py::ssize_t>(values.size()), values.data());
      py::object result = fn_(array);
      py::array_t<int32_t> reduced =
          result.is_none() ? array : py::array_t<int32_t, py::array::forcecast>(result);
      if (static_cast<size_t>(reduced.size()) != values.size()) {
        return pdlib::Status::InvalidArgument("group returned " + std::to_string(reduced.size()) +
                                              " values for " + std::to_string(values.size()) +
                                              " handles");
      }
      std::copy_n(reduced.data(), values.size(), values.data());
      return pdlib::Status::OK();
    } catch (py::error_already_set& e) {
      error_ = std::move(e);
      return pdlib::Status::Unknown("group all-reduce raised a Python exception");
    }
  }

  void RethrowIfError() {
    if (error_) {
      error_->restore();  // back into Python's error indicator, then raised from there
      error_.reset();
      throw py::error_already_set();
    }
  }

 private:
  int Attribute(const char* name, int fallback) {
    if (!py::hasattr(group_, name)) return fallback;
    py::object v = group_.attr(name);
    if (PyCallable_Check(v.ptr())) v = v();
    return v.cast<int>();
  }

  py::object group_;
  py::object fn_;
  int size_ = 2;
  int rank_ = 0;
  std::optional<py::error_already_set> error_;
};

// Stands in for a closed handle in PollAndAllReduce: answers the state it left.
class FixedPollable final : public pdlib::KVPollable {
 public:
  FixedPollable(pdlib::KVPoll state, uint64_t room) : state_(state), room_(room) {}
  pdlib::KVPoll Poll() const override { return state_; }
  pdlib::Status FailureReason() const override { return pdlib::Status::OK(); }
  uint64_t room() const override { return room_; }
  bool PagesReusable() const override { return false; }

 private:
  pdlib::KVPoll state_;
  uint64_t room_;
};

py::list PollAndAllReduce(py::sequence handles, py::object group) {
  std::vector<HandleBase*> boxes;
  boxes.reserve(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    py::object h = handles[i];
    if (!py::isinstance<HandleBase>(h)) {
      ThrowType("handles[" + std::to_string(i) + "]: expected a KVSender or KVReceiver");
    }
    boxes.push_back(h.cast<HandleBase*>());
  }
  // Count every open handle as a call in flight, so none is destroyed while the GIL is out.
  std::vector<std::unique_ptr<FixedPollable>> fixed;
  std::vector<const pdlib::KVPollable*> pollables;
  std::vector<HandleBase*> entered;
  struct ExitAll {
    std::vector<HandleBase*>* entered;
    ~ExitAll() {
      for (HandleBase* h : *entered) h->state().Exit(h);
    }
  } exit_all{&entered};
  for (HandleBase* h : boxes) {
    if (!h->closed() && h->state().Enter(h)) {
      entered.push_back(h);
      pollables.push_back(h->pollable());
    } else {
      fixed.push_back(std::make_unique<FixedPollable>(h->Poll(), h->room()));
      pollables.push_back(fixed.back().get());
    }
  }
  std::optional<PyProcessGroup> py_group;
  pdlib::ProcessGroup* pg = nullptr;
  if (py::isinstance<pdlib::ProcessGroup>(group)) {
    pg = group.cast<pdlib::ProcessGroup*>();
  } else if (!group.is_none()) {
    py_group.emplace(group);
    pg = &*py_group;
  }
  pdlib::StatusOr<std::vector<pdlib::KVPoll>> states = pdlib::Status::Internal("unset");
  {
    py::gil_scoped_release release;
    states = pdlib::PollAndAllReduce(pollables, pg);
  }
  if (py_group) py_group->RethrowIfError();
  if (!states.ok()) ThrowStatus(states.status());
  py::list out(states->size());
  for (size_t i = 0; i < states->size(); ++i) out[i] = PollObject((*states)[i]);
  return out;
}

// The counters of KVManagerMetrics, one X(name) each (failed_by_cause, a map, goes separately).
#define PDLIB_PY_SCALAR_METRICS(X) \
  X(live_rooms)                    \
  X(bootstrap_queue_size)          \
  X(transfer_queue_size)           \
  X(rooms_succeeded)               \
  X(rooms_failed)                  \
  X(bootstrap_failed_reqs)         \
  X(transfer_failed_reqs)          \
  X(bytes_transferred)             \
  X(pages_transferred)             \
  X(write_batches)                 \
  X(connections)                   \
  X(requests_total)                \
  X(transfer_latency_us_sum)       \
  X(transfer_latency_count)        \
  X(quarantined_rooms)             \
  X(quarantined_pages)             \
  X(quarantine_oldest_ms)          \
  X(quarantine_max_hold_ms)        \
  X(quarantine_released_drained)   \
  X(quarantine_released_fenced)    \
  X(quarantine_released_gone)      \
  X(fenced_connections)            \
  X(rooms_checksummed)             \
  X(rooms_checksummed_in_flight)   \
  X(checksum_mismatches)

py::dict MetricsDict(const pdlib::KVManagerMetrics& m) {
  py::dict d;
#define PDLIB_PY_METRIC(name) d[#name] = m.name;
  PDLIB_PY_SCALAR_METRICS(PDLIB_PY_METRIC)
#undef PDLIB_PY_METRIC
  d["failed_by_cause"] = m.failed_by_cause;
  d["checksum_mismatches_by_peer"] = m.checksum_mismatches_by_peer;
  return d;
}

pdlib::KVManagerMetrics MetricsFromDict(py::dict d) {
  pdlib::KVManagerMetrics m;
  auto get = [&](const char* name, uint64_t* field) {
    if (d.contains(name)) *field = ToU64(d[name], std::string("metrics['") + name + "']");
  };
#define PDLIB_PY_METRIC(name) get(#name, &m.name);
  PDLIB_PY_SCALAR_METRICS(PDLIB_PY_METRIC)
#undef PDLIB_PY_METRIC
  if (d.contains("failed_by_cause")) {
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(d["failed_by_cause"])) {
      m.failed_by_cause[py::str(k)] = ToU64(v, "metrics['failed_by_cause']");
    }
  }
  if (d.contains("checksum_mismatches_by_peer")) {
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(d["checksum_mismatches_by_peer"])) {
      m.checksum_mismatches_by_peer[py::str(k)] =
          ToU64(v, "metrics['checksum_mismatches_by_peer']");
    }
  }
  return m;
}

template <typename H>
void BindHandleCommon(py::class_<H, HandleBase>& c) {
  c.def(
      "abort",
      [](H& h, const std::string& reason) {
        if (h.closed()) return;  // Abort is idempotent; a closed handle has nothing to abort
        HandleBase::Call call(&h, "handle");
        auto* handle = h.get();  // read under the GIL: close() may take it away
        py::gil_scoped_release release;
        handle->Abort(reason);
      },
      py::arg("reason") = "aborted by the engine",
      "Fails the request with `reason` (AbortedError) and tells the peer. Idempotent.");
}

}  // namespace

void BindManager(py::module_& m) {
  py::class_<HandleBase>(m, "_Handle")
      .def(
          "poll", [](const HandleBase& h) { return PollObject(h.Poll()); },
          "The request's KVPoll state: one atomic load, no lock, GIL kept.")
      .def("pages_reusable", &HandleBase::PagesReusable,
           "True once pdlib will neither write nor read this request's pages again.")
      .def("failure_reason", &HandleBase::FailureReason,
           "None unless poll() is Failed; then the pdlib.Error saying why (raise it or read "
           "str()).")
      .def_property_readonly("room", &HandleBase::room)
      .def_property_readonly("closed", &HandleBase::closed)
      .def("close", &HandleBase::Close,
           "Destroys the C++ handle now; a request that is not terminal is aborted.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](HandleBase& h, py::args) { h.Close(); });

  py::class_<Sender, HandleBase> sender(m, "KVSender", "Prefill side of one request.");
  sender
      .def(
          "init",
          [](Sender& s, py::handle num_pages, py::handle aux_index) {
            const uint64_t n = ToU64(num_pages, "num_kv_pages");
            const std::optional<uint32_t> aux = ToOptionalSlot(aux_index, "aux_index");
            pdlib::Status st;
            {
              HandleBase::Call call(&s, "KVSender");
              pdlib::KVSender* h = s.get();
              py::gil_scoped_release release;
              st = h->Init(n, aux);
            }
            ThrowIfError(st);
          },
          py::arg("num_kv_pages"), py::arg("aux_index") = py::none())
      .def(
          "send",
          [](Sender& s, py::handle pages, bool is_last, py::handle state) {
            Indices page_span = ToIndices(pages, "kv_page_indices");
            StateIndicesArg states = ToStateIndices(state, "state_indices");
            pdlib::Status st;
            {
              HandleBase::Call call(&s, "KVSender");
              pdlib::KVSender* h = s.get();
              py::gil_scoped_release release;
              // SendStates with no counts is Send() (one family).
              st = h->SendStates(page_span.span(), is_last, states.get());
            }
            ThrowIfError(st);
          },
          py::arg("kv_page_indices"), py::arg("is_last_chunk"),
          py::arg("state_indices") = py::none(),
          "Queues one chunk of KV pages; the last chunk also sends the aux slot and the state: "
          "state_indices is one index list (one state family) or a list of lists, one per "
          "family in KVArgs.state_families order (KVSender::SendStates).")
      .def(
          "send_layers",
          [](Sender& s, py::handle pages, int32_t layers_done, bool is_last, py::handle state) {
            Indices page_span = ToIndices(pages, "kv_page_indices");
            StateIndicesArg states = ToStateIndices(state, "state_indices");
            pdlib::Status st;
            {
              HandleBase::Call call(&s, "KVSender");
              pdlib::KVSender* h = s.get();
              py::gil_scoped_release release;
              st = h->SendLayersStates(page_span.span(), layers_done, is_last, states.get());
            }
            ThrowIfError(st);
          },
          py::arg("kv_page_indices"), py::arg("layers_done"), py::arg("is_last_chunk"),
          py::arg("state_indices") = py::none(),
          "Layer-wise streaming: the first layers_done KV layers of this chunk are computed "
          "(KVSender::SendLayersStates); layers_done == num_layers completes the chunk like "
          "send(). state_indices as in send().")
      .def_property_readonly(
          "decode_prefix_len",
          [](Sender& s) -> py::object {
            std::optional<uint64_t> prefix;
            {
              HandleBase::Call call(&s, "KVSender");
              pdlib::KVSender* h = s.get();
              py::gil_scoped_release release;  // takes the room's lock
              prefix = h->decode_prefix_len();
            }
            if (!prefix) return py::none();
            return py::int_(*prefix);
          },
          "Tokens at the start of the prompt that decode already holds and prefill must not "
          "send (a multiple of page_size; 0: send every page). None until poll() reaches "
          "WaitingForInput.")
      .def(
          "pages_after_prefix",
          [](Sender& s, py::handle prompt_len_obj) {
            const uint64_t prompt_len = ToU64(prompt_len_obj, "prompt_len");
            pdlib::StatusOr<uint64_t> pages = pdlib::Status::Internal("unset");
            {
              HandleBase::Call call(&s, "KVSender");
              pdlib::KVSender* h = s.get();
              py::gil_scoped_release release;
              pages = h->PagesAfterPrefix(prompt_len);
            }
            if (!pages.ok()) ThrowStatus(pages.status());
            return *pages;
          },
          py::arg("prompt_len"),
          "The KV pages to send (and to announce in init()) for a prompt of prompt_len tokens "
          "after decode's prefix: ceil((prompt_len - prefix) / page_size). Raises "
          "FailedPreconditionError before the prefix is known, OutOfRangeError (naming both "
          "numbers) when the prefix is longer than the prompt.")
      .def_property_readonly(
          "num_layers",
          [](Sender& s) {
            HandleBase::Call call(&s, "KVSender");
            return s.get()->num_layers();
          },
          "This rank's KV layers: the layers_done that completes a chunk in send_layers().");
  BindHandleCommon(sender);

  py::class_<Receiver, HandleBase> receiver(m, "KVReceiver", "Decode side of one request.");
  receiver.def(
      "init",
      [](Receiver& r, py::handle pages, py::handle aux_index, py::handle state,
         py::handle prefix_obj, py::handle prompt_len_obj) {
        Indices page_span = ToIndices(pages, "kv_page_indices");
        StateIndicesArg states = ToStateIndices(state, "state_indices");
        pdlib::ReceiveRequest request;
        request.kv_page_indices = page_span.span();
        request.aux_index = ToOptionalSlot(aux_index, "aux_index");
        request.state = states.get();
        request.decode_prefix_len = ToU64(prefix_obj, "decode_prefix_len");
        request.prompt_len = ToU64(prompt_len_obj, "prompt_len");
        pdlib::Status st;
        {
          HandleBase::Call call(&r, "KVReceiver");
          pdlib::KVReceiver* h = r.get();
          py::gil_scoped_release release;
          st = h->Init(request);
        }
        ThrowIfError(st);
      },
      py::arg("kv_page_indices"), py::arg("aux_index") = py::none(),
      py::arg("state_indices") = py::none(), py::kw_only(), py::arg("decode_prefix_len") = 0,
      py::arg("prompt_len") = 0,
      "Hands over the destination pages of tokens [decode_prefix_len, prompt end), the aux "
      "slot and the state (one index list, or a list of lists: one per state family); "
      "decode_prefix_len: tokens decode already holds (whole pages), prompt_len: the prompt's "
      "tokens when known (0: not checked). KVReceiver::Init(ReceiveRequest).");
  receiver.def(
      "invalid_pages",
      [](Receiver& r) {
        std::vector<int32_t> pages;
        {
          HandleBase::Call call(&r, "KVReceiver");
          const pdlib::KVReceiver* h = r.get();
          py::gil_scoped_release release;  // takes the room's lock
          pages = h->InvalidPages();
        }
        return pages;
      },
      "The pages of init()'s kv_page_indices that do not hold every byte of their tokens, in "
      "init() order (KVReceiver::InvalidPages): empty while the request is live and after "
      "Success; after Failed, in pull the pages some read of which did not complete (the "
      "others hold their KV: recompute only these), in push every page. Not the aux slot or "
      "the state.");
  BindHandleCommon(receiver);

  py::class_<PyManager, std::shared_ptr<PyManager>>(m, "KVManager",
                                                    "One per engine rank; see kv_manager.h.")
      .def_static("create", &PyManager::Create, py::arg("options"))
      .def_property_readonly(
          "mode", [](PyManager& pm) { return types().mode(static_cast<int>(pm.state_->mode())); })
      .def_property_readonly(
          "bootstrap_endpoint",
          [](PyManager& pm) {
            return pm.WithManager([](pdlib::KVManager* m) { return m->bootstrap_endpoint(); });
          },
          "Prefill with start_bootstrap_server: host:port of its bootstrap server (the bound "
          "port, also when bootstrap_port was 0); '' otherwise.")
      .def_property_readonly(
          "endpoint",
          [](PyManager& pm) {
            return pm.WithManager([](pdlib::KVManager* m) { return m->endpoint(); });
          })
      .def_property_readonly("closed", [](PyManager& pm) { return pm.state_->closed(); })
      .def("create_sender", &PyManager::CreateSender, py::arg("room"))
      .def("create_receiver", &PyManager::CreateReceiver, py::arg("bootstrap"), py::arg("room"),
           py::arg("prefill_dp_rank") = py::none())
      .def("connect", &PyManager::Connect, py::arg("bootstrap"), py::arg("timeout") = 30.0,
           "Decode warm-up: connects to every prefill rank this rank needs behind `bootstrap` "
           "before the first request (KVManager::Connect); raises the reason on failure.")
      .def("metrics",
           [](PyManager& pm) {
             auto metrics = pm.WithManager([](pdlib::KVManager* m) { return m->metrics(); });
             return MetricsDict(metrics);
           })
      .def("take_reusable_rooms",
           [](PyManager& pm) {
             return pm.WithManager([](pdlib::KVManager* m) { return m->TakeReusableRooms(); });
           })
      .def(
          "close", [](PyManager& pm) { pm.state_->Close(); },
          "Fails every live request, destroys the manager; later calls raise ClosedError.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyManager& pm, py::args) { pm.state_->Close(); });

  py::class_<pdlib::ProcessGroup>(m, "ProcessGroup",
                                  "A C++ process group (InProcessGroup.create members).")
      .def_property_readonly("rank", &pdlib::ProcessGroup::rank)
      .def_property_readonly("size", &pdlib::ProcessGroup::size)
      .def("all_reduce_min", [](pdlib::ProcessGroup& g, py::array_t<int32_t> values) {
        std::vector<int32_t> v(values.data(), values.data() + values.size());
        pdlib::Status s;
        {
          py::gil_scoped_release release;
          s = g.AllReduceMin(v);
        }
        ThrowIfError(s);
        return py::array_t<int32_t>(static_cast<py::ssize_t>(v.size()), v.data());
      });
  m.def(
      "in_process_group",
      [](int size) {
        if (size < 1) ThrowStatus(pdlib::Status::InvalidArgument("group size must be >= 1"));
        auto members = pdlib::InProcessGroup::Create(size);
        py::list out;
        for (auto& member : members) out.append(py::cast(std::move(member)));
        return out;
      },
      py::arg("size"), "`size` members of a group whose ranks are threads of this process.");
  m.def("_close_all_managers", &CloseAllManagers);
  m.def("poll_and_all_reduce", &PollAndAllReduce, py::arg("handles"), py::arg("group") = py::none(),
        "Polls each handle and MIN-reduces the states across `group` (SPEC R2.4).");
  m.def(
      "render_prometheus",
      [](py::dict metrics, std::map<std::string, std::string> labels) {
        return pdlib::RenderPrometheus(MetricsFromDict(metrics), labels);
      },
      py::arg("metrics"), py::arg("labels") = std::map<std::string, std::string>{});
}

}  // namespace pdlib_py
