// pdlib-demo-fake: one prefill and one decode KVManager in one process over the fake backend,
// driving one request to Success and printing every state each side passes through. The
// smallest complete example of the API: build/release/examples/pdlib-demo-fake (`make demo` runs
// pd-demo, the disaggregated example model, not this).
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "pdlib/pdlib.h"

namespace {

// Prints a line whenever the handle's state changes; returns the current state.
pdlib::KVPoll Watch(const char* side, const pdlib::KVPollable& h, pdlib::KVPoll* last) {
  pdlib::KVPoll now = h.Poll();
  if (now != *last) {
    std::printf("  %-7s room %llu: %-15s (%d)\n", side, static_cast<unsigned long long>(h.room()),
                std::string(pdlib::KVPollName(now)).c_str(), static_cast<int>(now));
    *last = now;
  }
  return now;
}

int Fail(const char* what, const pdlib::Status& s) {
  std::printf("demo: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main() {
  constexpr int kLayers = 4, kPages = 128, kPageBytes = 16 * 8 * 128 * 2;  // 16 tok, 8 heads
  std::printf("pdlib demo: 1 prefill + 1 decode manager, backend 'fake', %d layers x K/V\n",
              kLayers);
  std::printf("backends in this build:");
  for (const auto& b : pdlib::ListBackends()) std::printf(" %s", b.c_str());
  std::printf("\n");

  // Each side's KV pools (K and V per layer) and metadata slots.
  std::vector<std::vector<uint8_t>> pools(4 * kLayers, std::vector<uint8_t>(kPages * kPageBytes));
  auto aux_p = pdlib::MetadataBuffers::Create(pdlib::MetadataBuffers::SlotCountFor(8), 0, 0);
  auto aux_d = pdlib::MetadataBuffers::Create(pdlib::MetadataBuffers::SlotCountFor(8), 0, 0);
  if (!aux_p.ok() || !aux_d.ok()) return Fail("metadata", aux_p.status());
  auto options = [&](pdlib::Mode mode, int first_pool, pdlib::MetadataBuffers& aux) {
    pdlib::KVManagerOptions o;
    o.mode = mode;
    o.control_plane = pdlib::ControlPlane::kInProcess;
    o.backend = "fake";
    o.bootstrap_port = 8998;
    for (int i = first_pool; i < first_pool + 2 * kLayers; ++i) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(pools[i].data()));
      o.args.kv.lens.push_back(pools[i].size());
      o.args.kv.item_lens.push_back(kPageBytes);
    }
    o.args.aux = aux.Describe();
    o.args.page_size = 16;
    o.args.kv_head_num = 8;
    o.args.fingerprint = {kLayers, 8, 128, 2, 1, "demo"};
    return o;
  };
  auto prefill = pdlib::KVManager::Create(options(pdlib::Mode::kPrefill, 0, **aux_p));
  if (!prefill.ok()) return Fail("prefill manager", prefill.status());
  auto decode = pdlib::KVManager::Create(options(pdlib::Mode::kDecode, 2 * kLayers, **aux_d));
  if (!decode.ok()) return Fail("decode manager", decode.status());
  std::printf("prefill rank at %s, decode at %s\n", (*prefill)->endpoint().c_str(),
              (*decode)->endpoint().c_str());

  // The router would pick a random room in [0, 2^63-1] and send it to both sides.
  const uint64_t room = 0x1234abcd;
  auto sender = (*prefill)->CreateSender(room);
  if (!sender.ok()) return Fail("CreateSender", sender.status());
  auto receiver = (*decode)->CreateReceiver({"127.0.0.1", 8998}, room);
  if (!receiver.ok()) return Fail("CreateReceiver", receiver.status());

  pdlib::KVPoll ls = pdlib::KVPoll(-1), lr = pdlib::KVPoll(-1);
  Watch("prefill", **sender, &ls);
  Watch("decode", **receiver, &lr);

  // Decode pre-allocated 5 pages and metadata slot 3 for the request.
  std::vector<int32_t> dst = {40, 41, 42, 7, 8};
  if (auto s = (*receiver)->Init(dst, 3u); !s.ok()) return Fail("receiver Init", s);
  Watch("decode", **receiver, &lr);

  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (Watch("prefill", **sender, &ls) != pdlib::KVPoll::kWaitingForInput) {
    if (std::chrono::steady_clock::now() > deadline)
      return Fail("wait", (*sender)->FailureReason());
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Prefill's forward pass produced KV in pages 1..5; chunked prefill sends it in two chunks.
  std::vector<int32_t> src = {1, 2, 3, 4, 5};
  if (auto s = (*sender)->Init(src.size(), 0u); !s.ok()) return Fail("sender Init", s);
  if (auto s = (*sender)->Send(std::span(src).first(4), false); !s.ok()) return Fail("Send", s);
  if (auto s = (*sender)->Send(std::span(src).subspan(4), true); !s.ok()) return Fail("Send", s);
  while (!pdlib::IsTerminal(Watch("prefill", **sender, &ls)) ||
         !pdlib::IsTerminal(Watch("decode", **receiver, &lr))) {
    if (std::chrono::steady_clock::now() > deadline)
      return Fail("transfer", pdlib::Status::DeadlineExceeded("10 s"));
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if ((*receiver)->Poll() != pdlib::KVPoll::kSuccess) {
    return Fail("transfer", (*receiver)->FailureReason());
  }
  auto m = (*prefill)->metrics();
  std::printf(
      "done: %llu pages, %llu bytes described in %llu write batch(es); the fake backend "
      "moves no bytes\n",
      static_cast<unsigned long long>(m.pages_transferred),
      static_cast<unsigned long long>(m.bytes_transferred),
      static_cast<unsigned long long>(m.write_batches));
  std::printf("demo: room %llu reached Success on prefill and decode\n",
              static_cast<unsigned long long>(room));
  return 0;
}
