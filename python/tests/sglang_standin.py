"""Stand-ins for the pieces of SGLang that its disaggregation schedulers use around a transfer
backend, written from upstream sgl-project/sglang main at 3c69a4c7 (2026-08-22),
python/sglang/srt/disaggregation/:

  base/conn.py (4f343abc, 2026-08-21)  KVArgs (annotations only), KVPoll, StateType,
                              KVTransferMetric; KVArgsNewer and the marked StateType members are
                              base/conn.py @ccd10042 (newer, undated)
  utils.py (ac179eec, 2026-08-22)  DisaggregationMode, MetadataBuffers (get_buf_infos, get_buf,
                              set_buf), ReqToMetadataIdxAllocator, poll_and_all_reduce with
                              _apply_metadata_gate, poll_and_all_reduce_attn_cp_tp_group
  mem_cache/common.py         kv_to_page_indices, kv_to_page_num

numpy replaces torch (the pools are host memory here) and a thread Group replaces the gloo
process group; nothing pdlib-specific is in them. The scheduler replay is sglang_sched.py.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from typing import Any, List, Optional

import numpy as np


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class StateType(str, enum.Enum):
    """base/conn.py @3c69a4c7's members, then those only newer, undated revisions have."""

    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"
    MINIMAX_INDEX_K = "minimax_index_k"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"
    BLOCK_SCALE = "block_scale"
    BLOCK_SCALE_SWA = "block_scale_swa"
    # base/conn.py @ccd10042 (newer than 2026-08-22)
    QSA_PENDING = "qsa_pending"
    QSA_COMPRESSED = "qsa_compressed"
    DSA_TAIL = "dsa_tail"
    MINIMAX_DENSE_KV = "minimax_dense_kv"


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVArgs:
    """base/conn.py KVArgs: annotations and one class default, nothing else."""

    engine_rank: int
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    kv_layer_ids: List[int]
    kv_cache_dtype_str: str
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_types: List[StateType]
    state_data_ptrs: List[List[int]]
    state_data_lens: List[List[int]]
    state_item_lens: List[List[int]]
    state_layer_ids: List[List[int]]
    state_dim_per_tensor: List[List[int]]
    state_slice_outer_counts: List[List[int]]
    is_hybrid_mla_backend: bool
    state_conv_shard_groups: List[List[Optional[List[int]]]]
    ib_device: str
    gpu_id: int
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    system_dp_rank: int
    pp_rank: int
    prefill_start_layer: int
    prefill_end_layer: Optional[int]
    mla_compression_ratios: Optional[List[int]]
    kv_buf_groups: int
    total_kv_layers: int


class KVArgsNewer(KVArgs):
    """base/conn.py @ccd10042 (newer than 2026-08-22) adds these."""

    rust_http_port: Optional[int]
    num_draft_entries: int = 0


def kv_to_page_indices(kv_indices: np.ndarray, page_size: int) -> np.ndarray:
    """mem_cache/common.py: the page of every page_size-th token."""
    return kv_indices[::page_size] // page_size


def kv_to_page_num(num_kv_indices: int, page_size: int) -> int:
    return (num_kv_indices + page_size - 1) // page_size


class ReqToMetadataIdxAllocator:
    def __init__(self, size: int):
        self.size = size
        self.free_slots = deque(list(range(size)))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> Optional[int]:
        if len(self.free_slots) == 0:
            return None
        return self.free_slots.popleft()

    def free(self, free_index: int) -> None:
        self.free_slots.append(free_index)


