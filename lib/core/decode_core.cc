// DecodeCore: lifecycle, connections to prefill ranks, rooms from creation to their status,
// failing and releasing rooms, timeouts, metrics.
#include "lib/core/decode_core.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/core/decode_types.h"
#include "lib/core/validate.h"
#include "pdlib/metadata_buffers.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::shared_ptr<DecodeCore>> DecodeCore::Create(const KVManagerOptions& options,
                                                         std::unique_ptr<spi::Transport> transport,
                                                         uint64_t session) {
  std::shared_ptr<DecodeCore> core(new DecodeCore(options, std::move(transport), session));
  auto layout = PlannerLayout(options.args, "decode");
  if (!layout.ok()) return layout.status();
  core->layout_ = std::move(*layout);
  auto families = EffectiveStateFamilies(options.args);
  if (!families.ok()) return families.status();
  core->state_caps_ = StateCapacities(*families);
  if (Status s = CheckDirectionSupported(*core->transport_, options); !s.ok()) return s;
  if (Status s = CheckChecksumSupported(*core->transport_, options); !s.ok()) return s;
  auto local = RegisterBuffers(*core->transport_, options.args);
  if (!local.ok()) return local.status();
  core->local_ = std::move(*local);
  core->landings_ = options.checksum != KvChecksum::kOff &&
                    options.args.memory_kind == MemoryKind::kHost &&
                    core->transport_->capabilities().digests_landings;
  core->digest_mine_ = DigestMemoryOf(core->local_, options.args.memory_kind == MemoryKind::kCuda
                                                        ? core->transport_.get()
                                                        : nullptr);
  const BufferFamily& aux = options.args.aux;
  int32_t pick = options.args.aux_room_buffer;
  if (pick == KVArgs::kAuxRoomBufferAuto) {
    pick = aux.size() == kMetadataFieldCount ? static_cast<int32_t>(MetadataField::kBootstrapRoom)
                                             : -1;
  }
  if (pick >= 0 && (static_cast<size_t>(pick) >= aux.size() || aux.item_lens[pick] < 8)) {
    return Status::InvalidArgument(absl::StrFormat(
        "aux_room_buffer %d does not name an aux buffer with rows of at least 8 bytes", pick));
  }
  // A transport that moves no bytes (fake) leaves nothing to check.
  if (!core->transport_->capabilities().moves_bytes) pick = -1;
  core->aux_room_buffer_ = pick;
  core->reaper_ = std::make_unique<PeriodicThread>(absl::Milliseconds(20),
                                                   [c = core.get()] { c->CheckTimeouts(); });
  return core;
}

DecodeCore::DecodeCore(const KVManagerOptions& options, std::unique_ptr<spi::Transport> transport,
                       uint64_t session)
    : options_(options),
      session_(session),
      transport_(std::move(transport)),
      injector_(ResolveFailureInjectionProb(options), ResolveFailureStages(options)) {}

DecodeCore::~DecodeCore() { Shutdown(); }

void DecodeCore::Shutdown() {
  std::vector<std::shared_ptr<Room>> rooms;
  absl::flat_hash_map<std::string, Connection> connections;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [id, room] : room_data_) rooms.push_back(room);
    connections.swap(connections_);
  }
  reaper_.reset();
  for (auto& room : rooms) FailRoom(room, Status::Cancelled("decode manager shut down"), true);
  MutexLock lock(&transport_mu_);
  for (auto& [key, conn] : connections) {
    conn.link->Close();
    if (conn.source) {
      transport_->Disconnect(conn.source->peer);  // outstanding reads complete kCancelled
    } else {
      transport_->CloseTargetEndpoint(conn.target);
    }
  }
  connections.clear();
  DeregisterBuffers(*transport_, local_);
  transport_.reset();
}

std::shared_ptr<DecodeCore::Room> DecodeCore::FindRoom(uint64_t room) const {
  MutexLock lock(&mu_);
  auto it = room_data_.find(room);
  return it == room_data_.end() ? nullptr : it->second;
}

