#include "lib/core/kv_digest.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lib/base/crc32c.h"

namespace pdlib {
inline namespace v1 {
namespace {

using planner::RegionKind;

// A cell's key: a nonzero field element drawn from its place.
uint32_t CellKey(RegionKind kind, uint64_t buffer, uint64_t index) {
  uint64_t z = (static_cast<uint64_t>(kind) << 62) ^ (buffer << 40) ^ index;
  z += 0x9E3779B97F4A7C15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z) | 1u;
}

const uint8_t* At(uint64_t base, uint64_t offset) {
  return reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(base + offset));
}

std::string Shape(const KvDigest& d) {
  return absl::StrFormat("{kv %d, page columns %d of %d pages, aux %d, state %d, families %d}",
                         d.kv.size(), d.pages.size(), d.page_group, d.aux.size(), d.state.size(),
                         d.state_spans.size());
}

}  // namespace

uint32_t DigestPageGroup(uint64_t pages) {
  return static_cast<uint32_t>(
      std::max<uint64_t>(1, (pages + kMaxDigestColumns - 1) / kMaxDigestColumns));
}

KvDigest KvDigest::Empty(size_t kv_buffers, uint64_t request_pages, size_t aux_buffers,
                         size_t state_buffers, size_t state_families) {
  KvDigest d;
  d.page_group = DigestPageGroup(request_pages);
  d.kv.assign(kv_buffers, 0);
  d.pages.assign((request_pages + d.page_group - 1) / d.page_group, 0);
  d.aux.assign(aux_buffers, 0);
  d.state.assign(state_buffers, 0);
  d.state_spans.assign(state_families, {0, 0});
  return d;
}

bool KvDigest::SameShape(const KvDigest& o) const {
  return page_group == o.page_group && kv.size() == o.kv.size() && pages.size() == o.pages.size() &&
         aux.size() == o.aux.size() && state.size() == o.state.size() &&
         state_spans.size() == o.state_spans.size();
}

Status KvDigest::Merge(const KvDigest& o) {
  if (!SameShape(o)) {
    return Status::InvalidArgument(
        absl::StrFormat("a KV digest of shape %s where %s was expected", Shape(o), Shape(*this)));
  }
  if (o.aux_row >= 0) {
    if (aux_row >= 0 && aux_row != o.aux_row) {
      return Status::InvalidArgument(
          absl::StrFormat("senders wrote metadata slots %d and %d", aux_row, o.aux_row));
    }
    aux_row = o.aux_row;
  }
  for (size_t f = 0; f < state_spans.size(); ++f) {
    const auto& theirs = o.state_spans[f];
    if (theirs.second == 0) continue;
    if (state_spans[f].second != 0 && state_spans[f] != theirs) {
      return Status::InvalidArgument(absl::StrFormat(
          "state family %d: senders covered positions [%d, +%d) and [%d, +%d) of decode's list", f,
          state_spans[f].first, state_spans[f].second, theirs.first, theirs.second));
    }
    state_spans[f] = theirs;
  }
  for (auto [mine, theirs] : {std::pair{&kv, &o.kv}, std::pair{&pages, &o.pages},
                              std::pair{&aux, &o.aux}, std::pair{&state, &o.state}}) {
    for (size_t i = 0; i < mine->size(); ++i) (*mine)[i] ^= (*theirs)[i];
  }
  return Status::OK();
}

PagePositions::PagePositions(std::span<const int32_t> dst_pages) {
  sorted_.reserve(dst_pages.size());
  for (size_t i = 0; i < dst_pages.size(); ++i) {
    sorted_.emplace_back(dst_pages[i], static_cast<uint32_t>(i));
  }
  std::sort(sorted_.begin(), sorted_.end());
}

int64_t PagePositions::Find(int64_t page) const {
  auto it = std::lower_bound(sorted_.begin(), sorted_.end(), page,
                             [](const auto& e, int64_t p) { return e.first < p; });
  if (it == sorted_.end() || it->first != page) return -1;
  return it->second;
}

Status HostRangeCrcs(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs) {
  if (crcs.size() < ranges.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("KV digest: %d ranges and room for %d CRCs", ranges.size(), crcs.size()));
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    const spi::DigestRange& r = ranges[i];
    crcs[i] = Crc32cAppendZeros(Crc32cRaw(0, At(r.addr, 0), r.length), r.zeros_after);
  }
  return Status::OK();
}

