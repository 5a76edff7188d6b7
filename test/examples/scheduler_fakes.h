// Fakes for the scheduler tests: pdlib handles whose state the test sets, and a model whose
// "KV" is the token ids themselves, stored in pages, so that a wrong page, a lost page or a bad
// retraction round trip changes the tokens it generates.
#ifndef PDLIB_TEST_EXAMPLES_SCHEDULER_FAKES_H_
#define PDLIB_TEST_EXAMPLES_SCHEDULER_FAKES_H_

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "examples/scheduler/engine.h"
#include "pdlib/metadata_buffers.h"

namespace pdlib::sched::testing {

// What the test sees of one handle, shared with the handle the scheduler owns.
struct HandleState {
  KVPoll state = KVPoll::kBootstrapping;
  Status reason;
  int polls = 0;
  bool destroyed = false;
  // KVSender::Init / KVReceiver::Init arguments.
  bool init_called = false;
  uint64_t init_num_pages = 0;
  std::optional<uint32_t> aux;
  std::vector<int32_t> init_pages;
  std::vector<int32_t> state_indices;
  uint64_t decode_prefix_len = 0;  // what Init() was given
  // A sender's view: pull lets Send/SendLayers come before WaitingForInput (the pages are
  // published for decode to read); sender_prefix is what decode_prefix_len() reports once the
  // handle is past Bootstrapping.
  bool pull = false;
  uint64_t sender_prefix = 0;
  // KVSender::Send calls.
  struct SendCall {
    std::vector<int32_t> pages;
    bool last;
    std::vector<int32_t> state;
  };
  std::vector<SendCall> sends;
  // KVSender::SendLayers calls (layer-wise streaming), in order; `sends_before` is how many
  // Send() calls had been made then. num_layers is what the sender reports (0: no streaming).
  struct LayerCall {
    std::vector<int32_t> pages;
    int32_t layers;
    bool last;
    size_t sends_before;
  };
  std::vector<LayerCall> layer_sends;
  int32_t num_layers = 0;
  Status layer_error;  // when set, SendLayers (below num_layers) returns it

  // When set, KVSender::Init / Send and KVReceiver::Init return it (a call refused on this rank
  // only) and record nothing.
  Status call_error;

  // pdlib's page-reuse answer for a failed handle (Success is always reusable).
  bool reusable = false;
  // Abort() leaves the pages quarantined (a peer may still have a write in flight) instead of
  // reusable at once.
  bool abort_quarantines = false;

  // Fails the handle; its pages are reusable at once unless `quarantined`.
  void Fail(const std::string& why, bool quarantined = false) {
    state = KVPoll::kFailed;
    reason = Status::Unavailable(why);
    reusable = !quarantined;
  }
};

template <typename Base>
class FakeHandle : public Base {
 public:
  FakeHandle(uint64_t room, std::shared_ptr<HandleState> s) : room_(room), s_(std::move(s)) {}
  ~FakeHandle() override { s_->destroyed = true; }
  KVPoll Poll() const override {
    ++s_->polls;
    return s_->state;
  }
  Status FailureReason() const override { return s_->reason; }
  uint64_t room() const override { return room_; }
  bool PagesReusable() const override {
    return s_->state == KVPoll::kSuccess || (s_->state == KVPoll::kFailed && s_->reusable);
  }
  void Abort(std::string_view reason) override {
    if (!IsTerminal(s_->state)) {
      s_->state = KVPoll::kFailed;
      s_->reason = Status::Aborted(reason);
      s_->reusable = !s_->abort_quarantines;
    }
  }