Status DecodeCore::EnsureConnected(
    const std::string& key,
    const std::function<StatusOr<std::shared_ptr<PrefillLink>>()>& make_link) {
  std::shared_ptr<Mutex> key_mu;
  {
    MutexLock lock(&mu_);
    auto& m = connect_mus_[key];
    if (!m) m = std::make_shared<Mutex>();
    key_mu = m;
  }
  MutexLock connect_lock(key_mu.get());
  {
    MutexLock lock(&mu_);
    if (stopping_) return Status::Unavailable("decode manager is shutting down");
    if (connections_.contains(key)) return Status::OK();
  }
  auto link = make_link();
  if (!link.ok()) return link.status();
  // Push: an endpoint prefill writes through. Pull: decode connects to prefill's instead, once
  // the RegisterAck has brought it.
  spi::TargetEndpoint target;
  if (!pull()) {
    auto created = transport_->CreateTargetEndpoint();
    if (!created.ok()) return created.status().WithPrefix("creating transport endpoint");
    target = std::move(*created);
  }
  const RegisterMsg reg = DescribeRank(options_, layout_, local_, std::string(transport_->name()),
                                       session_, target.blob);
  RegisterAckMsg ack = (*link)->Register(reg);
  Status s = ack.status;
  std::shared_ptr<const ReadSource> source;
  if (s.ok() && pull()) {
    auto connected = ConnectReadSource(ack, **link);
    if (connected.ok()) {
      source = std::move(*connected);
    } else {
      s = connected.status();
    }
  } else if (s.ok() && transport_->capabilities().needs_reply) {
    s = transport_->CompleteTargetEndpoint(target.id, ack.reply);
  }
  if (!s.ok()) {
    if (!pull()) transport_->CloseTargetEndpoint(target.id);
    (*link)->Close();
    return s.WithPrefix("prefill " + key + " refused the connection");
  }
  std::shared_ptr<PrefillLink> installed = *link;
  {
    MutexLock lock(&mu_);
    Connection conn{std::move(*link),   target.id,   source,      absl::Now(),
                    StageExtentOf(ack), next_gen_++, ack.instance};
    if (source) conn.next_heartbeat = absl::Now() + source->heartbeat_every;
    connections_[key] = std::move(conn);
  }
  // The stream may have broken right after its RegisterAck, its OnPrefillGone delivered before
  // the connection above existed: a connection installed now would be dead and never purged.
  if (installed->Broken()) {
    OnPrefillGone(key, Status::Unavailable("the connection broke right after registering"));
    return Status::Unavailable("prefill " + key + ": the connection broke right after registering");
  }
  PDLIB_LOG(kInfo, "decode: connected to prefill %s (instance %016x)", key, ack.instance);
  if (ack.instance != 0) {
    // Another manager instance holds the address now, so the one our older connections went to
    // has shut down or exited: nothing of it can write any more.
    ClearExposures(
        [&](uint64_t, const Exposure& e) {
          return e.key == key && e.instance != 0 && e.instance != ack.instance;
        },
        Release::kGone);
    if (!ack.drained_rooms.empty()) {
      absl::flat_hash_set<uint64_t> drained(ack.drained_rooms.begin(), ack.drained_rooms.end());
      ClearExposures(
          [&](uint64_t room, const Exposure& e) {
            return e.key == key && e.instance == ack.instance && drained.contains(room);
          },
          Release::kDrained);
    }
    ResendAborts(key, ack.instance);
  }
  return Status::OK();
}

bool DecodeCore::IsConnected(const std::string& key) const {
  MutexLock lock(&mu_);
  return connections_.contains(key);
}

Status DecodeCore::CheckStageCoverage(const std::vector<BoundPrefill>& prefills) const {
  std::vector<planner::StageExtent> stages;
  {
    MutexLock lock(&mu_);
    for (const BoundPrefill& p : prefills) {
      if (p.target.dummy) continue;
      auto it = connections_.find(p.key);
      if (it == connections_.end()) {
        return Status::Unavailable("connection to prefill " + p.key + " was lost");
      }
      bool seen = false;
      for (const auto& st : stages) seen |= st.pp_rank == it->second.stage.pp_rank;
      if (!seen) stages.push_back(it->second.stage);
    }
  }
  return planner::CheckStageCoverage(layout_, stages);
}

