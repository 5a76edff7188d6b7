// pdlib_test_peer: one prefill or decode rank in a process of its own, driven by a test over a
// line protocol on stdin/stdout. The multi-process and fault tests (test/multiprocess/) start two
// or more of these, tell them which rooms to run and where to stop, and kill them mid-request.
//
//   pdlib_test_peer --role prefill|decode [--bootstrap-port N] [--start-bootstrap]
//       [--listen-port N] [--backend fake] [--backend-option KEY=VALUE ...] [--layers L]
//       [--item-bytes B] [--v-item-bytes B] [--pages-per-pool P] [--pages-per-request K]
//       [--page-size S] [--model-name NAME] [--concurrency C]
//       [--verify [--layout scattered|contiguous] [--chunks N] [--vary-layout] [--layout-seed S]
//        [--state-buffers N [--state-item-bytes B] [--state-slots M] [--state-per-request K]]
//        [--corrupt-kv-room R] [--corrupt-aux-room R] [--corrupt-state-room R]]
//       [--requests R --rooms-from X [--hold H] [--exit-when-done]]
//       [--liveness-ms MS] [--connect-timeout-ms MS] [--bootstrap-timeout-ms MS]
//       [--waiting-timeout-ms MS] [--transfer-timeout-ms MS] [--max-seconds S]
//
// Both sides derive everything about a room from its id, so the test only has to send the same
// RUN line to both. --backend-option passes one KVManagerOptions::backend_options entry (e.g.
// ucx.tls=shm); repeat it for more.
//
// --verify (both sides, with the same layout flags): the byte-compare mode (kv_pattern.h). Each
// side hands out pages of its pools to the rooms in flight, as an engine would, salted by role so
// that source and destination pages differ (scattered: random free pages; contiguous: a run of
// consecutive free pages). Prefill fills every page of every K and V buffer with the pattern of
// (room, buffer, position in the request) just before the Send() of the chunk holding it, and
// writes the aux slot (bootstrap_room = room, output_ids[0] = AuxOutputId(room)); a request is
// sent in --chunks chunks of whole pages (the last one holds the rest). Decode, when a room
// reaches Success, checks every byte of every destination page and the aux slot, and prints
// "ROOM <id> Success OK" only if all match, else "ROOM <id> Failed BADBYTES <first mismatch>".
// --vary-layout derives each room's page count (1..--pages-per-request), placement and chunk
// count (1..--chunks) from its id; --layout-seed S (non-zero) mixes S into that and into the page
// placement, so that one seed is one random layout that both sides (given the same S) agree on.
// --v-item-bytes gives the V buffers (the second half of the KV buffers) their own item size.
// --state-buffers N registers N state buffers (KVArgs::state, state_type mamba for one slot per
// request, swa for more) of --state-slots slots of --state-item-bytes each; every room takes
// --state-per-request slots on each side (placed differently on each), prefill fills them with
// the pattern of (room, kStatePatternBase + state buffer, slot position) and sends them with the
// last chunk, and decode checks them with the KV pages and the aux slot. A room never takes more
// slots than it has pages (an SWA window lies inside its request).
// --corrupt-kv-room / --corrupt-aux-room / --corrupt-state-room (prefill) spoil one KV byte / the
// aux output id / one state byte of that room after filling it: negative controls for the check.
//
// Lines the peer prints (stdout, flushed after each):
//   READY role=<prefill|decode> port=<control port, 0 on decode> endpoint=<host:port>
//   ROOM <id> <KVPoll name> <reason>       once per room, when it is terminal ("OK" on Success;
//                                          with --verify, "Failed BADBYTES <what>" on decode when
//                                          a Success room's bytes are wrong); the handle is
//                                          destroyed right after, as an engine would
//   HELD first=<f> count=<c> held=<h> state=<hold>  every room of the batch sits at its hold
//                                          point (h of them) or is terminal (c - h)
//   DONE first=<f> count=<c> ok=<n> failed=<n>      every room of the batch is terminal
//   METRICS live_rooms=<n> connections=<n> ... aux_free=<n> aux_capacity=<n> handles=<n>
//   ERROR <message>                        a bad command, or an API call refused
//   BYE                                    after QUIT, just before exiting 0
// Commands (stdin):
//   RUN <first> <count> [hold]   start rooms first..first+count-1, at most --concurrency of them
//                                in flight at once. hold (both sides: none, the default):
//                                  decode  waiting        receivers never Init(): prefill rooms
//                                                         stay in Bootstrapping
//                                  prefill bootstrapping  senders are created and left alone
//                                          waiting        senders wait in WaitingForInput
//                                          transferring   all pages but the last are sent as a
//                                                         non-last chunk; the last one is held
//                                A held batch must fit in the concurrency window.
//   RESUME     held rooms go on (a decode receiver Init()s, a prefill sender sends)
//   METRICS    print one METRICS line
//   QUIT       destroy every handle, then the manager; print BYE; exit 0
// End of stdin counts as QUIT, except with --exit-when-done: then the peer prints METRICS and
// exits by itself once every batch is done (prefill: and no decode is connected any more), e.g.
//   pdlib_test_peer --role prefill --start-bootstrap --requests 100 --exit-when-done &
//   pdlib_test_peer --role decode --requests 100 --exit-when-done </dev/null
// The process also exits (status 3) after --max-seconds, and dies with its parent
// (PR_SET_PDEATHSIG), so a crashed test never leaves it behind.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kv_pattern.h"
#include "pdlib/pdlib.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Flags {
  pdlib::Mode mode = pdlib::Mode::kPrefill;
  bool role_set = false;
  uint16_t bootstrap_port = 8998;
  bool start_bootstrap = false;
  uint16_t listen_port = 0;
  std::string backend = "fake";
  std::map<std::string, std::string> backend_options;
  bool verify = false;
  bool scattered = true;  // --layout
  int64_t chunks = 1;
  bool vary_layout = false;
  int64_t corrupt_kv_room = -1;
  int64_t corrupt_aux_room = -1;
  int64_t corrupt_state_room = -1;
  int64_t layout_seed = 0;
  int64_t state_buffers = 0;
  int64_t state_item_bytes = 512;
  int64_t state_slots = 64;
  int64_t state_per_request = 1;
  int64_t layers = 2;
  int64_t item_bytes = 1024;
  int64_t v_item_bytes = -1;  // -1: --item-bytes
  int64_t pages_per_pool = 256;
  int64_t pages_per_request = 4;
  int64_t page_size = 16;
  std::string model_name = "pdlib-test-model";
  int64_t concurrency = 16;
  int64_t requests = 0;
  int64_t rooms_from = 0;
  std::string hold = "none";
  bool exit_when_done = false;
  int64_t liveness_ms = 5000;
  int64_t connect_timeout_ms = 5000;
  int64_t bootstrap_timeout_ms = 30000;
  int64_t waiting_timeout_ms = 300000;
  int64_t transfer_timeout_ms = 60000;
  int64_t max_seconds = 120;
};