namespace {

// The ranges of one digest pass and the cell each belongs to, computed together by the memory's
// reader (one kernel launch for GPU pools) and then folded into cells.
struct DigestPass {
  struct Cell {
    RegionKind kind = RegionKind::kKv;
    uint32_t buffer = 0;
    uint64_t index = 0;
  };
  std::vector<spi::DigestRange> ranges;
  std::vector<Cell> cells;
  std::vector<uint32_t> crcs;

  void Add(uint64_t addr, uint64_t length, uint64_t zeros_after, Cell cell) {
    ranges.push_back({addr, length, zeros_after});
    cells.push_back(cell);
  }
  Status Compute(const DigestMemory& memory, const RangeCrcFn& reader = {}) {
    crcs.assign(ranges.size(), 0);
    if (ranges.empty()) return Status::OK();
    Status s;
    if (reader) {
      s = reader(ranges, crcs);
    } else if (!memory.device_crcs) {
      s = HostRangeCrcs(ranges, crcs);
    } else {
      // KV and state on the device in one call, the aux rows (host memory) here.
      std::vector<spi::DigestRange> device;
      std::vector<size_t> at;
      for (size_t i = 0; i < ranges.size() && s.ok(); ++i) {
        if (cells[i].kind == RegionKind::kAux) {
          s = HostRangeCrcs(std::span(&ranges[i], 1), std::span(&crcs[i], 1));
        } else {
          device.push_back(ranges[i]);
          at.push_back(i);
        }
      }
      std::vector<uint32_t> out(device.size(), 0);
      if (s.ok() && !device.empty()) s = memory.device_crcs(device, out);
      for (size_t j = 0; s.ok() && j < at.size(); ++j) crcs[at[j]] = out[j];
    }
    return s.ok() ? s : s.WithPrefix("KV digest");
  }
};

// Where each family's list starts in state.lists and how long it is: the lists one after
// another (counts add up), or one list every family uses.
std::vector<std::pair<size_t, uint32_t>> FamilyLists(const DigestedFamilies& state) {
  uint64_t counted = 0;
  for (uint32_t c : state.counts) counted += c;
  const bool one_list = counted != state.lists.size();
  std::vector<std::pair<size_t, uint32_t>> out;
  size_t list_at = 0;
  for (size_t f = 0; f < state.families.size(); ++f) {
    const uint32_t listed =
        f < state.counts.size() ? state.counts[f] : static_cast<uint32_t>(state.lists.size());
    out.emplace_back(list_at, listed);
    if (!one_list) list_at += listed;
  }
  return out;
}

}  // namespace

namespace {

const std::vector<uint64_t>& ItemsOf(const DigestMemory& m, RegionKind kind) {
  return kind == RegionKind::kAux     ? m.aux_item
         : kind == RegionKind::kState ? m.state_item
                                      : m.kv_item;
}

}  // namespace

Status SplitWritesAtItems(std::span<const planner::PlannedWrite> writes,
                          const DigestMemory& dst_items, std::vector<planner::PlannedWrite>* out) {
  for (const planner::PlannedWrite& w : writes) {
    const std::vector<uint64_t>& items = ItemsOf(dst_items, w.kind);
    if (w.remote_buffer >= items.size() || items[w.remote_buffer] == 0) {
      return Status::InvalidArgument(
          absl::StrFormat("KV digest: a %s write to buffer %d outside the layouts",
                          planner::RegionKindName(w.kind), w.remote_buffer));
    }
    const uint64_t item = items[w.remote_buffer];
    planner::PlannedWrite piece = w;
    for (uint64_t done = 0; done < w.length;) {
      const uint64_t n = std::min(w.length - done, item - (w.remote_offset + done) % item);
      piece.local_offset = w.local_offset + done;
      piece.remote_offset = w.remote_offset + done;
      piece.length = n;
      out->push_back(piece);
      done += n;
    }
    if (w.length == 0) out->push_back(w);
  }
  return Status::OK();
}

