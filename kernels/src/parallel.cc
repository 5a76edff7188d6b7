#include "pdlib_kernels/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace pdlib::kernels {

std::string ModelShard::ToString() const {
  return "tp " + std::to_string(tp_rank) + "/" + std::to_string(tp_size) + " pp " +
         std::to_string(pp_rank) + "/" + std::to_string(pp_size);
}

StatusOr<ShardLayout> MakeShardLayout(const ModelConfig& config, const ModelShard& shard) {
  const int32_t tp = shard.tp_size, pp = shard.pp_size;
  if (tp < 1 || shard.tp_rank < 0 || shard.tp_rank >= tp || pp < 1 || shard.pp_rank < 0 ||
      shard.pp_rank >= pp) {
    return Status::InvalidArgument("rank " + shard.ToString() + " is out of range");
  }
  auto divides = [&](int32_t n, const char* what) -> Status {
    if (n % tp == 0) return Status::OK();
    return Status::InvalidArgument("TP " + std::to_string(tp) + " does not divide the model's " +
                                   std::to_string(n) + " " + what);
  };
  if (Status s = divides(config.num_heads, "query heads"); !s.ok()) return s;
  if (Status s = divides(config.hidden_size, "hidden units"); !s.ok()) return s;
  if (Status s = divides(config.intermediate_size, "intermediate units"); !s.ok()) return s;
  const int32_t kv_heads = config.num_kv_heads;
  if (!config.is_mla() && kv_heads % tp != 0 && tp % kv_heads != 0) {
    return Status::InvalidArgument("TP " + std::to_string(tp) + " and the model's " +
                                   std::to_string(kv_heads) +
                                   " KV heads must divide one another (every rank holds whole "
                                   "heads, replicated when TP exceeds the KV heads)");
  }
  if (pp > config.num_layers) {
    return Status::InvalidArgument("PP " + std::to_string(pp) + " exceeds the model's " +
                                   std::to_string(config.num_layers) + " layers");
  }
  ShardLayout s;
  s.shard = shard;
  s.first_layer = shard.pp_rank * config.num_layers / pp;
  s.end_layer = (shard.pp_rank + 1) * config.num_layers / pp;
  for (int32_t layer = 0; layer < s.end_layer; ++layer) {
    int32_t* before = nullptr;
    int32_t* inside = nullptr;
    switch (config.layer_kind(layer)) {
      case LayerKind::kAttention: before = &s.kv_start, inside = &s.kv_count; break;
      case LayerKind::kSlidingWindow: before = &s.swa_start, inside = &s.swa_count; break;
      case LayerKind::kRecurrent: before = &s.state_start, inside = &s.state_count; break;
    }
    *(layer < s.first_layer ? before : inside) += 1;
  }
  if (s.kv_count == 0) {
    return Status::InvalidArgument(
        "PP stage " + std::to_string(shard.pp_rank) + " of " + std::to_string(pp) +
        " owns layers [" + std::to_string(s.first_layer) + ", " + std::to_string(s.end_layer) +
        ") and none of them is a full attention layer; pdlib needs KV in every stage (use a "
        "smaller PP)");
  }
  s.q_head_count = config.num_heads / tp;
  s.q_head_start = shard.tp_rank * s.q_head_count;
  if (config.is_mla()) {
    s.kv_head_start = 0;
    s.kv_head_count = 1;
  } else if (kv_heads >= tp) {
    s.kv_head_count = kv_heads / tp;
    s.kv_head_start = shard.tp_rank * s.kv_head_count;
  } else {
    s.kv_head_count = 1;
    s.kv_head_start = shard.tp_rank / (tp / kv_heads);
  }
  s.inter_count = config.intermediate_size / tp;
  s.inter_start = shard.tp_rank * s.inter_count;
  s.out_count = config.hidden_size / tp;
  s.out_start = shard.tp_rank * s.out_count;
  return s;
}

