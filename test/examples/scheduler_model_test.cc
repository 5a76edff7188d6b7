// The prefill and decode schedulers together over the example model (kernels/, CPU): prefill
// computes real KV in chunks, a loopback transport copies the sent pages, the metadata slot and
// the state (a recurrent-state slot, or the sliding-window pages the schedulers name) into the
// decode model's memory as pdlib would, and decode continues, retracting under memory pressure
// (so OffloadKV/RestoreKV cover GQA, MLA's latent pools and the SWA pools). Every output must
// equal a colocated run token for token.
#include <catch2/catch.hpp>
#include <map>
#include <memory>

#include "examples/scheduler/decode_scheduler.h"
#include "examples/scheduler/kernels_runner.h"
#include "examples/scheduler/prefill_scheduler.h"
#include "pdlib_kernels/model.h"
#include "scheduler_fakes.h"

namespace pdlib::sched {
namespace {

using testing::FakeHandle;
using testing::HandleState;

// Moves bytes between two models' memories, in the order pdlib does: KV pages of every chunk,
// then (last chunk) the metadata slot and the state, then Success on both sides.
class Loopback final : public SenderFactory, public ReceiverFactory {
 public:
  Loopback(kernels::Model* src, MetadataBuffers* src_meta, kernels::Model* dst,
           MetadataBuffers* dst_meta)
      : src_(src), src_meta_(src_meta), dst_(dst), dst_meta_(dst_meta) {}

  struct Room {
    std::shared_ptr<HandleState> sender = std::make_shared<HandleState>();
    std::shared_ptr<HandleState> receiver = std::make_shared<HandleState>();
    size_t pages_done = 0;
  };

  class Sender final : public FakeHandle<KVSender> {
   public:
    Sender(uint64_t room, Loopback* lb) : FakeHandle(room, lb->rooms_[room].sender), lb_(lb) {}
    Status Init(uint64_t, std::optional<uint32_t> aux) override {
      s_->aux = aux;
      return Status::OK();
    }
    Status Send(std::span<const int32_t> pages, bool last,
                std::span<const int32_t> state) override {
      return lb_->Copy(room_, pages, last, state);
    }

   private:
    Loopback* lb_;
  };
  class Receiver final : public FakeHandle<KVReceiver> {
   public:
    Receiver(uint64_t room, Loopback* lb) : FakeHandle(room, lb->rooms_[room].receiver), lb_(lb) {
      s_->state = KVPoll::kWaitingForInput;  // connected at once
    }
    using KVReceiver::Init;
    Status Init(const ReceiveRequest& request) override {
      s_->init_called = true;
      s_->init_pages.assign(request.kv_page_indices.begin(), request.kv_page_indices.end());
      s_->aux = request.aux_index;
      s_->state_indices.assign(request.state.indices.begin(), request.state.indices.end());
      lb_->rooms_[room_].sender->state = KVPoll::kWaitingForInput;  // TransferInfo arrived
      return Status::OK();
    }

   private:
    Loopback* lb_;
  };

  StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) override {
    return std::unique_ptr<KVSender>(new Sender(room, this));
  }
  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(const BootstrapAddress&, uint64_t room,
                                                       std::optional<int32_t>) override {
    return std::unique_ptr<KVReceiver>(new Receiver(room, this));
  }