class MetadataBuffers:
    """utils.py MetadataBuffers: 10 buffers; +1 with output_dsa_topk_indices_dim > 0; +3 with
    max_sampling_mask_tokens > 0; bootstrap_room (8 uint64 per slot) last at 3c69a4c7.
    SGLang's KV checksum (--disaggregation-enable-kv-checksum, after 2026-08-22: set_kv_checksum
    / get_kv_checksum, which prefill.py @423bf210 and decode.py @b7e89b39 call) adds a row
    whose place among the buffers no stored revision of utils.py shows: `kv_checksum_position`
    ("before" or "after" bootstrap_room) is the test's choice, so pdlib must find bootstrap_room by name."""

    def __init__(self, size: int, hidden_size: int, hidden_states_dtype: Any = np.float32,
                 max_top_logprobs_num: int = 128, max_sampling_mask_tokens: int = 0,
                 output_dsa_topk_indices_dim: int = 0, kv_checksum_position: str = ""):
        self.enable_sampling_mask = max_sampling_mask_tokens > 0
        self.output_ids = np.zeros((size, 16), np.int32)
        self.cached_tokens = np.zeros((size, 16), np.int32)
        self.output_token_logprobs_val = np.zeros((size, 16), np.float32)
        self.output_token_logprobs_idx = np.zeros((size, 16), np.int32)
        self.output_top_logprobs_val = np.zeros((size, max_top_logprobs_num), np.float32)
        self.output_top_logprobs_idx = np.zeros((size, max_top_logprobs_num), np.int32)
        self.output_token_sampling_mask_len = None
        self.output_token_sampling_mask_idx = None
        self.output_token_sampling_logprobs = None
        if self.enable_sampling_mask:
            self.output_token_sampling_mask_len = np.zeros((size, 16), np.int32)
            self.output_token_sampling_mask_idx = np.zeros((size, max_sampling_mask_tokens),
                                                           np.int32)
            self.output_token_sampling_logprobs = np.zeros((size, 16), np.float32)
        self.output_topk_p = np.zeros((size, 16), np.float32)
        self.output_topk_index = np.zeros((size, 16), np.int64)
        self.output_hidden_states = np.zeros((size, hidden_size), hidden_states_dtype)
        self.output_dsa_topk_indices = (np.full((size, output_dsa_topk_indices_dim), -1, np.int32)
                                        if output_dsa_topk_indices_dim > 0 else None)
        self.bootstrap_room = np.zeros((size, 8), np.uint64)
        self.kv_checksum_position = kv_checksum_position
        self.kv_checksum = np.zeros((size, 8), np.uint64) if kv_checksum_position else None

    def set_kv_checksum(self, req: Any, value: int) -> None:
        assert self.kv_checksum is not None
        self.kv_checksum[req.metadata_buffer_index][0] = value

    def get_kv_checksum(self, idx: int) -> int:
        assert self.kv_checksum is not None
        return int(self.kv_checksum[idx][0])

    def buffers(self) -> List[np.ndarray]:
        bufs = [self.output_ids, self.cached_tokens, self.output_token_logprobs_val,
                self.output_token_logprobs_idx, self.output_top_logprobs_val,
                self.output_top_logprobs_idx]
        if self.enable_sampling_mask:
            bufs += [self.output_token_sampling_mask_len, self.output_token_sampling_mask_idx,
                     self.output_token_sampling_logprobs]
        bufs += [self.output_topk_p, self.output_topk_index, self.output_hidden_states]
        if self.output_dsa_topk_indices is not None:
            bufs.append(self.output_dsa_topk_indices)
        if self.kv_checksum_position == "before":
            bufs.append(self.kv_checksum)
        bufs.append(self.bootstrap_room)
        if self.kv_checksum_position == "after":
            bufs.append(self.kv_checksum)
        return bufs

    def get_buf_infos(self):
        bufs = self.buffers()
        return ([b.ctypes.data for b in bufs], [b.nbytes for b in bufs],
                [b[0].nbytes for b in bufs])

    def get_buf(self, idx: int):
        return (self.output_ids[idx].copy(), self.cached_tokens[idx].copy(),
                self.output_token_logprobs_val[idx].copy(),
                self.output_token_logprobs_idx[idx].copy(),
                self.output_top_logprobs_val[idx].copy(),
                self.output_top_logprobs_idx[idx].copy(),
                None if not self.enable_sampling_mask
                else self.output_token_sampling_mask_len[idx].copy(),
                None if not self.enable_sampling_mask
                else self.output_token_sampling_mask_idx[idx].copy(),
                None if not self.enable_sampling_mask
                else self.output_token_sampling_logprobs[idx].copy(),
                self.output_topk_p[idx].copy(), self.output_topk_index[idx].copy(),
                self.output_hidden_states[idx].copy(),
                None if self.output_dsa_topk_indices is None
                else self.output_dsa_topk_indices[idx].copy(),
                self.bootstrap_room[idx].copy())

    def set_buf(self, req: Any) -> None:
        """What prefill writes for a request (every row the transfer carries): its first token,
        token counts, and a value per optional buffer derived from the room, so that decode can
        check each one."""
        i = req.metadata_buffer_index
        room = req.bootstrap_room
        self.output_ids[i][0] = req.output_ids[0]
        self.cached_tokens[i][0] = len(req.origin_input_ids)
        self.output_topk_p[i][0] = float(room % 1000)
        self.output_topk_index[i][0] = room
        self.output_hidden_states[i][:] = room % 251
        if self.enable_sampling_mask:
            self.output_token_sampling_mask_len[i][0] = room % 97
            self.output_token_sampling_mask_idx[i][:] = room % 89
        if self.output_dsa_topk_indices is not None:
            self.output_dsa_topk_indices[i][:] = room % 83
        self.bootstrap_room[i][0] = room