void Emit(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

bool ParseInt(std::string_view text, int64_t* out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

// Accepts "--flag value" and "--flag=value"; prints why and returns false on bad input.
bool ParseFlags(int argc, char** argv, Flags* f) {
  const std::map<std::string_view, int64_t*> ints = {
      {"--layers", &f->layers},
      {"--item-bytes", &f->item_bytes},
      {"--v-item-bytes", &f->v_item_bytes},
      {"--layout-seed", &f->layout_seed},
      {"--state-buffers", &f->state_buffers},
      {"--state-item-bytes", &f->state_item_bytes},
      {"--state-slots", &f->state_slots},
      {"--state-per-request", &f->state_per_request},
      {"--corrupt-state-room", &f->corrupt_state_room},
      {"--pages-per-pool", &f->pages_per_pool},
      {"--pages-per-request", &f->pages_per_request},
      {"--page-size", &f->page_size},
      {"--concurrency", &f->concurrency},
      {"--requests", &f->requests},
      {"--rooms-from", &f->rooms_from},
      {"--liveness-ms", &f->liveness_ms},
      {"--connect-timeout-ms", &f->connect_timeout_ms},
      {"--bootstrap-timeout-ms", &f->bootstrap_timeout_ms},
      {"--waiting-timeout-ms", &f->waiting_timeout_ms},
      {"--transfer-timeout-ms", &f->transfer_timeout_ms},
      {"--max-seconds", &f->max_seconds},
      {"--chunks", &f->chunks},
      {"--corrupt-kv-room", &f->corrupt_kv_room},
      {"--corrupt-aux-room", &f->corrupt_aux_room},
  };
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--start-bootstrap") {
      f->start_bootstrap = true;
      continue;
    }
    if (arg == "--exit-when-done") {
      f->exit_when_done = true;
      continue;
    }
    if (arg == "--verify") {
      f->verify = true;
      continue;
    }
    if (arg == "--vary-layout") {
      f->vary_layout = true;
      continue;
    }
    std::string_view value;
    if (size_t eq = arg.find('='); eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      std::fprintf(stderr, "pdlib_test_peer: %.*s needs a value\n", int(arg.size()), arg.data());
      return false;
    }
    int64_t n = 0;
    if (auto it = ints.find(arg); it != ints.end()) {
      if (!ParseInt(value, it->second) || *it->second < 0) {
        std::fprintf(stderr, "pdlib_test_peer: bad value for %.*s\n", int(arg.size()), arg.data());
        return false;
      }
    } else if (arg == "--role") {
      if (value != "prefill" && value != "decode") {
        std::fprintf(stderr, "pdlib_test_peer: --role must be prefill or decode\n");
        return false;
      }
      f->mode = value == "prefill" ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
      f->role_set = true;
    } else if (arg == "--bootstrap-port" || arg == "--listen-port") {
      if (!ParseInt(value, &n) || n < 0 || n > 65535) {
        std::fprintf(stderr, "pdlib_test_peer: bad port for %.*s\n", int(arg.size()), arg.data());
        return false;
      }
      (arg == "--bootstrap-port" ? f->bootstrap_port : f->listen_port) = uint16_t(n);
    } else if (arg == "--backend") {
      f->backend = value;
    } else if (arg == "--backend-option") {
      const size_t eq = value.find('=');
      if (eq == std::string_view::npos || eq == 0) {
        std::fprintf(stderr, "pdlib_test_peer: --backend-option needs KEY=VALUE\n");
        return false;
      }
      f->backend_options[std::string(value.substr(0, eq))] = std::string(value.substr(eq + 1));
    } else if (arg == "--layout") {
      if (value != "scattered" && value != "contiguous") {
        std::fprintf(stderr, "pdlib_test_peer: --layout must be scattered or contiguous\n");
        return false;
      }
      f->scattered = value == "scattered";
    } else if (arg == "--model-name") {
      f->model_name = value;
    } else if (arg == "--hold") {
      f->hold = value;
    } else {
      std::fprintf(stderr, "pdlib_test_peer: unknown flag %.*s\n", int(arg.size()), arg.data());
      return false;
    }
  }
  if (!f->role_set) {
    std::fprintf(stderr, "pdlib_test_peer: --role prefill|decode is required\n");
    return false;
  }
  if (f->pages_per_request < 1 || f->pages_per_request > f->pages_per_pool || f->concurrency < 1 ||
      f->layers < 1 || f->item_bytes < 1 || f->page_size < 1 || f->chunks < 1) {
    std::fprintf(stderr, "pdlib_test_peer: sizes must be >= 1 and pages-per-request <= pool\n");
    return false;
  }
  if (f->v_item_bytes < 0) f->v_item_bytes = f->item_bytes;
  if (f->v_item_bytes < 1) {
    std::fprintf(stderr, "pdlib_test_peer: --v-item-bytes must be >= 1\n");
    return false;
  }
  if (f->state_buffers > 0 && (!f->verify || f->state_item_bytes < 1 || f->state_per_request < 1 ||
                               f->state_per_request > f->state_slots)) {
    std::fprintf(stderr,
                 "pdlib_test_peer: --state-buffers %lld needs --verify, --state-item-bytes >= 1 "
                 "and 1 <= --state-per-request %lld <= --state-slots %lld\n",
                 static_cast<long long>(f->state_buffers),
                 static_cast<long long>(f->state_per_request),
                 static_cast<long long>(f->state_slots));
    return false;
  }
  return true;
}