KVPoll DecodeCore::RoomPoll(uint64_t room) const {
  auto r = FindRoom(room);
  return r ? r->state->Poll() : KVPoll::kFailed;
}

bool DecodeCore::RoomAwaitingPrefill(uint64_t room, absl::Duration min_age) const {
  auto r = FindRoom(room);
  if (!r || absl::Now() - r->state->created() < min_age) return false;
  const KVPoll s = r->state->Poll();
  return s == KVPoll::kBootstrapping || s == KVPoll::kWaitingForInput ||
         (s == KVPoll::kTransferring && !r->state->transfer_started());
}

StatusOr<std::shared_ptr<RoomState>> DecodeCore::CreateRoom(uint64_t room_id) {
  auto state = rooms_.Insert(room_id);
  if (!state.ok()) return state.status();
  counters_.Add(counters_.requests);
  (*state)->set_logged(room_log_.Sample(room_id));
  MutexLock lock(&mu_);
  if (stopping_) {
    rooms_.Erase(room_id, state->get());
    return Status::Unavailable("decode manager is shutting down");
  }
  auto room = std::make_shared<Room>(*state);
  room->digested = ChecksumRoom(options_, room_id);
  if (room->digested) counters_.Add(counters_.checksummed);
  room_data_[room_id] = std::move(room);
  PDLIB_ROOM_LOG((*state)->logged(), "decode: room %d created", room_id);
  return state;
}

namespace {

// "prefill 127.0.0.1:4000, prefill 127.0.0.1:4001 (dummy)" for a room's log line.
std::string BoundString(const std::vector<BoundPrefill>& prefills) {
  std::string out;
  for (const BoundPrefill& p : prefills) {
    if (!out.empty()) out += ", ";
    out += absl::StrFormat("prefill %s%s", p.key, p.target.dummy ? " (dummy)" : "");
  }
  return out.empty() ? "no prefill rank" : out;
}

}  // namespace

void DecodeCore::BindRoom(uint64_t room_id, std::vector<BoundPrefill> prefills) {
  auto room = FindRoom(room_id);
  if (!room) return;
  const bool inject = injector_.Roll(FailureStage::kBootstrap);
  PDLIB_ROOM_LOG(room->state->logged(), "decode: room %d bound to %s", room_id,
                 BoundString(prefills));
  bool initialized = false;
  {
    MutexLock lock(&room->mu);
    room->expected = 0;
    for (const auto& p : prefills) room->expected += p.target.dummy ? 0 : 1;
    room->prefills = std::move(prefills);
    initialized = room->initialized;
  }
  // Bound, so the prefill ranks hear of the failure too.
  if (inject) return FailRoom(room, injector_.Injected(FailureStage::kBootstrap, room_id), true);
  // Init() came first: its TransferInfo goes out now; otherwise the engine may call Init().
  if (initialized) {
    SendTransferInfo(room);
  } else {
    room->state->Advance(KVPoll::kWaitingForInput);
  }
}

void DecodeCore::SendTransferInfo(const std::shared_ptr<Room>& room) {
  std::vector<std::pair<std::shared_ptr<PrefillLink>, PrefillTarget>> links;
  std::string lost;
  TransferInfoMsg info;
  {
    MutexLock lock(&room->mu);
    // A room that failed meanwhile sends nothing: its pages must not go out any more.
    if (IsTerminal(room->state->Poll())) return;
    info = room->info;
    std::vector<Exposure> exposures;
    uint32_t layers_expected = 0;
    MutexLock conn_lock(&mu_);
    for (const auto& p : room->prefills) {
      auto it = connections_.find(p.key);
      if (it == connections_.end()) {
        lost = p.key;
        break;
      }
      links.emplace_back(it->second.link, p.target);
      if (p.target.dummy) continue;
      if (it->second.source) {
        // Pull: nothing of that rank writes here; a page holds every byte once each reader
        // rank's layers have been read into it.
        layers_expected += static_cast<uint32_t>(it->second.source->plan.prefill_layers);
      } else {
        // Every rank but a dummy may write these pages from now on.
        exposures.push_back({p.key, it->second.gen, it->second.instance, true});
      }
    }
    if (pull() && lost.empty()) {
      room->pull.assign(room->prefills.size(), {});
      room->page_layers.assign(info.dst_kv_pages.size(), 0);
      room->layers_expected = layers_expected;
    }
    if (lost.empty()) {
      room->exposed.insert(room->exposed.end(), exposures.begin(), exposures.end());
    }
  }
  if (!lost.empty()) {
    return FailRoom(room,
                    Status::Unavailable(absl::StrFormat(
                        "room %d: connection to prefill %s was lost", info.room, lost)),
                    false);
  }
  room->state->Advance(KVPoll::kTransferring);
  // A dummy carries nothing but the room (R5.5); every real one the whole request, and how
  // many decode ranks that prefill rank hears from.
  TransferInfoMsg dummy;
  dummy.room = info.room;
  dummy.session = info.session;
  dummy.is_dummy = true;
  dummy.decode_prefix_len = info.decode_prefix_len;  // every prefill rank learns the same prefix
  for (auto& [link, target] : links) {
    if (target.dummy) {
      link->SendTransferInfo(dummy);
    } else {
      info.required_dst_info_num = target.required_dst_info_num;
      link->SendTransferInfo(info);
    }
  }
}