Status AddWritesToDigest(std::span<const planner::PlannedWrite> writes, const DigestMemory& src,
                         const DigestMemory& dst_items, const PagePositions& positions,
                         KvDigest* digest, std::span<const uint32_t> sent) {
  if (!sent.empty() && sent.size() != writes.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("KV digest: %d sent CRCs for %d writes", sent.size(), writes.size()));
  }
  DigestPass pass;
  pass.ranges.reserve(writes.size());
  pass.cells.reserve(writes.size());
  for (const planner::PlannedWrite& w : writes) {
    const std::vector<uint64_t>* src_base = &src.kv;
    const std::vector<uint64_t>* items = &dst_items.kv_item;
    const std::vector<uint32_t>* rows = &digest->kv;
    if (w.kind == RegionKind::kAux) {
      src_base = &src.aux;
      items = &dst_items.aux_item;
      rows = &digest->aux;
    } else if (w.kind == RegionKind::kState) {
      src_base = &src.state;
      items = &dst_items.state_item;
      rows = &digest->state;
    }
    if (w.local_buffer >= src_base->size() || w.remote_buffer >= items->size() ||
        w.remote_buffer >= rows->size() || (*items)[w.remote_buffer] == 0) {
      return Status::InvalidArgument(
          absl::StrFormat("KV digest: a %s write from buffer %d to buffer %d outside the layouts",
                          planner::RegionKindName(w.kind), w.local_buffer, w.remote_buffer));
    }
    const uint64_t item = (*items)[w.remote_buffer];
    uint64_t addr = (*src_base)[w.local_buffer] + w.local_offset;
    uint64_t offset = w.remote_offset;
    uint64_t left = w.length;
    while (left > 0) {
      const uint64_t index = offset / item;
      const uint64_t within = offset % item;
      const uint64_t n = std::min(left, item - within);
      // Raw CRC of these bytes as they sit in the item, the item's other bytes zero: the bytes
      // before them leave a zero register as it is, the ones after are appended zeros.
      if (!sent.empty() && n != w.length) {
        return Status::InvalidArgument(absl::StrFormat(
            "KV digest: a sent %s write of %d bytes crosses an item of %d bytes (not split)",
            planner::RegionKindName(w.kind), w.length, item));
      }
      pass.Add(addr, n, item - within - n, {w.kind, w.remote_buffer, index});
      offset += n;
      addr += n;
      left -= n;
    }
  }
  Status computed;
  if (sent.empty()) {
    computed = pass.Compute(src);
  } else {
    // What the transport read as it sent, placed in the item: one range per write (zero-length
    // writes have none).
    pass.crcs.assign(pass.ranges.size(), 0);
    for (size_t w = 0, r = 0; w < writes.size(); ++w) {
      if (writes[w].length == 0) continue;
      pass.crcs[r] = Crc32cAppendZeros(sent[w], pass.ranges[r].zeros_after);
      ++r;
    }
  }
  if (!computed.ok()) return computed;
  // Consecutive ranges usually fill the same cell (the pieces of a head-sliced page), so its key
  // is applied once.
  for (size_t i = 0; i < pass.cells.size();) {
    const DigestPass::Cell& cell = pass.cells[i];
    uint32_t crc = 0;
    for (; i < pass.cells.size() && pass.cells[i].kind == cell.kind &&
           pass.cells[i].buffer == cell.buffer && pass.cells[i].index == cell.index;
         ++i) {
      crc ^= pass.crcs[i];
    }
    const uint32_t v = Crc32cMulMod(crc, CellKey(cell.kind, cell.buffer, cell.index));
    switch (cell.kind) {
      case RegionKind::kKv: {
        const int64_t pos = positions.Find(static_cast<int64_t>(cell.index));
        if (pos < 0 || static_cast<uint64_t>(pos) / digest->page_group >= digest->pages.size()) {
          return Status::InvalidArgument(
              absl::StrFormat("KV digest: page %d is not one of the request's", cell.index));
        }
        digest->kv[cell.buffer] ^= v;
        digest->pages[static_cast<uint64_t>(pos) / digest->page_group] ^= v;
        break;
      }
      case RegionKind::kAux:
        if (digest->aux_row >= 0 && static_cast<uint64_t>(digest->aux_row) != cell.index) {
          return Status::InvalidArgument(absl::StrFormat("KV digest: aux writes to slots %d and %d",
                                                         digest->aux_row, cell.index));
        }
        digest->aux_row = static_cast<int64_t>(cell.index);
        digest->aux[cell.buffer] ^= v;
        break;
      case RegionKind::kState: digest->state[cell.buffer] ^= v; break;
    }
  }
  return Status::OK();
}