// Where a room of a batch stops until RESUME.
enum class Hold { kNone, kWaiting, kBootstrapping, kTransferring };

std::optional<Hold> ParseHold(std::string_view s, pdlib::Mode mode) {
  if (s == "none") return Hold::kNone;
  if (s == "waiting") return Hold::kWaiting;
  if (mode == pdlib::Mode::kPrefill && s == "bootstrapping") return Hold::kBootstrapping;
  if (mode == pdlib::Mode::kPrefill && s == "transferring") return Hold::kTransferring;
  return std::nullopt;
}

struct Batch {
  uint64_t first = 0;
  uint64_t count = 0;
  Hold hold = Hold::kNone;
  std::string hold_name;
  uint64_t started = 0;  // rooms first..first+started-1 have been created
  uint64_t held = 0, ok = 0, failed = 0;
  bool held_reported = false;
  uint64_t terminal() const { return ok + failed; }
};

// One live request and its handle.
struct Active {
  uint64_t room = 0;
  size_t batch = 0;
  std::unique_ptr<pdlib::KVSender> sender;
  std::unique_ptr<pdlib::KVReceiver> receiver;
  std::optional<uint32_t> aux;
  bool held = false;
  bool partial_sent = false;  // prefill: the non-last chunk is queued
  bool done_sending = false;  // prefill: the last chunk is queued; decode: Init() called
  // --verify only: this room's shape, its pages (from the side's PagePool), chunks queued.
  pdlib_test::RoomShape shape;
  std::vector<int32_t> pages;
  std::vector<int32_t> state_slots;  // --state-buffers: this room's slots in every state buffer
  size_t chunks_sent = 0;
  const pdlib::KVPollable& handle() const {
    return sender ? static_cast<const pdlib::KVPollable&>(*sender) : *receiver;
  }
};

class Peer {
 public:
  explicit Peer(Flags flags) : f_(std::move(flags)) {}