void DecodeCore::FailRoomWith(uint64_t room_id, Status reason, bool tell_prefill) {
  if (auto room = FindRoom(room_id)) FailRoom(room, std::move(reason), tell_prefill);
}

Status DecodeCore::InitRoom(uint64_t room_id, const ReceiveRequest& request) {
  const std::span<const int32_t> pages = request.kv_page_indices;
  const std::optional<uint32_t> aux = request.aux_index;
  const std::span<const int32_t> state_indices = request.state.indices;
  auto room = FindRoom(room_id);
  if (!room) return Status::NotFound(absl::StrFormat("room %d is not live", room_id));
  KVPoll state = room->state->Poll();
  if (state == KVPoll::kFailed) return room->state->FailureReason();
  if (state != KVPoll::kWaitingForInput && state != KVPoll::kBootstrapping) {
    return Status::FailedPrecondition(
        absl::StrFormat("room %d: Init() in state %s", room_id, KVPollName(state)));
  }
  const KVArgs& args = options_.args;
  if (Status s = ValidateIndices(pages, ItemCapacity(args.kv), "kv page", "decode"); !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d", room_id));
  }
  if (aux && *aux >= ItemCapacity(args.aux)) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: aux index %d out of range [0, %d) on decode", room_id, *aux,
                        ItemCapacity(args.aux)));
  }
  if (Status s = ValidateStateIndices(state_caps_, state_indices, request.state.counts, "decode");
      !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d", room_id));
  }
  if (Status s = CheckDecodePrefix(request, args.page_size); !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d", room_id));
  }
  // Every family's list is the engine's, handed over once: an index twice in one family would
  // have two writes race for one slot.
  {
    thread_local std::vector<int32_t> scratch;
    size_t at = 0;
    for (size_t f = 0; f < state_caps_.size(); ++f) {
      const size_t n =
          request.state.counts.empty() ? state_indices.size() : request.state.counts[f];
      const std::string what = absl::StrFormat("state family %d", f);
      if (Status s = planner::CheckDistinct(state_indices.subspan(at, n), what.c_str(), "decode",
                                            &scratch);
          !s.ok()) {
        return s.WithPrefix(absl::StrFormat("room %d", room_id));
      }
      at += n;
    }
  }
  bool bound = false;
  {
    MutexLock lock(&room->mu);
    if (room->initialized) {
      return Status::FailedPrecondition(absl::StrFormat("room %d: Init() called twice", room_id));
    }
    room->initialized = true;
    room->aux_index = aux;
    room->info.room = room_id;
    room->info.session = session_;
    room->info.dst_kv_pages.assign(pages.begin(), pages.end());
    room->info.aux_index = aux;
    room->info.dst_state_indices.assign(state_indices.begin(), state_indices.end());
    if (request.state.counts.empty()) {
      room->info.dst_state_counts.assign(state_caps_.size(),
                                         static_cast<uint32_t>(state_indices.size()));
    } else {
      room->info.dst_state_counts.assign(request.state.counts.begin(), request.state.counts.end());
    }
    room->info.decode_prefix_len = request.decode_prefix_len;
    room->info.required_dst_info_num = 1;
    if (room->digested) {
      room->digest_expected =
          KvDigest::Empty(local_.kv.descs.size(), pages.size(), local_.aux.descs.size(),
                          local_.state.descs.size(), layout_.Families().size());
    }
    bound = !room->prefills.empty();
  }
  // Before anything can land.
  if (room->digested && landings_) WatchLandings(*room);
  // Not bound yet (still bootstrapping): BindRoom sends it.
  if (bound) SendTransferInfo(room);
  return Status::OK();
}