Status FillStateSpans(const planner::PairPlan& plan, const planner::TailInput& tail,
                      KvDigest* digest) {
  for (size_t f = 0; f < digest->state_spans.size() && f < plan.state_families.size(); ++f) {
    const size_t ns = tail.src_state_counts.empty()
                          ? tail.src_state.size()
                          : (f < tail.src_state_counts.size() ? tail.src_state_counts[f] : 0);
    const size_t nd = f < tail.dst_state_counts.size() ? tail.dst_state_counts[f] : 0;
    bool sends = false;
    for (const planner::BufferMap& m : plan.state) sends |= m.family == static_cast<int32_t>(f);
    if (!sends || ns == 0 || nd == 0) continue;
    auto pairing =
        planner::AlignStateLists(plan.state_families[f].type, ns, nd, tail.request_pages);
    if (!pairing.ok()) return pairing.status();
    digest->state_spans[f] = {static_cast<uint32_t>(pairing->dst_begin),
                              static_cast<uint32_t>(pairing->count)};
  }
  return Status::OK();
}

StatusOr<KvDigest> DigestLanded(const DigestMemory& mine, std::span<const int32_t> dst_pages,
                                std::optional<uint32_t> aux_index, const DigestedFamilies& state,
                                const KvDigest& expected, const RangeCrcFn& reader) {
  KvDigest d = KvDigest::Empty(mine.kv.size(), dst_pages.size(), mine.aux.size(), mine.state.size(),
                               state.families.size());
  if (!d.SameShape(expected)) {
    return Status::InvalidArgument(absl::StrFormat(
        "prefill's KV digest has shape %s, this rank's is %s", Shape(expected), Shape(d)));
  }
  // Every cell is one whole item; for KV pages the cell's index is its request position (the
  // column), its page is recomputed for the key.
  DigestPass pass;
  for (size_t b = 0; b < mine.kv.size(); ++b) {
    const uint64_t item = mine.kv_item[b];
    for (size_t pos = 0; pos < dst_pages.size(); ++pos) {
      const uint64_t page = static_cast<uint64_t>(dst_pages[pos]);
      pass.Add(mine.kv[b] + page * item, item, 0, {RegionKind::kKv, static_cast<uint32_t>(b), pos});
    }
  }
  if (expected.aux_row >= 0) {
    if (!aux_index || *aux_index != expected.aux_row) {
      return Status::InvalidArgument(absl::StrFormat(
          "prefill's KV digest covers metadata slot %d; this request's is %s", expected.aux_row,
          aux_index ? absl::StrFormat("%d", *aux_index) : std::string("none")));
    }
    d.aux_row = expected.aux_row;
    for (size_t b = 0; b < mine.aux.size(); ++b) {
      const uint64_t item = mine.aux_item[b];
      pass.Add(mine.aux[b] + *aux_index * item, item, 0,
               {RegionKind::kAux, static_cast<uint32_t>(b), *aux_index});
    }
  }
  const std::vector<std::pair<size_t, uint32_t>> lists = FamilyLists(state);
  for (size_t f = 0; f < state.families.size(); ++f) {
    const auto [list_at, listed] = lists[f];
    const auto [first, count] = expected.state_spans[f];
    if (static_cast<uint64_t>(first) + count > listed || list_at + listed > state.lists.size()) {
      return Status::InvalidArgument(absl::StrFormat(
          "prefill's KV digest covers positions [%d, +%d) of state family %d; decode listed %d",
          first, count, f, listed));
    }
    d.state_spans[f] = expected.state_spans[f];
    const planner::StateFamilySpan& fam = state.families[f];
    for (uint32_t i = 0; i < count; ++i) {
      const uint64_t slot = static_cast<uint64_t>(state.lists[list_at + first + i]);
      for (uint32_t b = fam.first; b < fam.first + fam.count && b < mine.state.size(); ++b) {
        const uint64_t item = mine.state_item[b];
        pass.Add(mine.state[b] + slot * item, item, 0, {RegionKind::kState, b, slot});
      }
    }
  }
  if (Status s = pass.Compute(mine, reader); !s.ok()) return s;
  for (size_t i = 0; i < pass.cells.size(); ++i) {
    const DigestPass::Cell& cell = pass.cells[i];
    switch (cell.kind) {
      case RegionKind::kKv: {
        const uint32_t v = Crc32cMulMod(
            pass.crcs[i],
            CellKey(RegionKind::kKv, cell.buffer, static_cast<uint64_t>(dst_pages[cell.index])));
        d.kv[cell.buffer] ^= v;
        d.pages[cell.index / d.page_group] ^= v;
        break;
      }
      case RegionKind::kAux:
        d.aux[cell.buffer] =
            Crc32cMulMod(pass.crcs[i], CellKey(RegionKind::kAux, cell.buffer, cell.index));
        break;
      case RegionKind::kState:
        d.state[cell.buffer] ^=
            Crc32cMulMod(pass.crcs[i], CellKey(RegionKind::kState, cell.buffer, cell.index));
        break;
    }
  }
  return d;
}