 protected:
  uint64_t room_;
  std::shared_ptr<HandleState> s_;
};

class FakeSender final : public FakeHandle<KVSender> {
 public:
  using FakeHandle::FakeHandle;
  Status Init(uint64_t num_kv_pages, std::optional<uint32_t> aux_index) override {
    if (!s_->call_error.ok()) return s_->call_error;
    s_->init_called = true;
    s_->init_num_pages = num_kv_pages;
    s_->aux = aux_index;
    return Status::OK();
  }
  Status Send(std::span<const int32_t> pages, bool is_last_chunk,
              std::span<const int32_t> state_indices) override {
    if (!s_->call_error.ok()) return s_->call_error;
    if (s_->state < KVPoll::kWaitingForInput && !s_->pull) {
      return Status::FailedPrecondition("not bootstrapped");
    }
    s_->sends.push_back({{pages.begin(), pages.end()},
                         is_last_chunk,
                         {state_indices.begin(), state_indices.end()}});
    return Status::OK();
  }
  Status SendLayers(std::span<const int32_t> pages, int32_t layers_done, bool is_last_chunk,
                    std::span<const int32_t> state_indices) override {
    if (layers_done == s_->num_layers) return Send(pages, is_last_chunk, state_indices);
    if (!s_->layer_error.ok()) return s_->layer_error;
    if (s_->state < KVPoll::kWaitingForInput && !s_->pull) {
      return Status::FailedPrecondition("not bootstrapped");
    }
    s_->layer_sends.push_back(
        {{pages.begin(), pages.end()}, layers_done, is_last_chunk, s_->sends.size()});
    return Status::OK();
  }
  int32_t num_layers() const override { return s_->num_layers; }
  std::optional<uint64_t> decode_prefix_len() const override {
    if (s_->state == KVPoll::kBootstrapping) return std::nullopt;
    return s_->sender_prefix;
  }
};

class FakeReceiver final : public FakeHandle<KVReceiver> {
 public:
  using FakeHandle::FakeHandle;
  using KVReceiver::Init;
  Status Init(const ReceiveRequest& request) override {
    if (!s_->call_error.ok()) return s_->call_error;
    if (s_->init_called) return Status::FailedPrecondition("Init called twice");
    s_->init_called = true;
    s_->init_pages.assign(request.kv_page_indices.begin(), request.kv_page_indices.end());
    s_->aux = request.aux_index;
    s_->state_indices.assign(request.state.indices.begin(), request.state.indices.end());
    s_->decode_prefix_len = request.decode_prefix_len;
    return Status::OK();
  }
};

class FakeTransport final : public SenderFactory, public ReceiverFactory {
 public:
  StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) override {
    return std::unique_ptr<KVSender>(new FakeSender(room, NewState(room)));
  }
  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(const BootstrapAddress&, uint64_t room,
                                                       std::optional<int32_t>) override {
    return std::unique_ptr<KVReceiver>(new FakeReceiver(room, NewState(room)));
  }
  HandleState& operator[](uint64_t room) { return *handles.at(room); }
  std::map<uint64_t, std::shared_ptr<HandleState>> handles;

 private:
  std::shared_ptr<HandleState> NewState(uint64_t room) {
    auto s = std::make_shared<HandleState>();
    handles[room] = s;
    return s;
  }
};

// The next token is a hash of every token stored for the request (read back from its pages),
// so it depends on the whole KV being where the page table says.
inline int32_t NextToken(const std::vector<int32_t>& seq, int32_t vocab) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : seq) h = (h ^ static_cast<uint64_t>(t + 1)) * 1099511628211ull;
  return static_cast<int32_t>(h % static_cast<uint64_t>(vocab));
}

// What a colocated run generates: the first token after the prompt, then one per step.
inline std::vector<int32_t> ReferenceOutput(std::vector<int32_t> seq, int32_t max_new,
                                            int32_t vocab) {
  std::vector<int32_t> out;
  while (static_cast<int32_t>(out.size()) < max_new) {
    out.push_back(NextToken(seq, vocab));
    seq.push_back(out.back());
  }
  return out;
}

class FakeModel final : public ModelRunner {
 public:
  FakeModel(int32_t num_pages, int32_t page_size, int32_t vocab = 50)
      : page_size_(page_size), vocab_(vocab), kv_(static_cast<size_t>(num_pages * page_size), -1) {}

