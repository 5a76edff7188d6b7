// Uses only the installed public headers: one request through a prefill and a decode manager
// over the fake backend.
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "pdlib/pdlib.h"

int main() {
  std::vector<char> kv(1 << 16), kv2(1 << 16);
  pdlib::KVManagerOptions p;
  p.mode = pdlib::Mode::kPrefill;
  p.control_plane = pdlib::ControlPlane::kInProcess;
  p.bootstrap_port = 9100;
  p.args.kv = {{reinterpret_cast<uint64_t>(kv.data())}, {kv.size()}, {4096}};
  p.args.page_size = 16;
  pdlib::KVManagerOptions d = p;
  d.mode = pdlib::Mode::kDecode;
  d.args.kv.ptrs = {reinterpret_cast<uint64_t>(kv2.data())};
  auto prefill = pdlib::KVManager::Create(p);
  auto decode = pdlib::KVManager::Create(d);
  if (!prefill.ok() || !decode.ok()) {
    std::printf("consumer: create failed: %s %s\n", prefill.status().ToString().c_str(),
                decode.status().ToString().c_str());
    return 1;
  }
  auto sender = (*prefill)->CreateSender(42);
  auto receiver = (*decode)->CreateReceiver({"127.0.0.1", 9100}, 42);
  if (!sender.ok() || !receiver.ok()) return 1;
  std::vector<int32_t> pages = {1, 2, 3};
  if (!(*receiver)->Init(pages, std::nullopt).ok()) return 1;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*sender)->Poll() != pdlib::KVPoll::kWaitingForInput) {
    if (std::chrono::steady_clock::now() > deadline) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!(*sender)->Send(pages, true).ok()) return 1;
  while ((*sender)->Poll() != pdlib::KVPoll::kSuccess ||
         (*receiver)->Poll() != pdlib::KVPoll::kSuccess) {
    if (std::chrono::steady_clock::now() > deadline) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("consumer: room 42 Success on both sides\n");
  return 0;
}