ModelConfig ShardCacheConfig(const ModelConfig& config, const ShardLayout& layout) {
  ModelConfig c = config;
  c.num_layers = layout.end_layer - layout.first_layer;
  if (!config.layer_kinds.empty()) {
    c.layer_kinds.assign(config.layer_kinds.begin() + layout.first_layer,
                         config.layer_kinds.begin() + layout.end_layer);
  }
  c.num_heads = layout.q_head_count;
  c.num_kv_heads = layout.kv_head_count;
  return c;
}

namespace {

// The shared state of one in-process group: a generation-counted rendezvous per TP group for
// AllGather, a one-slot mailbox per (stage boundary, TP rank) for the PP hand-offs, and one per
// TP column for the broadcast. Plain mutex and condition variable so ThreadSanitizer sees every
// edge.
class InProcessShared {
 public:
  InProcessShared(int32_t tp, int32_t pp)
      : tp_(tp),
        pp_(pp),
        gathers_(static_cast<size_t>(pp)),
        hands_(static_cast<size_t>(tp * pp)),
        casts_(static_cast<size_t>(tp)) {
    for (Gather& g : gathers_) g.parts.resize(static_cast<size_t>(tp));
    for (Cast& c : casts_) c.taken.resize(static_cast<size_t>(pp));
  }

  Status AllGather(const ModelShard& me, std::span<const float> mine, std::span<float> all) {
    if (all.size() != mine.size() * static_cast<size_t>(tp_)) {
      return Status::InvalidArgument("AllGather: " + std::to_string(all.size()) +
                                     " output values for " + std::to_string(tp_) + " ranks of " +
                                     std::to_string(mine.size()));
    }
    std::unique_lock lock(mu_);
    Gather& g = gathers_[static_cast<size_t>(me.pp_rank)];
    // Wait until the previous round has been read by everyone.
    cv_.wait(lock, [&] { return !abort_.ok() || !g.draining; });
    if (!abort_.ok()) return abort_;
    const uint64_t round = g.round;
    g.parts[static_cast<size_t>(me.tp_rank)] = mine;
    if (++g.arrived == tp_) {
      g.draining = true;
      g.left = tp_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return !abort_.ok() || (g.round == round && g.draining); });
      if (!abort_.ok()) return abort_;
    }
    for (int32_t r = 0; r < tp_; ++r) {
      const std::span<const float> part = g.parts[static_cast<size_t>(r)];
      if (part.size() != mine.size()) {
        Fail(Status::Internal("AllGather: rank " + std::to_string(r) + " passed " +
                              std::to_string(part.size()) + " values, rank " +
                              std::to_string(me.tp_rank) + " " + std::to_string(mine.size())));
        return abort_;
      }
      std::copy(part.begin(), part.end(), all.begin() + static_cast<ptrdiff_t>(r) * part.size());
    }
    if (--g.left == 0) {
      g.arrived = 0;
      g.draining = false;
      ++g.round;
      cv_.notify_all();
    } else {
      // Every rank must have copied before any rank's `mine` may change: wait for the round.
      cv_.wait(lock, [&] { return !abort_.ok() || g.round != round; });
      if (!abort_.ok()) return abort_;
    }
    return Status::OK();
  }

  Status Send(const ModelShard& me, std::span<const float> data) {
    if (me.pp_rank + 1 >= pp_)
      return Status::FailedPrecondition("SendToNextStage on the last stage");
    std::unique_lock lock(mu_);
    Hand& h = hands_[static_cast<size_t>(me.index())];
    cv_.wait(lock, [&] { return !abort_.ok() || !h.full; });
    if (!abort_.ok()) return abort_;
    h.data.assign(data.begin(), data.end());
    h.full = true;
    cv_.notify_all();
    return Status::OK();
  }

  Status Receive(const ModelShard& me, std::span<float> data) {
    if (me.pp_rank == 0) return Status::FailedPrecondition("ReceiveFromPreviousStage on stage 0");
    std::unique_lock lock(mu_);
    Hand& h = hands_[static_cast<size_t>(me.index() - tp_)];
    cv_.wait(lock, [&] { return !abort_.ok() || h.full; });
    if (!abort_.ok()) return abort_;
    if (h.data.size() != data.size()) {
      Fail(Status::Internal("stage " + std::to_string(me.pp_rank - 1) + " sent " +
                            std::to_string(h.data.size()) + " values; stage " +
                            std::to_string(me.pp_rank) + " expected " +
                            std::to_string(data.size())));
      return abort_;
    }
    std::copy(h.data.begin(), h.data.end(), data.begin());
    h.full = false;
    cv_.notify_all();
    return Status::OK();
  }

  Status Broadcast(const ModelShard& me, std::vector<std::byte>* bytes) {
    if (pp_ == 1) return Status::OK();
    std::unique_lock lock(mu_);
    Cast& c = casts_[static_cast<size_t>(me.tp_rank)];
    if (me.pp_rank == pp_ - 1) {
      cv_.wait(lock, [&] { return !abort_.ok() || c.left == 0; });
      if (!abort_.ok()) return abort_;
      c.bytes = *bytes;
      c.left = pp_ - 1;
      ++c.round;
      cv_.notify_all();
      return Status::OK();
    }
    // An earlier stage takes round `seen + 1`, the next one the last stage publishes.
    const uint64_t want = c.taken[static_cast<size_t>(me.pp_rank)] + 1;
    cv_.wait(lock, [&] { return !abort_.ok() || c.round >= want; });
    if (!abort_.ok()) return abort_;
    *bytes = c.bytes;
    c.taken[static_cast<size_t>(me.pp_rank)] = want;
    --c.left;
    cv_.notify_all();
    return Status::OK();
  }

  void Fail(const Status& why) {  // mu_ held by the caller or not: see Abort
    if (abort_.ok()) abort_ = why.ok() ? Status::Aborted("model group aborted") : why;
    cv_.notify_all();
  }

  void Abort(const Status& why) {
    std::lock_guard lock(mu_);
    Fail(why);
  }

 private:
  struct Gather {
    std::vector<std::span<const float>> parts;
    int32_t arrived = 0;
    int32_t left = 0;
    bool draining = false;
    uint64_t round = 0;
  };
  struct Hand {
    std::vector<float> data;
    bool full = false;
  };
  struct Cast {
    std::vector<std::byte> bytes;
    int32_t left = 0;
    uint64_t round = 0;
    std::vector<uint64_t> taken;  // per stage: the last round it took
  };

  const int32_t tp_, pp_;
  std::mutex mu_;
  std::condition_variable cv_;
  Status abort_;
  std::vector<Gather> gathers_;
  std::vector<Hand> hands_;
  std::vector<Cast> casts_;
};