void DecodeCore::WatchLandings(Room& room) {
  const std::vector<planner::StateFamilySpan> families = layout_.Families();
  std::vector<spi::DigestRange> cells;
  {
    MutexLock lock(&room.mu);
    cells = LandingCells(digest_mine_, room.info.dst_kv_pages, room.info.aux_index,
                         {families, room.info.dst_state_indices, room.info.dst_state_counts});
  }
  auto watch = transport_->WatchLandings(cells);
  if (!watch.ok()) {
    // The pages are read after the last batch instead.
    PDLIB_LOG(kDebug, "decode: room %d: KV digest by a second pass (%s)", room.state->room(),
              watch.status().ToString());
    return;
  }
  MutexLock lock(&room.mu);
  room.landing_watch = *watch;
}

void DecodeCore::DropLandings(Room& room) {
  std::optional<uint64_t> watch;
  {
    MutexLock lock(&room.mu);
    watch = std::exchange(room.landing_watch, std::nullopt);
  }
  if (watch) transport_->DropLandings(*watch);
}

void DecodeCore::OnStatus(const TransferStatusMsg& msg) {
  auto room = FindRoom(msg.room);
  if (!room) {
    PDLIB_LOG(kDebug, "decode: status for unknown room %d ignored", msg.room);
    return;
  }
  if (!msg.status.ok()) {
    // The other prefill ranks of the room hear it too: they stop writing and report the drain.
    FailRoom(room,
             msg.status.WithPrefix(absl::StrFormat("prefill tp rank %d", msg.prefill_tp_rank)),
             true);
    return;
  }
  bool complete = false;
  Status digest_error;
  {
    MutexLock lock(&room->mu);
    if (!room->initialized) return;  // a success before Init() is a confused peer: ignore
    const planner::RankId from{msg.prefill_tp_rank, msg.prefill_pp_rank};
    // Only the ranks that write count (R5.4); a dummy's success says nothing about our bytes.
    bool writer = false;
    for (const auto& p : room->prefills) writer |= !p.target.dummy && p.target.rank == from;
    if (!writer) return;
    for (const planner::RankId& r : room->statuses_ok) {
      if (r == from) return;  // duplicate
    }
    if (pull()) {
      // Prefill confirms what this rank read: a success before our reads from it are all over
      // (and reported) is a confused peer.
      bool read = false;
      for (size_t i = 0; i < room->prefills.size() && i < room->pull.size(); ++i) {
        const auto& p = room->pull[i];
        read |= room->prefills[i].target.rank == from && !room->prefills[i].target.dummy &&
                p.done_sent && !p.failed && p.outstanding == 0;
      }
      if (!read) {
        PDLIB_LOG(kWarning,
                  "decode: room %d: success from prefill tp %d pp %d before its reads "
                  "were done, ignored",
                  msg.room, from.tp_rank, from.pp_rank);
        return;
      }
    }
    if (room->digested && !pull()) {
      // Push: the success carries what that rank wrote here.
      digest_error = !msg.digest ? Status::FailedPrecondition(absl::StrFormat(
                                       "room %d: prefill tp %d pp %d sent no KV digest (its "
                                       "checksum setting differs from this rank's?)",
                                       msg.room, from.tp_rank, from.pp_rank))
                                 : room->digest_expected->Merge(*msg.digest);
      if (!digest_error.ok()) {
        digest_error = Status::DataLoss(
            absl::StrFormat("room %d: the KV digest from prefill tp %d pp %d: %s", msg.room,
                            from.tp_rank, from.pp_rank, digest_error.message()));
      }
    }
    room->statuses_ok.push_back(from);
    complete = room->statuses_ok.size() >= room->expected;
    // Every writer reported its writes complete: none of them can still land, so a failure
    // found now (the metadata slot's room check) needs no quarantine.
    if (complete) {
      for (Exposure& e : room->exposed) e.open = false;
    }
  }
  if (!digest_error.ok()) return FailRoom(room, std::move(digest_error), true);
  if (!complete) return;
  // The digest first: it covers the metadata slot too, and says which bytes differ.
  if (Status s = CheckDigest(*room); !s.ok()) return FailRoom(room, s, true);
  if (Status s = CheckAuxRoom(*room); !s.ok()) return FailRoom(room, s, true);
  // Every writer reported its writes complete: none is left to land. Marked before Success is
  // visible, so that an engine never sees Success with the pages not reusable.
  room->state->MarkReusable();
  if (room->state->Advance(KVPoll::kSuccess)) {
    counters_.CountSuccess(*room->state);
    PDLIB_ROOM_LOG(room->state->logged(), "decode: room %d received", msg.room);
  }
}