std::vector<spi::DigestRange> LandingCells(const DigestMemory& mine,
                                           std::span<const int32_t> dst_pages,
                                           std::optional<uint32_t> aux_index,
                                           const DigestedFamilies& state) {
  std::vector<spi::DigestRange> cells;
  for (size_t b = 0; b < mine.kv.size(); ++b) {
    for (int32_t page : dst_pages) {
      const uint64_t item = mine.kv_item[b];
      cells.push_back({mine.kv[b] + static_cast<uint64_t>(page) * item, item, 0});
    }
  }
  if (aux_index) {
    for (size_t b = 0; b < mine.aux.size(); ++b) {
      cells.push_back({mine.aux[b] + *aux_index * mine.aux_item[b], mine.aux_item[b], 0});
    }
  }
  const std::vector<std::pair<size_t, uint32_t>> lists = FamilyLists(state);
  for (size_t f = 0; f < state.families.size(); ++f) {
    const auto [list_at, listed] = lists[f];
    if (list_at + listed > state.lists.size()) break;
    const planner::StateFamilySpan& fam = state.families[f];
    for (uint32_t i = 0; i < listed; ++i) {
      const auto slot = static_cast<uint64_t>(state.lists[list_at + i]);
      for (uint32_t b = fam.first; b < fam.first + fam.count && b < mine.state.size(); ++b) {
        cells.push_back({mine.state[b] + slot * mine.state_item[b], mine.state_item[b], 0});
      }
    }
  }
  return cells;
}

std::string DescribeDigestMismatch(const KvDigest& expected, const KvDigest& landed,
                                   uint64_t request_pages,
                                   const std::function<std::string(uint32_t)>& kv_name,
                                   std::vector<uint64_t>* bad_positions) {
  std::vector<std::string> parts;
  std::vector<std::string> kv;
  for (size_t b = 0; b < expected.kv.size() && b < landed.kv.size(); ++b) {
    if (expected.kv[b] != landed.kv[b]) kv.push_back(kv_name(static_cast<uint32_t>(b)));
  }
  if (kv.size() > 8) {
    const size_t more = kv.size() - 8;
    kv.resize(8);
    kv.push_back(absl::StrFormat("%d more", more));
  }
  if (!kv.empty()) parts.push_back(absl::StrJoin(kv, ", "));
  std::vector<std::string> ranges;
  for (size_t c = 0; c < expected.pages.size() && c < landed.pages.size(); ++c) {
    if (expected.pages[c] == landed.pages[c]) continue;
    const uint64_t begin = c * expected.page_group;
    const uint64_t end = std::min<uint64_t>(request_pages, begin + expected.page_group);
    for (uint64_t p = begin; p < end; ++p) bad_positions->push_back(p);
    // Adjacent columns read as one range.
    if (!ranges.empty() && c > 0 && expected.pages[c - 1] != landed.pages[c - 1]) {
      ranges.back() =
          ranges.back().substr(0, ranges.back().find(',') + 2) + absl::StrFormat("%d)", end);
    } else {
      ranges.push_back(absl::StrFormat("[%d, %d)", begin, end));
    }
  }
  if (!ranges.empty()) parts.push_back("request pages " + absl::StrJoin(ranges, ", "));
  for (size_t b = 0; b < expected.aux.size() && b < landed.aux.size(); ++b) {
    if (expected.aux[b] != landed.aux[b]) parts.push_back(absl::StrFormat("aux buffer %d", b));
  }
  for (size_t b = 0; b < expected.state.size() && b < landed.state.size(); ++b) {
    if (expected.state[b] != landed.state[b]) {
      parts.push_back(absl::StrFormat("state buffer %d", b));
    }
  }
  return absl::StrJoin(parts, "; ");
}

}  // namespace v1
}  // namespace pdlib