  // With kv_layers > 0, ForwardStreaming reports layers 1..kv_layers once the chunks' "KV"
  // is stored.
  int32_t kv_layers = 0;
  Status ForwardStreaming(std::span<const ForwardChunk> batch,
                          const std::function<void(int32_t)>& kv_layers_done,
                          std::vector<ForwardOutput>* out) override {
    Status s = Forward(batch, out);
    for (int32_t l = 1; s.ok() && kv_layers_done && l <= kv_layers; ++l) kv_layers_done(l);
    return s;
  }

  Status Forward(std::span<const ForwardChunk> batch, std::vector<ForwardOutput>* out) override {
    batches.emplace_back();
    out->clear();
    for (const ForwardChunk& c : batch) {
      batches.back().push_back({c.room, c.start_pos, static_cast<int32_t>(c.tokens.size())});
      for (size_t i = 0; i < c.tokens.size(); ++i) {
        int32_t* cell = Cell(c.page_table, c.start_pos + static_cast<int32_t>(i));
        if (cell == nullptr) return Status::OutOfRange("page table too short");
        *cell = c.tokens[i];
      }
      std::vector<int32_t> seq;
      for (int32_t p = 0; p < c.start_pos + static_cast<int32_t>(c.tokens.size()); ++p) {
        seq.push_back(*Cell(c.page_table, p));
      }
      const int32_t token = NextToken(seq, vocab_);
      out->push_back({.token = token,
                      .logprob = -0.5f,
                      .top_ids = {token, (token + 1) % vocab_},
                      .top_logprobs = {-0.5f, -1.5f}});
    }
    return Status::OK();
  }

  StatusOr<HostKV> OffloadKV(std::span<const int32_t> page_table, int64_t num_tokens,
                             int32_t state_slot) override {
    HostKV kv;
    kv.num_tokens = num_tokens;
    for (int32_t p = 0; p < num_tokens; ++p) {
      int32_t* cell = Cell(page_table, p);
      if (cell == nullptr) return Status::OutOfRange("offload: page table too short");
      const auto* b = reinterpret_cast<const std::byte*>(cell);
      kv.bytes.insert(kv.bytes.end(), b, b + sizeof(int32_t));
      *cell = -7;  // the pages are about to be reused: scribble, so a skipped restore shows
    }
    ++offloads;
    return kv;
  }

  Status RestoreKV(const HostKV& kv, std::span<const int32_t> page_table,
                   int32_t state_slot) override {
    for (int32_t p = 0; p < kv.num_tokens; ++p) {
      int32_t* cell = Cell(page_table, p);
      if (cell == nullptr) return Status::OutOfRange("restore: page table too short");
      std::memcpy(cell, kv.bytes.data() + static_cast<size_t>(p) * sizeof(int32_t),
                  sizeof(int32_t));
    }
    ++restores;
    return Status::OK();
  }

  // Plays prefill's part for a decode test: writes the prompt's "KV" into the receiver's pages.
  void WritePrompt(std::span<const int32_t> page_table, const std::vector<int32_t>& prompt) {
    for (size_t p = 0; p < prompt.size(); ++p)
      *Cell(page_table, static_cast<int32_t>(p)) = prompt[p];
  }

  struct Entry {
    uint64_t room;
    int32_t start_pos;
    int32_t tokens;
  };
  std::vector<std::vector<Entry>> batches;
  int offloads = 0, restores = 0;
  int32_t vocab() const { return vocab_; }

 private:
  int32_t* Cell(std::span<const int32_t> page_table, int32_t pos) {
    const size_t page = static_cast<size_t>(pos / page_size_);
    if (page >= page_table.size()) return nullptr;
    return &kv_[static_cast<size_t>(page_table[page] * page_size_ + pos % page_size_)];
  }
  int32_t page_size_;
  int32_t vocab_;
  std::vector<int32_t> kv_;
};

}  // namespace pdlib::sched::testing

#endif  // PDLIB_TEST_EXAMPLES_SCHEDULER_FAKES_H_