Status DecodeCore::CheckDigest(Room& room) {
  if (!room.digested) return Status::OK();
  KvDigest expected;
  TransferInfoMsg info;
  std::vector<std::string> writers;
  std::optional<uint64_t> watch;
  {
    MutexLock lock(&room.mu);
    if (!room.digest_expected) return Status::OK();
    expected = *room.digest_expected;
    info = room.info;
    for (const BoundPrefill& p : room.prefills) {
      if (!p.target.dummy) writers.push_back(p.key);
    }
    watch = std::exchange(room.landing_watch, std::nullopt);
  }
  const std::vector<planner::StateFamilySpan> families = layout_.Families();
  const DigestedFamilies state{families, info.dst_state_indices, info.dst_state_counts};
  // What the transport digested as it copied, by cell: a cell it wrote exactly its length of
  // is taken from there, any other is read from memory (bytes that came another way).
  std::unordered_map<uint64_t, std::pair<uint64_t, spi::LandingDigest>> copied;
  if (watch) {
    auto took = transport_->TakeLandings(*watch);
    const std::vector<spi::DigestRange> cells =
        LandingCells(digest_mine_, info.dst_kv_pages, info.aux_index, state);
    if (took.ok() && took->size() == cells.size()) {
      for (size_t i = 0; i < cells.size(); ++i) {
        copied.emplace(cells[i].addr, std::make_pair(cells[i].length, (*took)[i]));
      }
    }
  }
  size_t reread = 0;
  RangeCrcFn reader;
  if (!copied.empty()) {
    reader = [&](std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs) {
      for (size_t i = 0; i < ranges.size(); ++i) {
        auto it = copied.find(ranges[i].addr);
        if (it != copied.end() && it->second.first == ranges[i].length &&
            it->second.second.bytes == ranges[i].length && ranges[i].zeros_after == 0) {
          crcs[i] = it->second.second.crc;
          continue;
        }
        ++reread;
        if (Status s = HostRangeCrcs(ranges.subspan(i, 1), crcs.subspan(i, 1)); !s.ok()) {
          return s;
        }
      }
      return Status::OK();
    };
  }
  auto landed =
      DigestLanded(digest_mine_, info.dst_kv_pages, info.aux_index, state, expected, reader);
  if (reader && reread == 0) counters_.Add(counters_.checksummed_in_flight);
  if (!landed.ok()) {
    return Status::DataLoss(
        absl::StrFormat("room %d: KV digest: %s", room.state->room(), landed.status().message()));
  }
  if (landed->kv == expected.kv && landed->pages == expected.pages && landed->aux == expected.aux &&
      landed->state == expected.state) {
    return Status::OK();
  }
  const int32_t layers = std::max(1, layout_.engine_layers());
  auto name = [&](uint32_t b) {
    const int32_t layer = layout_.start_layer + static_cast<int32_t>(b) % layers;
    if (layout_.is_mla || static_cast<int32_t>(local_.kv.descs.size()) == layers) {
      return absl::StrFormat("layer %d", layer);
    }
    return absl::StrFormat("layer %d %s", layer, static_cast<int32_t>(b) < layers ? "K" : "V");
  };
  std::vector<uint64_t> bad;
  const std::string what =
      DescribeDigestMismatch(expected, *landed, info.dst_kv_pages.size(), name, &bad);
  {
    MutexLock lock(&room.mu);
    for (uint64_t p : bad) room.corrupt_pages.push_back(info.dst_kv_pages[p]);
  }
  counters_.CountChecksumMismatch(writers);
  return Status::DataLoss(absl::StrFormat(
      "room %d: KV checksum mismatch on decode rank tp %d pp %d (%s): the bytes that landed are "
      "not the bytes prefill sent",
      room.state->room(), options_.args.parallel.tp_rank, options_.args.parallel.pp_rank, what));
}