 private:
  Status Copy(uint64_t room, std::span<const int32_t> pages, bool last,
              std::span<const int32_t> state) {
    Room& r = rooms_[room];
    const HandleState& dst = *r.receiver;
    if (r.pages_done + pages.size() > dst.init_pages.size()) {
      return Status::OutOfRange("more pages sent than decode allocated");
    }
    kernels::KVCache& sc = src_->kv_cache();
    kernels::KVCache& dc = dst_->kv_cache();
    for (int32_t layer = 0; layer < sc.num_kv_layers(); ++layer) {
      for (auto kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
        if (sc.pool(kind, layer).item_bytes == 0) continue;  // MLA: no V pool
        std::vector<std::byte> page(sc.pool(kind, layer).item_bytes);
        for (size_t i = 0; i < pages.size(); ++i) {
          if (Status s = sc.ReadPage(kind, layer, pages[i], page); !s.ok()) return s;
          if (Status s = dc.WritePage(kind, layer, dst.init_pages[r.pages_done + i], page);
              !s.ok()) {
            return s;
          }
        }
      }
    }
    r.pages_done += pages.size();
    if (!last) return Status::OK();
    auto slot = src_meta_->ReadSlot(*r.sender->aux);
    if (!slot.ok()) return slot.status();
    if (Status s = dst_meta_->WriteSlot(*dst.aux, *slot); !s.ok()) return s;
    if (sc.num_swa_layers() > 0) {
      // StateType::kSwa: the window pages, prefill's page-table entries to decode's.
      expected_swa_pages_[room] = state.size();
      if (state.size() != dst.state_indices.size()) {
        return Status::InvalidArgument("SWA state: prefill sent " + std::to_string(state.size()) +
                                       " pages, decode named " +
                                       std::to_string(dst.state_indices.size()));
      }
      for (int32_t layer = 0; layer < sc.num_swa_layers(); ++layer) {
        for (auto kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
          std::vector<std::byte> page(sc.swa_pool(kind, layer).item_bytes);
          for (size_t i = 0; i < state.size(); ++i) {
            if (Status s = sc.ReadSwaPage(kind, layer, state[i], page); !s.ok()) return s;
            if (Status s = dc.WriteSwaPage(kind, layer, dst.state_indices[i], page); !s.ok()) {
              return s;
            }
          }
        }
      }
    } else if (!state.empty()) {
      std::vector<float> values(static_cast<size_t>(sc.config().state_dim()));
      for (int32_t layer = 0; layer < sc.num_state_layers(); ++layer) {
        if (Status s = sc.ReadState(layer, state[0], values); !s.ok()) return s;
        if (Status s = dc.WriteState(layer, dst.state_indices.at(0), values); !s.ok()) return s;
      }
    }
    r.sender->state = KVPoll::kSuccess;
    r.receiver->state = KVPoll::kSuccess;
    return Status::OK();
  }

  kernels::Model* src_;
  MetadataBuffers* src_meta_;
  kernels::Model* dst_;
  MetadataBuffers* dst_meta_;
  std::map<uint64_t, Room> rooms_;

