#include "examples/hosts/reference.h"

#include <span>

#include "examples/hosts/host_rank.h"
#include "pdlib_kernels/model.h"

namespace pdlib::hosts {

StatusOr<std::vector<int32_t>> GenerateReference(const std::string& model, uint64_t seed,
                                                 const std::vector<int32_t>& prompt,
                                                 int32_t max_new_tokens) {
  using namespace pdlib::kernels;
  auto named = ModelConfigByName(model);
  if (!named.ok()) return named.status();
  const ModelConfig config = *named;
  auto weights = ModelWeights::Random(config, seed);
  if (!weights.ok()) return weights.status();
  RuntimeOptions rt;
  const int32_t tokens = static_cast<int32_t>(prompt.size()) + max_new_tokens;
  rt.num_pages = (tokens + config.page_size - 1) / config.page_size;
  rt.num_state_slots = 1;
  rt.num_threads = 1;
  auto m = Model::Create(*weights, rt);
  if (!m.ok()) return m.status();
  std::vector<int32_t> pages(static_cast<size_t>(rt.num_pages));
  for (int32_t i = 0; i < rt.num_pages; ++i) pages[static_cast<size_t>(i)] = i;
  ForwardOptions fo;
  fo.top_k = 0;
  std::vector<int32_t> out;
  SequenceChunk chunk{prompt, 0, pages, config.is_hybrid() ? 0 : -1};
  ForwardResult r;
  if (Status s = (*m)->Prefill(chunk, fo, &r); !s.ok()) return s;
  out.push_back(r.token);
  int32_t pos = static_cast<int32_t>(prompt.size());
  while (static_cast<int32_t>(out.size()) < max_new_tokens) {
    const int32_t last = out.back();
    SequenceChunk step{std::span<const int32_t>(&last, 1), pos, pages, chunk.state_slot};
    std::vector<ForwardResult> rs;
    if (Status s = (*m)->Decode(std::span<const SequenceChunk>(&step, 1), fo, &rs); !s.ok()) {
      return s;
    }
    out.push_back(rs[0].token);
    ++pos;
  }
  return out;
}

}  // namespace pdlib::hosts