Status DecodeCore::CheckAuxRoom(const Room& room) const {
  std::optional<uint32_t> aux;
  {
    MutexLock lock(&room.mu);
    aux = room.aux_index;
  }
  if (aux_room_buffer_ < 0 || !aux) return Status::OK();
  const BufferFamily& fam = options_.args.aux;
  uint64_t got = 0;
  std::memcpy(&got,
              reinterpret_cast<const void*>(fam.ptrs[aux_room_buffer_] +
                                            *aux * fam.item_lens[aux_room_buffer_]),
              sizeof(got));
  if (got != room.state->room()) {
    return Status::DataLoss(absl::StrFormat(
        "room %d: metadata slot %d holds bootstrap_room %d; the transfer is not this request's",
        room.state->room(), *aux, got));
  }
  return Status::OK();
}

void DecodeCore::FailRoom(const std::shared_ptr<Room>& room, Status reason, bool tell_prefill) {
  if (!room->state->Fail(reason)) return;
  DropLandings(*room);
  counters_.CountFailure(*room->state);
  PDLIB_LOG(kWarning, "decode: room %d failed: %s", room->state->room(), reason.ToString());
  EnterQuarantine(room);
  if (pull()) SendReadsDone(room);
  if (!tell_prefill) return;
  std::vector<std::shared_ptr<PrefillLink>> links;
  {
    MutexLock lock(&room->mu);
    MutexLock conn_lock(&mu_);
    for (const auto& p : room->prefills) {
      auto it = connections_.find(p.key);
      if (it != connections_.end()) links.push_back(it->second.link);
    }
  }
  for (auto& link : links) link->SendAbort(room->state->room(), session_, reason.ToString());
}

void DecodeCore::AbortRoom(uint64_t room_id, std::string_view reason) {
  if (auto room = FindRoom(room_id)) {
    FailRoom(room,
             Status::Aborted(absl::StrFormat("room %d aborted by decode: %s", room_id, reason)),
             true);
  }
}

void DecodeCore::ReleaseRoom(uint64_t room_id, const RoomState* state) {
  std::shared_ptr<Room> room;
  {
    MutexLock lock(&mu_);
    auto it = room_data_.find(room_id);
    if (it != room_data_.end() && it->second->state.get() == state) {
      room = std::move(it->second);
      room_data_.erase(it);
    }
  }
  if (room && !IsTerminal(room->state->Poll())) {
    FailRoom(room,
             Status::Aborted(absl::StrFormat("room %d: receiver destroyed before the "
                                             "transfer finished",
                                             room_id)),
             true);
  }
  if (room) DropLandings(*room);
  if (room && room->state->Poll() == KVPoll::kFailed) {
    // TakeReusableRooms reports the room once its pages are free (at once if they are).
    MutexLock lock(&room->mu);
    room->released = true;
    if (room->state->PagesReusable()) released_.Add(room_id);
  }
  rooms_.Erase(room_id, state);
}