class InProcessComm final : public ModelComm {
 public:
  InProcessComm(std::shared_ptr<InProcessShared> shared, ModelShard me)
      : shared_(std::move(shared)), me_(me) {}
  Status AllGather(std::span<const float> mine, std::span<float> all) override {
    return shared_->AllGather(me_, mine, all);
  }
  Status SendToNextStage(std::span<const float> data) override { return shared_->Send(me_, data); }
  Status ReceiveFromPreviousStage(std::span<float> data) override {
    return shared_->Receive(me_, data);
  }
  Status BroadcastFromLastStage(std::vector<std::byte>* bytes) override {
    return shared_->Broadcast(me_, bytes);
  }
  void Abort(const Status& why) override { shared_->Abort(why); }

 private:
  std::shared_ptr<InProcessShared> shared_;
  ModelShard me_;
};

}  // namespace

std::vector<std::unique_ptr<ModelComm>> CreateInProcessModelComms(int32_t tp_size,
                                                                  int32_t pp_size) {
  std::vector<std::unique_ptr<ModelComm>> out;
  if (tp_size < 1 || pp_size < 1) return out;
  auto shared = std::make_shared<InProcessShared>(tp_size, pp_size);
  for (int32_t p = 0; p < pp_size; ++p) {
    for (int32_t t = 0; t < tp_size; ++t) {
      out.push_back(std::make_unique<InProcessComm>(shared, ModelShard{tp_size, t, pp_size, p}));
    }
  }
  return out;
}

}  // namespace pdlib::kernels