class Group:
    """A gloo group of `size` ranks that are threads of this process: all_reduce(MIN) as
    SGLang's poll_and_all_reduce does it (every rank blocks until all have contributed)."""

    def __init__(self, size: int, timeout: float = 120.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout) if size > 1 else None
        self._slots: List[Any] = [None] * size

    def all_gather(self, rank: int, value: Any) -> List[Any]:
        if self._barrier is None:
            return [value]
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out

    def all_reduce_min(self, rank: int, values: List[int]) -> List[int]:
        gathered = self.all_gather(rank, list(values))
        return [min(column) for column in zip(*gathered)] if values else []

    def broadcast(self, rank: int, value: Any) -> Any:
        return self.all_gather(rank, value)[0]

    def abort(self) -> None:
        if self._barrier is not None:
            self._barrier.abort()


class RankGroup:
    """One rank's view of a Group: what SGLang passes as gloo_group / attn_tp_cpu_group."""

    def __init__(self, group: Group, rank: int):
        self.group, self.rank = group, rank


def poll_and_all_reduce(pollers, gloo_group: RankGroup, decode_reqs=None,
                        metadata_buffers: Optional[MetadataBuffers] = None) -> List[int]:
    """utils.py poll_and_all_reduce: int(poll()) of every poller, the metadata gate (Success
    waits for bootstrap_room to land), then the MIN all-reduce over the group."""
    polls = [int(poller.poll()) for poller in pollers]
    if decode_reqs is not None and metadata_buffers is not None:
        for i, poll_val in enumerate(polls):  # _apply_metadata_gate
            if poll_val == int(KVPoll.Success):
                idx = decode_reqs[i].metadata_buffer_index
                if int(metadata_buffers.bootstrap_room[idx, 0]) == 0:
                    polls[i] = int(KVPoll.Transferring)
    return gloo_group.group.all_reduce_min(gloo_group.rank, polls)


def poll_and_all_reduce_attn_cp_tp_group(pollers, attn_cp_cpu_group: Optional[RankGroup],
                                         attn_tp_cpu_group: RankGroup) -> List[int]:
    polls = poll_and_all_reduce(pollers, attn_tp_cpu_group)
    if attn_cp_cpu_group is not None:
        polls = attn_cp_cpu_group.group.all_reduce_min(attn_cp_cpu_group.rank, polls)
    return polls