void DecodeCore::OnPrefillGone(const std::string& key, const Status& reason) {
  std::vector<std::shared_ptr<Room>> rooms;
  std::optional<Connection> conn;
  {
    MutexLock lock(&mu_);
    auto it = connections_.find(key);
    if (it != connections_.end()) {
      conn = std::move(it->second);
      connections_.erase(it);
    }
    for (auto& [id, room] : room_data_) rooms.push_back(room);
  }
  for (auto& room : rooms) {
    bool bound = false;
    {
      MutexLock lock(&room->mu);
      for (const auto& p : room->prefills) bound |= p.key == key;
    }
    if (bound) {
      // The room's other prefill ranks (TP, PP) are told, so that they stop and drain; this one
      // hears on its next connection.
      const bool live = !IsTerminal(room->state->Poll());
      Status why =
          reason.WithPrefix(absl::StrFormat("room %d: prefill %s", room->state->room(), key));
      FailRoom(room, why, true);
      if (live) {
        constexpr size_t kMaxOwedAborts = 1 << 12;
        MutexLock lock(&mu_);
        auto& owed = owed_aborts_[key];
        if (owed.size() >= kMaxOwedAborts) owed.erase(owed.begin());
        owed.emplace_back(room->state->room(), why.ToString());
      }
    }
  }
  if (conn) {
    conn->link->Close();
    MutexLock transport_lock(&transport_mu_);
    if (!transport_) return;  // shut down meanwhile: nothing can land any more
    if (conn->source) {
      // Our own reads from that rank: cancelled; each batch's callback (which ends its room's
      // hold on the pages) comes once none of its reads can land any more.
      transport_->Disconnect(conn->source->peer);
      PDLIB_LOG(kInfo, "decode: prefill %s gone: %s", key, reason.ToString());
      return;
    }
    if (transport_->capabilities().fences) {
      // Cut the prefill rank off before its pages are handed out again: a write it posted
      // (however late it runs) is dropped from now on.
      if (Status s = transport_->FenceTarget(conn->target); s.ok()) {
        {
          MutexLock lock(&mu_);
          ++fenced_connections_;
        }
        const uint64_t gen = conn->gen;
        ClearExposures([&](uint64_t, const Exposure& e) { return e.key == key && e.gen == gen; },
                       Release::kFenced);
      } else {
        PDLIB_LOG(kError, "decode: fencing prefill %s failed (its rooms stay quarantined): %s", key,
                  s.ToString());
      }
    }
    transport_->CloseTargetEndpoint(conn->target);
  }
  PDLIB_LOG(kInfo, "decode: prefill %s gone: %s", key, reason.ToString());
}

void DecodeCore::CheckTimeouts() {
  absl::Time now = absl::Now();
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [id, room] : room_data_) rooms.push_back(room);
  }
  for (auto& room : rooms) {
    if (Status s = CheckRoomDeadline(*room->state, options_, now); !s.ok()) FailRoom(room, s, true);
  }
  WarnLongQuarantines(now);
  if (pull()) {
    SendHeartbeats(now);
    DropFailedSources();
  }
}

std::vector<uint64_t> DecodeCore::TakeReusableRooms() { return released_.Take(); }

KVManagerMetrics DecodeCore::metrics() const {
  KVManagerMetrics m;
  counters_.FillInto(&m, rooms_);
  std::vector<std::shared_ptr<Room>> held;
  {
    MutexLock lock(&mu_);
    m.connections = connections_.size();
    for (auto& [ptr, room] : quarantine_) held.push_back(room);
    m.quarantine_max_hold_ms = max_hold_ms_;
    m.quarantine_released_drained = released_by_[static_cast<int>(Release::kDrained)];
    m.quarantine_released_fenced = released_by_[static_cast<int>(Release::kFenced)];
    m.quarantine_released_gone = released_by_[static_cast<int>(Release::kGone)];
    m.fenced_connections = fenced_connections_;
  }
  // Room locks come before mu_ (see FailRoom), so the rooms are read after it is released.
  const absl::Time now = absl::Now();
  for (auto& room : held) {
    MutexLock room_lock(&room->mu);
    if (!room->quarantined) continue;
    ++m.quarantined_rooms;
    m.quarantined_pages += room->held_pages;
    m.quarantine_oldest_ms = std::max<uint64_t>(
        m.quarantine_oldest_ms, absl::ToInt64Milliseconds(now - room->quarantined_at));
  }
  m.quarantine_max_hold_ms = std::max(m.quarantine_max_hold_ms, m.quarantine_oldest_ms);
  return m;
}

}  // namespace v1
}  // namespace pdlib