  // Builds the pools and the manager. Prints ERROR and returns false on failure.
  bool Start() {
    const size_t layers = size_t(f_.layers);
    pools_.resize(2 * layers);
    for (size_t b = 0; b < pools_.size(); ++b) {
      pools_[b].assign(size_t(f_.pages_per_pool) * ItemBytes(b), 0);
    }
    state_pools_.resize(size_t(f_.state_buffers));
    for (auto& pool : state_pools_) {
      pool.assign(size_t(f_.state_slots) * size_t(f_.state_item_bytes), 0);
    }
    // Salted by role (source and destination places differ) and by --layout-seed.
    const uint64_t salt = (f_.mode == pdlib::Mode::kPrefill ? 0x9f11ULL : 0xdec0deULL) ^
                          (f_.layout_seed != 0 ? pdlib_test::Mix64(uint64_t(f_.layout_seed)) : 0);
    page_pool_ = std::make_unique<pdlib_test::PagePool>(size_t(f_.pages_per_pool), salt);
    state_pool_ =
        std::make_unique<pdlib_test::PagePool>(size_t(f_.state_slots), pdlib_test::Mix64(salt));
    const size_t slots = pdlib::MetadataBuffers::SlotCountFor(size_t(f_.concurrency));
    auto aux = pdlib::MetadataBuffers::Create(slots, 0, 0);
    if (!aux.ok()) return Fail("MetadataBuffers::Create: " + aux.status().ToString());
    aux_ = std::move(*aux);
    slots_ = std::make_unique<pdlib::MetadataSlotAllocator>(slots);

    pdlib::KVManagerOptions o;
    o.mode = f_.mode;
    o.backend = f_.backend;
    o.backend_options = f_.backend_options;
    o.control_plane = pdlib::ControlPlane::kGrpc;
    o.listen_host = "127.0.0.1";
    o.listen_port = f_.listen_port;
    o.bootstrap_host = "127.0.0.1";
    o.bootstrap_port = f_.bootstrap_port;
    o.start_bootstrap_server = f_.start_bootstrap;
    o.liveness_timeout = milliseconds(f_.liveness_ms);
    o.connect_timeout = milliseconds(f_.connect_timeout_ms);
    o.bootstrap_timeout = milliseconds(f_.bootstrap_timeout_ms);
    o.waiting_timeout = milliseconds(f_.waiting_timeout_ms);
    o.transfer_timeout = milliseconds(f_.transfer_timeout_ms);
    for (size_t b = 0; b < pools_.size(); ++b) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(pools_[b].data()));
      o.args.kv.lens.push_back(pools_[b].size());
      o.args.kv.item_lens.push_back(ItemBytes(b));
    }
    for (auto& pool : state_pools_) {
      o.args.state.ptrs.push_back(reinterpret_cast<uint64_t>(pool.data()));
      o.args.state.lens.push_back(pool.size());
      o.args.state.item_lens.push_back(uint64_t(f_.state_item_bytes));
    }
    if (!state_pools_.empty()) {
      o.args.state_type =
          f_.state_per_request == 1 ? pdlib::StateType::kMamba : pdlib::StateType::kSwa;
    }
    o.args.aux = aux_->Describe();
    o.args.page_size = uint32_t(f_.page_size);
    o.args.fingerprint = {int32_t(f_.layers), 8, 128, 2, 1, f_.model_name};
    auto manager = pdlib::KVManager::Create(o);
    if (!manager.ok()) return Fail("KVManager::Create: " + manager.status().ToString());
    manager_ = std::move(*manager);

    const std::string endpoint = f_.mode == pdlib::Mode::kPrefill ? manager_->endpoint() : "-";
    int64_t port = 0;
    if (size_t colon = endpoint.rfind(':'); colon != std::string::npos) {
      if (!ParseInt(std::string_view(endpoint).substr(colon + 1), &port)) port = 0;
    }
    Emit("READY role=" + std::string(pdlib::ModeName(f_.mode)) + " port=" + std::to_string(port) +
         " endpoint=" + endpoint);
    if (f_.requests > 0) {
      RunBatch(uint64_t(f_.rooms_from), uint64_t(f_.requests), f_.hold);
    }
    return true;
  }

  // The event loop: commands from stdin, handles polled, until QUIT, EOF or the watchdog.
  int Loop() {
    const auto deadline = Clock::now() + std::chrono::seconds(f_.max_seconds);
    while (!quit_) {
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "pdlib_test_peer: --max-seconds %lld passed, exiting\n",
                     static_cast<long long>(f_.max_seconds));
        std::fflush(stderr);
        _exit(3);
      }
      bool progressed = Drive();
      if (f_.exit_when_done && batches_done_ == batches_.size() && active_.empty() &&
          (f_.mode == pdlib::Mode::kDecode || manager_->metrics().connections == 0)) {
        PrintMetrics();
        quit_ = true;
        break;
      }
      // Idle: wait for a command a little, then look at the handles again.
      const int timeout_ms = progressed ? 0 : (active_.empty() ? 50 : 1);
      ReadCommands(timeout_ms);
    }
    active_.clear();  // destroying a live handle aborts its room
    manager_.reset();
    Emit("BYE");
    return 0;
  }

 private:
  // Item (page) size of KV buffer `b`: K buffers first, then V buffers (--v-item-bytes).
  size_t ItemBytes(size_t b) const {
    return size_t(b < size_t(f_.layers) ? f_.item_bytes : f_.v_item_bytes);
  }

  bool Fail(const std::string& message) {
    Emit("ERROR " + message);
    return false;
  }

  void RunBatch(uint64_t first, uint64_t count, std::string_view hold_name) {
    auto hold = ParseHold(hold_name, f_.mode);
    if (!hold) {
      Fail("unknown hold '" + std::string(hold_name) + "' for " +
           std::string(pdlib::ModeName(f_.mode)));
      return;
    }
    if (*hold != Hold::kNone && count > uint64_t(f_.concurrency)) {
      Fail("a held batch must fit in --concurrency");
      return;
    }
    Batch b;
    b.first = first;
    b.count = count;
    b.hold = *hold;
    b.hold_name = std::string(hold_name);
    batches_.push_back(b);
    if (count == 0) FinishBatchIfDone(batches_.size() - 1);
  }

  // Pages of `room`: a fixed, room-dependent window of the pool (contents do not matter here).
  std::vector<int32_t> Pages(uint64_t room) const {
    std::vector<int32_t> pages(size_t(f_.pages_per_request));
    const uint64_t pool = uint64_t(f_.pages_per_pool);
    for (size_t i = 0; i < pages.size(); ++i) {
      pages[i] = int32_t((room * uint64_t(f_.pages_per_request) + i) % pool);
    }
    return pages;
  }

  // Starts rooms while the concurrency window has room. Returns true when it started one.
  bool StartRooms() {
    bool started = false;
    for (size_t bi = next_batch_; bi < batches_.size(); ++bi) {
      Batch& b = batches_[bi];
      while (b.started < b.count && active_.size() < size_t(f_.concurrency)) {
        if (!StartRoom(bi, b.first + b.started)) return started;  // no free pages yet
        ++b.started;
        started = true;
      }
      if (b.started < b.count) break;  // window full: later batches wait their turn
      if (bi == next_batch_) ++next_batch_;
    }
    return started;
  }

  // Creates the handle of `room`. False (nothing done) when --verify finds no free pages for it
  // right now: the room starts once earlier ones have released theirs.
  bool StartRoom(size_t bi, uint64_t room) {
    auto a = std::make_unique<Active>();
    a->room = room;
    a->batch = bi;
    if (f_.verify) {
      const uint64_t shape_key =
          f_.layout_seed != 0
              ? pdlib_test::Mix64(room ^ pdlib_test::Mix64(uint64_t(f_.layout_seed)))
              : room;
      a->shape = pdlib_test::ShapeOf(shape_key, size_t(f_.pages_per_request), f_.scattered,
                                     size_t(f_.chunks), f_.vary_layout);
      auto pages = page_pool_->Alloc(room, a->shape.pages, a->shape.scattered);
      if (!pages) return false;
      a->pages = std::move(*pages);
      if (!state_pools_.empty()) {
        // SWA's window lies inside the request: at most one slot per page (the planner checks).
        const size_t count = std::min(size_t(f_.state_per_request), a->shape.pages);
        auto slots = state_pool_->Alloc(room, count, true);
        if (!slots) {
          page_pool_->Free(a->pages);
          return false;
        }
        a->state_slots = std::move(*slots);
      }
    }
    pdlib::Status s;
    if (f_.mode == pdlib::Mode::kPrefill) {
      auto sender = manager_->CreateSender(room);
      if (sender.ok()) a->sender = std::move(*sender);
      s = sender.status();
    } else {
      auto receiver = manager_->CreateReceiver({"127.0.0.1", f_.bootstrap_port}, room);
      if (receiver.ok()) a->receiver = std::move(*receiver);
      s = receiver.status();
    }
    if (!s.ok()) {
      // No handle: the room is over before it began.
      Emit("ROOM " + std::to_string(room) + " Failed " + s.ToString());
      page_pool_->Free(a->pages);
      state_pool_->Free(a->state_slots);
      ++batches_[bi].failed;
      FinishBatchIfDone(bi);
      return true;
    }
    a->aux = slots_->Alloc();
    if (a->aux && f_.mode == pdlib::Mode::kPrefill) {
      aux_->bootstrap_room(*a->aux)[0] = room;  // what decode checks (SPEC R4.4)
      if (!f_.verify) {
        aux_->output_ids(*a->aux)[0] = int32_t(room % 32000);
      } else {
        aux_->output_ids(*a->aux)[0] =
            pdlib_test::AuxOutputId(room) + (int64_t(room) == f_.corrupt_aux_room ? 1 : 0);
      }
    } else if (a->aux && f_.verify) {
      // Decode: whatever a previous request left in the slot must not pass the check.
      aux_->bootstrap_room(*a->aux)[0] = ~uint64_t{0};
      aux_->output_ids(*a->aux)[0] = -1;
    }
    active_.push_back(std::move(a));
    return true;
  }

  // One pass over every handle. Returns true when anything moved.
  bool Drive() {
    bool progressed = StartRooms();
    for (size_t i = 0; i < active_.size();) {
      Active& a = *active_[i];
      const pdlib::KVPoll st = a.handle().Poll();
      if (pdlib::IsTerminal(st)) {
        Finish(i, st);
        progressed = true;
        continue;
      }
      progressed |= f_.mode == pdlib::Mode::kPrefill ? StepSender(a, st) : StepReceiver(a, st);
      ++i;
    }
    for (size_t bi = 0; bi < batches_.size(); ++bi) ReportHeldIfReady(bi);
    return progressed;
  }

  bool MarkHeld(Active& a) {
    if (a.held) return false;
    a.held = true;
    ++batches_[a.batch].held;
    return true;
  }

  bool StepReceiver(Active& a, pdlib::KVPoll st) {
    if (a.done_sending || st != pdlib::KVPoll::kWaitingForInput) return false;
    if (batches_[a.batch].hold == Hold::kWaiting) return MarkHeld(a);
    a.done_sending = true;
    const std::vector<int32_t> pages = f_.verify ? a.pages : Pages(a.room);
    if (pdlib::Status s = a.receiver->Init(pages, a.aux, a.state_slots); !s.ok()) {
      Emit("ERROR room " + std::to_string(a.room) + " Init: " + s.ToString());
      a.receiver->Abort("Init() refused: " + s.ToString());
    }
    return true;
  }

  bool StepSender(Active& a, pdlib::KVPoll st) {
    if (f_.verify) return StepVerifySender(a, st);
    const Hold hold = batches_[a.batch].hold;
    if (hold == Hold::kBootstrapping) return MarkHeld(a);
    if (a.done_sending || st < pdlib::KVPoll::kWaitingForInput) return false;
    if (hold == Hold::kWaiting) return MarkHeld(a);
    const std::vector<int32_t> pages = Pages(a.room);
    auto check = [&](pdlib::Status s, const char* what) {
      if (s.ok()) return true;
      Emit("ERROR room " + std::to_string(a.room) + " " + what + ": " + s.ToString());
      a.sender->Abort(std::string(what) + " refused: " + s.ToString());
      a.done_sending = true;
      return false;
    };
    if (!a.partial_sent) {
      if (!check(a.sender->Init(pages.size(), a.aux), "Init")) return true;
      if (hold == Hold::kTransferring && pages.size() > 1) {
        a.partial_sent = true;
        check(a.sender->Send(std::span(pages).first(pages.size() - 1), false), "Send");
        return true;
      }
      a.partial_sent = true;
      a.done_sending = true;
      check(a.sender->Send(pages, true), "Send");
      return true;
    }
    if (hold == Hold::kTransferring) {
      return st == pdlib::KVPoll::kTransferring && MarkHeld(a);
    }
    a.done_sending = true;
    check(a.sender->Send(std::span(pages).last(1), true), "Send");
    return true;
  }

  // --verify prefill: one chunk per call, each chunk's pages filled just before its Send().
  bool StepVerifySender(Active& a, pdlib::KVPoll st) {
    const Hold hold = batches_[a.batch].hold;
    if (hold == Hold::kBootstrapping) return MarkHeld(a);
    if (a.done_sending || st < pdlib::KVPoll::kWaitingForInput) return false;
    if (hold == Hold::kWaiting) return MarkHeld(a);
    auto check = [&](pdlib::Status s, const char* what) {
      if (s.ok()) return true;
      Emit("ERROR room " + std::to_string(a.room) + " " + what + ": " + s.ToString());
      a.sender->Abort(std::string(what) + " refused: " + s.ToString());
      a.done_sending = true;
      return false;
    };
    const size_t c = a.chunks_sent;
    const bool last = c + 1 == a.shape.chunks;
    if (c == 0 && !check(a.sender->Init(a.pages.size(), a.aux), "Init")) return true;
    if (last && c > 0 && hold == Hold::kTransferring) {
      return st == pdlib::KVPoll::kTransferring && MarkHeld(a);
    }
    size_t first = 0;
    for (size_t i = 0; i < c; ++i) first += pdlib_test::ChunkPages(a.shape, i);
    const size_t n = pdlib_test::ChunkPages(a.shape, c);
    for (size_t b = 0; b < pools_.size(); ++b) {
      const size_t item = ItemBytes(b);
      for (size_t i = first; i < first + n; ++i) {
        pdlib_test::FillPage(pools_[b].data() + size_t(a.pages[i]) * item, item, a.room,
                             uint32_t(b), uint32_t(i));
      }
    }
    if (c == 0 && int64_t(a.room) == f_.corrupt_kv_room) {
      // One byte in the middle of the last buffer's first page.
      const size_t item = ItemBytes(pools_.size() - 1);
      pools_.back()[size_t(a.pages[0]) * item + item / 2] ^= 0x40;
    }
    if (last) FillState(a);
    a.chunks_sent = c + 1;
    a.partial_sent = true;
    a.done_sending = last;
    // The state slots travel with the last chunk (after the aux slot, SPEC R5.2).
    check(
        a.sender->Send(std::span(a.pages).subspan(first, n), last,
                       last ? std::span<const int32_t>(a.state_slots) : std::span<const int32_t>()),
        "Send");
    return true;
  }

  // --verify prefill: the pattern into every state slot of `a`, just before the last Send().
  void FillState(const Active& a) {
    const size_t item = size_t(f_.state_item_bytes);
    for (size_t s = 0; s < state_pools_.size(); ++s) {
      for (size_t n = 0; n < a.state_slots.size(); ++n) {
        pdlib_test::FillPage(state_pools_[s].data() + size_t(a.state_slots[n]) * item, item, a.room,
                             pdlib_test::kStatePatternBase + uint32_t(s), uint32_t(n));
      }
    }
    if (int64_t(a.room) == f_.corrupt_state_room && !state_pools_.empty()) {
      // One byte at the end of the last state buffer's first slot.
      state_pools_.back()[size_t(a.state_slots[0]) * item + item - 1] ^= 0x20;
    }
  }

  // --verify decode: nullopt when every destination byte and the aux slot of `a` are right,
  // otherwise what the first wrong one is.
  std::optional<std::string> VerifyRoom(const Active& a) const {
    if (!a.aux) return "no-aux-slot";
    const uint64_t got_room = aux_->bootstrap_room(*a.aux)[0];
    if (got_room != a.room) return "aux.bootstrap_room=" + std::to_string(got_room);
    const int32_t got_id = aux_->output_ids(*a.aux)[0];
    if (got_id != pdlib_test::AuxOutputId(a.room)) {
      return "aux.output_ids[0]=" + std::to_string(got_id) +
             ",expected=" + std::to_string(pdlib_test::AuxOutputId(a.room));
    }
    for (size_t b = 0; b < pools_.size(); ++b) {
      const size_t item = ItemBytes(b);
      for (size_t i = 0; i < a.pages.size(); ++i) {
        auto bad = pdlib_test::VerifyPage(pools_[b].data() + size_t(a.pages[i]) * item, item,
                                          a.room, uint32_t(b), uint32_t(i));
        if (bad) return *bad + ",page=" + std::to_string(a.pages[i]);
      }
    }
    const size_t state_item = size_t(f_.state_item_bytes);
    for (size_t s = 0; s < state_pools_.size(); ++s) {
      for (size_t n = 0; n < a.state_slots.size(); ++n) {
        const uint8_t* slot = state_pools_[s].data() + size_t(a.state_slots[n]) * state_item;
        auto bad = pdlib_test::VerifyPage(slot, state_item, a.room,
                                          pdlib_test::kStatePatternBase + uint32_t(s), uint32_t(n));
        if (bad) {  // "offset=...,expected=...,got=..." from VerifyPage, with the state's names
          return "state_buffer=" + std::to_string(s) + ",slot_pos=" + std::to_string(n) +
                 ",slot=" + std::to_string(a.state_slots[n]) + "," +
                 bad->substr(bad->find("offset="));
        }
      }
    }
    return std::nullopt;
  }

  void Finish(size_t index, pdlib::KVPoll st) {
    std::unique_ptr<Active> a = std::move(active_[index]);
    active_.erase(active_.begin() + std::ptrdiff_t(index));
    const pdlib::Status reason = a->handle().FailureReason();
    bool ok = st == pdlib::KVPoll::kSuccess;
    if (ok && f_.verify && f_.mode == pdlib::Mode::kDecode) {
      if (auto bad = VerifyRoom(*a)) {
        ok = false;
        Emit("ROOM " + std::to_string(a->room) + " Failed BADBYTES " + *bad);
      }
    }
    if (ok || st != pdlib::KVPoll::kSuccess) {
      Emit("ROOM " + std::to_string(a->room) + " " + std::string(pdlib::KVPollName(st)) + " " +
           (ok ? std::string("OK") : reason.ToString()));
    }
    Batch& b = batches_[a->batch];
    ++(ok ? b.ok : b.failed);
    if (a->held) --b.held;
    const size_t bi = a->batch;
    const std::optional<uint32_t> aux = a->aux;
    const std::vector<int32_t> pages = std::move(a->pages);
    const std::vector<int32_t> state_slots = std::move(a->state_slots);
    a.reset();  // the engine releases the request: handle first, then its slot and pages
    if (aux) slots_->Free(*aux).IgnoreError();
    page_pool_->Free(pages);
    state_pool_->Free(state_slots);
    FinishBatchIfDone(bi);
  }

  void ReportHeldIfReady(size_t bi) {
    Batch& b = batches_[bi];
    if (b.hold == Hold::kNone || b.held_reported || b.started < b.count) return;
    if (b.held + b.terminal() < b.count) return;
    b.held_reported = true;
    Emit("HELD first=" + std::to_string(b.first) + " count=" + std::to_string(b.count) +
         " held=" + std::to_string(b.held) + " state=" + b.hold_name);
  }

  void FinishBatchIfDone(size_t bi) {
    Batch& b = batches_[bi];
    if (b.terminal() != b.count) return;
    ReportHeldIfReady(bi);
    ++batches_done_;
    Emit("DONE first=" + std::to_string(b.first) + " count=" + std::to_string(b.count) +
         " ok=" + std::to_string(b.ok) + " failed=" + std::to_string(b.failed));
  }

  void PrintMetrics() {
    const pdlib::KVManagerMetrics m = manager_->metrics();
    std::ostringstream out;
    out << "METRICS live_rooms=" << m.live_rooms << " connections=" << m.connections
        << " requests_total=" << m.requests_total << " rooms_succeeded=" << m.rooms_succeeded
        << " rooms_failed=" << m.rooms_failed << " bootstrap_queue=" << m.bootstrap_queue_size
        << " transfer_queue=" << m.transfer_queue_size
        << " bootstrap_failed=" << m.bootstrap_failed_reqs
        << " transfer_failed=" << m.transfer_failed_reqs << " bytes=" << m.bytes_transferred
        << " pages=" << m.pages_transferred << " batches=" << m.write_batches
        << " aux_free=" << slots_->available() << " aux_capacity=" << slots_->capacity()
        << " handles=" << active_.size();
    for (const auto& [cause, n] : m.failed_by_cause) out << " failed_" << cause << "=" << n;
    Emit(out.str());
  }

  void HandleCommand(std::string_view line) {
    std::istringstream in{std::string(line)};
    std::string cmd;
    in >> cmd;
    if (cmd == "RUN") {
      uint64_t first = 0, count = 0;
      std::string hold = "none";
      if (!(in >> first >> count)) {
        Fail("usage: RUN <first> <count> [hold]");
        return;
      }
      in >> hold;
      RunBatch(first, count, hold);
    } else if (cmd == "RESUME") {
      for (auto& b : batches_) b.hold = Hold::kNone;
      for (auto& a : active_) a->held = false;
      for (auto& b : batches_) b.held = 0;
    } else if (cmd == "METRICS") {
      PrintMetrics();
    } else if (cmd == "QUIT") {
      quit_ = true;
    } else if (!cmd.empty()) {
      Fail("unknown command '" + cmd + "'");
    }
  }

  // Reads whatever stdin has (waiting up to timeout_ms for the first byte) and runs every
  // complete line. End of input means QUIT.
  void ReadCommands(int timeout_ms) {
    if (!stdin_open_) {
      std::this_thread::sleep_for(milliseconds(timeout_ms));
      return;
    }
    pollfd pfd{STDIN_FILENO, POLLIN, 0};
    if (::poll(&pfd, 1, timeout_ms) <= 0) return;
    char buf[4096];
    const ssize_t n = ::read(STDIN_FILENO, buf, sizeof(buf));
    if (n <= 0) {
      if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        // With --exit-when-done the batch decides when to go; otherwise EOF means QUIT.
        stdin_open_ = false;
        quit_ = !f_.exit_when_done;
      }
      return;
    }
    input_.append(buf, size_t(n));
    for (size_t nl; !quit_ && (nl = input_.find('\n')) != std::string::npos;) {
      std::string line = input_.substr(0, nl);
      input_.erase(0, nl + 1);
      HandleCommand(line);
    }
  }

  const Flags f_;
  std::vector<std::vector<uint8_t>> pools_;        // one K and one V pool per layer
  std::vector<std::vector<uint8_t>> state_pools_;  // --state-buffers
  std::unique_ptr<pdlib::MetadataBuffers> aux_;
  std::unique_ptr<pdlib::MetadataSlotAllocator> slots_;
  std::unique_ptr<pdlib_test::PagePool> page_pool_;   // --verify: pages of the rooms in flight
  std::unique_ptr<pdlib_test::PagePool> state_pool_;  // --verify: state slots of those rooms
  std::unique_ptr<pdlib::KVManager> manager_;
  std::deque<Batch> batches_;
  size_t next_batch_ = 0;  // first batch with rooms not yet started
  size_t batches_done_ = 0;
  std::vector<std::unique_ptr<Active>> active_;
  std::string input_;
  bool stdin_open_ = true;
  bool quit_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  // Die with the test that started us, even when it is killed itself.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 4;
  ::signal(SIGPIPE, SIG_IGN);
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  Peer peer(std::move(flags));
  if (!peer.Start()) return 1;
  return peer.Loop();
}