 public:
  std::map<uint64_t, size_t> expected_swa_pages_;  // window pages sent per room
};

enum class Variant { kGqa, kHybrid, kMla, kSwa };

kernels::ModelConfig TinyConfig(Variant v) {
  kernels::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 32;
  c.intermediate_size = 128;
  c.vocab_size = 64;
  c.page_size = 4;
  if (v == Variant::kHybrid) {
    c.layer_kinds = {kernels::LayerKind::kAttention, kernels::LayerKind::kRecurrent};
  } else if (v == Variant::kMla) {
    c.attention = kernels::AttentionKind::kMla;
    c.kv_lora_rank = 16;
    c.qk_rope_dim = 8;
  } else if (v == Variant::kSwa) {
    // A window of 6 positions over pages of 4: windows start inside pages.
    c.layer_kinds = {kernels::LayerKind::kAttention, kernels::LayerKind::kSlidingWindow};
    c.sliding_window = 6;
  }
  return c;
}

std::unique_ptr<kernels::Model> MakeModel(const kernels::ModelWeights& w, int32_t pages,
                                          int32_t state_slots) {
  kernels::RuntimeOptions o;
  o.num_pages = pages;
  o.num_state_slots = state_slots;
  o.num_threads = 1;
  auto m = kernels::Model::Create(w, o);
  REQUIRE(m.ok());
  return std::move(*m);
}

// Greedy generation in one model: prefill the whole prompt, then one token per step.
std::vector<int32_t> Colocated(const kernels::ModelWeights& w, bool hybrid,
                               const std::vector<int32_t>& prompt, int32_t max_new) {
  auto model = MakeModel(w, 64, 1);
  std::vector<int32_t> pages;
  for (int32_t i = 0; i < 64; ++i) pages.push_back(i);
  kernels::ForwardResult r;
  const int32_t slot = hybrid ? 0 : -1;
  REQUIRE(model->Prefill({prompt, 0, pages, slot}, {}, &r).ok());
  std::vector<int32_t> out = {r.token};
  int32_t pos = static_cast<int32_t>(prompt.size());
  while (static_cast<int32_t>(out.size()) < max_new) {
    std::vector<int32_t> tok = {out.back()};
    std::vector<kernels::SequenceChunk> batch = {{tok, pos++, pages, slot}};
    std::vector<kernels::ForwardResult> res;
    REQUIRE(model->Decode(batch, {}, &res).ok());
    out.push_back(res[0].token);
  }
  return out;
}

void RunDisaggregated(Variant variant) {
  const bool hybrid = variant == Variant::kHybrid;
  const kernels::ModelConfig config = TinyConfig(variant);
  auto weights = kernels::ModelWeights::Random(config, /*seed=*/7);
  REQUIRE(weights.ok());
  const int32_t state_slots = hybrid ? 8 : 0;
  auto prefill_model = MakeModel(*weights, 32, std::max(state_slots, 1));
  auto decode_model = MakeModel(*weights, 12, std::max(state_slots, 1));  // 48 tokens: tight
  auto prefill_meta = std::move(*MetadataBuffers::Create(16, 0, 0));
  auto decode_meta = std::move(*MetadataBuffers::Create(16, 0, 0));
  Loopback loopback(prefill_model.get(), prefill_meta.get(), decode_model.get(), decode_meta.get());
  KernelsModelRunner prefill_runner(prefill_model.get()), decode_runner(decode_model.get());
  PageAllocator prefill_pages(32, config.page_size), decode_pages(12, config.page_size);

  PrefillSchedulerOptions po;
  po.chunked_prefill_size = 10;  // prompts of 9..15 tokens are chunked
  po.num_state_slots = state_slots;
  po.sliding_window = config.sliding_window;
  auto prefill = PrefillScheduler::Create(
      po, {&prefill_pages, prefill_meta.get(), &loopback, &prefill_runner});
  REQUIRE(prefill.ok());
  DecodeSchedulerOptions dop;
  dop.max_running_requests = 4;
  dop.pre_alloc_size = 4;
  dop.reserved_decode_tokens = 0;
  dop.num_state_slots = state_slots;
  dop.sliding_window = config.sliding_window;
  dop.vocab_size = config.vocab_size;
  auto decode =
      DecodeScheduler::Create(dop, {&decode_pages, decode_meta.get(), &loopback, &decode_runner});
  REQUIRE(decode.ok());

  std::map<uint64_t, Request> requests;
  for (uint64_t room = 1; room <= 4; ++room) {
    Request r;
    r.room = room * 1000 + 7;
    for (uint64_t i = 0; i < 8 + 2 * room; ++i)
      r.prompt.push_back(static_cast<int32_t>((room * 13 + i * 5) % 64));
    r.max_new_tokens = 12;
    REQUIRE((*decode)->AddRequest(r).ok());
    REQUIRE((*prefill)->AddRequest(r).ok());
    requests[r.room] = r;
  }
  std::map<uint64_t, FinishedRequest> done;
  for (int i = 0; i < 500 && !((*decode)->idle() && (*prefill)->idle()); ++i) {
    REQUIRE((*decode)->Step().ok());
    REQUIRE((*prefill)->Step().ok());
    for (auto& f : (*prefill)->TakeFinished()) REQUIRE(f.status.ok());
    for (auto& f : (*decode)->TakeFinished()) done[f.room] = std::move(f);
  }
  REQUIRE(done.size() == 4);
  for (auto& [room, f] : done) {
    INFO("room " << room << ": " << f.status.ToString());
    REQUIRE(f.status.ok());
    CHECK(f.output_ids == Colocated(*weights, hybrid, requests[room].prompt, 12));
    if (variant == Variant::kSwa) {
      // The window pages of the prompt, as the model defines them.
      const auto range =
          config.SlidingWindowPages(static_cast<int64_t>(requests[room].prompt.size()));
      CHECK(loopback.expected_swa_pages_[room] == static_cast<size_t>(range.end - range.first));
    }
  }
  CHECK((*decode)->metrics().retracted_reqs > 0);  // the tight decode cache forced retractions
  CHECK(decode_pages.free_pages() == 12);
  CHECK(prefill_pages.free_pages() == 32);
}

}  // namespace

TEST_CASE("scheduler: 1P1D over the CPU model equals a colocated run, with retraction") {
  RunDisaggregated(Variant::kGqa);
}

TEST_CASE("scheduler: hybrid model (recurrent state) 1P1D equals a colocated run") {
  RunDisaggregated(Variant::kHybrid);
}

TEST_CASE("scheduler: MLA model (latent pools only) 1P1D equals a colocated run, with retraction") {
  RunDisaggregated(Variant::kMla);
}

TEST_CASE("scheduler: sliding-window model 1P1D moves the window pages, with retraction") {
  RunDisaggregated(Variant::kSwa);
}

TEST_CASE("scheduler: SlidingWindowPages is the model's") {
  for (int32_t window : {0, 1, 2, 6, 24, 100}) {
    for (int32_t page_size : {1, 4, 16}) {
      kernels::ModelConfig c;
      c.sliding_window = window;
      c.page_size = page_size;
      for (int64_t n = 0; n < 80; ++n) {
        INFO("window " << window << " page_size " << page_size << " tokens " << n);
        const PageRange got = SlidingWindowPages(n, window, page_size);
        const auto want = c.SlidingWindowPages(n);
        CHECK(got.first == want.first);
        CHECK(got.end == want.end);
      }
    }
  }
}

}  // namespace pdlib::sched
