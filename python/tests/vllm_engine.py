"""One vLLM engine (EngineCore: a scheduler and its TP workers) around pdlib.vllm, replayed for
test_vllm: run as a process, driven by JSON lines on stdin, answering JSON lines on stdout.

The call sequence is upstream vllm-project/vllm's, read at these commits:
  * start-up (v1/engine/core.py): the workers are built and register their KV caches
    (GPUModelRunner.initialize_kv_cache -> register_kv_caches), then the scheduler and its
    connector; set_xfer_handshake_metadata when workers export metadata. The KV layout is the
    one get_required_kvcache_layout() asks for, read before allocation.
  * Scheduler (v1/core/sched/scheduler.py @00024d314514): schedule()'s WAITING loop
    (_update_waiting_for_remote_kv, local prefix hit, get_num_new_matched_tokens,
    allocate_slots with delay_cache_blocks, update_state_after_alloc(request,
    get_blocks(request_id), num_external_tokens), WAITING_FOR_REMOTE_KVS), the SchedulerOutput
    with finished_req_ids, build_connector_meta, _update_after_schedule; update_from_output
    (_handle_invalid_blocks with the recompute policy, stop checks, _free_request ->
    _connector_finished -> request_finished, _update_from_kv_xfer_finished); finish_requests
    for aborts (a WAITING_FOR_REMOTE_KVS request's blocks wait for finished_recving).
  * Workers (v1/worker/kv_connector_model_runner_mixin.py @23ec7c7fab7a): per step
    bind_connector_metadata, start_load_kv, the forward (wait_for_layer_load / save_kv_layer
    per layer), wait_for_save, get_finished(finished_req_ids),
    get_block_ids_with_load_errors, get_kv_connector_stats, clear_connector_metadata; the
    executor's KVOutputAggregator reports an id once every worker has.
Simplifications, none of which the connector can see: one process (the workers are called in
turn, each with its own TP rank's tensors), no preemption, a prefix cache that never evicts,
and a "model" whose forward writes a deterministic KV value per (salt, token, position, layer,
K/V, head, element) into the blocks, so decode can check every byte it loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import select
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "vllm_standin"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.parallel_state import _standin_set_tp  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402


def kv_values(salt: int, token: int, pos: int, layer: int, kv: int, heads: np.ndarray,
              dim: int) -> np.ndarray:
    """The KV the test model computes for one token: [heads, dim], small integers (exact in
    fp16). `heads` are global head indices, so a rank of any TP size knows its slice."""
    d = np.arange(dim)
    v = salt * 101 + token * 7 + pos * 13 + layer * 31 + kv * 17 + heads[:, None] * 5 + d * 3
    return (v % 251).astype(np.float16)


class Worker:
    """One TP rank: its connector (role WORKER) and its KV cache tensors."""

    def __init__(self, engine: "Engine", rank: int) -> None:
        c = engine.cfg
        _standin_set_tp(rank, c["tp"])
        self.rank = rank
        self.layout = c["layout"]
        self.layers = c["layers"]
        self.block_size = c["block_size"]
        if self.layout == "mla":
            self.heads = np.zeros(1, dtype=np.int64)
        else:
            local = max(1, c["heads"] // c["tp"])
            first = rank * c["heads"] // c["tp"] if c["heads"] >= c["tp"] else \
                rank // (c["tp"] // c["heads"])
            self.heads = np.arange(first, first + local)
        self.connector = KVConnectorFactory.create_connector(
            engine.vllm_config, KVConnectorRole.WORKER, engine.kv_cache_config)
        self.caches: Dict[str, torch.Tensor] = {}
        nb, bs, h, d = c["num_blocks"], self.block_size, len(self.heads), c["head_dim"]
        hnd = engine.required_layout == "HND"
        per_layer = (nb * bs * d if self.layout == "mla" else 2 * nb * bs * h * d)
        self.pool = None
        if c.get("pool_mode"):
            # Benchmark: the cache in one UCX-allocated pool, as pdlib-transfer-bench's default
            # --pool-alloc (UCX shm then copies into it directly; malloc'd memory needs a
            # syscall per read). vLLM's own cache is GPU memory.
            import pdlib
            mode = pdlib.Mode.Prefill if c["pool_mode"] == "prefill" else pdlib.Mode.Decode
            self.pool = pdlib.allocate_kv_pool("ucx", per_layer * self.layers * 2,
                                               pdlib.MemoryKind.Host,
                                               c["extra"]["backend_options"], mode)
            flat = torch.frombuffer(self.pool.view(), dtype=torch.float16)

        def zeros(shape: Tuple[int, ...], layer: int) -> torch.Tensor:
            if self.pool is None:
                return torch.zeros(shape, dtype=torch.float16)
            return flat[layer * per_layer:(layer + 1) * per_layer].view(shape)

        for layer in range(self.layers):
            name = f"model.layers.{layer}.self_attn.attn"
            # As the attention backends build them: the logical shape, physically permuted by
            # the stride order of the layout (HND swaps block_size and heads).
            if self.layout == "flash_attn":
                raw = zeros((2, nb, h, bs, d) if hnd else (2, nb, bs, h, d), layer)
                t = raw.permute(0, 1, 3, 2, 4) if hnd else raw
            elif self.layout == "flashinfer":
                raw = zeros((nb, 2, h, bs, d) if hnd else (nb, 2, bs, h, d), layer)
                t = raw.permute(0, 1, 3, 2, 4) if hnd else raw
            else:
                t = zeros((nb, bs, d), layer)
            self.caches[name] = t
        self.model = c.get("model", True)
        if not self.model:  # benchmark: no model, the blocks hold random bytes
            for t in self.caches.values():
                t.uniform_(-1, 1)
        self.connector.register_kv_caches(self.caches)

    def _slot(self, name: str, kv: int, block: int, offset: int) -> torch.Tensor:
        t = self.caches[name]
        if self.layout == "flash_attn":
            return t[kv, block, offset]
        if self.layout == "flashinfer":
            return t[block, kv, offset]
        return t[block, offset]

    def write(self, salt: int, tokens: List[int], blocks: List[int], start: int, n: int) -> None:
        if not self.model:
            return
        for name in self.caches:
            self.connector.wait_for_layer_load(name)
            layer = list(self.caches).index(name)
            for pos in range(start, start + n):
                block, offset = blocks[pos // self.block_size], pos % self.block_size
                for kv in ((0,) if self.layout == "mla" else (0, 1)):
                    vals = kv_values(salt, tokens[pos], pos, layer, kv, self.heads,
                                     self.caches[name].shape[-1])
                    self._slot(name, kv, block, offset).copy_(
                        torch.from_numpy(vals[0] if self.layout == "mla" else vals))
            self.connector.save_kv_layer(name, self.caches[name], None)

    def check(self, salt: int, tokens: List[int], blocks: List[int], start: int, end: int,
              skip_blocks: Set[int]) -> Tuple[int, int]:
        """(bytes checked, bytes wrong) of tokens [start, end) against salt's values."""
        checked = wrong = 0
        for layer, name in enumerate(self.caches):
            for pos in range(start, end):
                block, offset = blocks[pos // self.block_size], pos % self.block_size
                if block in skip_blocks:
                    continue
                for kv in ((0,) if self.layout == "mla" else (0, 1)):
                    want = kv_values(salt, tokens[pos], pos, layer, kv, self.heads,
                                     self.caches[name].shape[-1])
                    have = self._slot(name, kv, block, offset).numpy()
                    want = want[0] if self.layout == "mla" else want
                    checked += have.nbytes
                    wrong += int((have != want).sum()) * 2
        return checked, wrong


class Engine:
    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.cfg = cfg
        self.salt = cfg["salt"]
        self.enable_prefix_caching = cfg.get("enable_prefix_caching", True)
        self.block_size = cfg["block_size"]
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model="pdlib-test-model", total_num_kv_heads=cfg["heads"],
                                     head_size=cfg["head_dim"],
                                     use_mla=cfg["layout"] == "mla"),
            cache_config=CacheConfig(block_size=cfg["block_size"],
                                     num_gpu_blocks=cfg["num_blocks"]),
            parallel_config=ParallelConfig(tensor_parallel_size=cfg["tp"]),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdlibConnector", kv_connector_module_path="pdlib.vllm",
                kv_role=cfg.get("kv_role", "kv_both"),
                kv_connector_extra_config=cfg["extra"],
                kv_load_failure_policy="recompute"))
        names = [f"model.layers.{i}.self_attn.attn" for i in range(cfg["layers"])]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=cfg["num_blocks"],
            kv_cache_tensors=[KVCacheTensor(size=0, shared_by=[n]) for n in names],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=None)])
        # get_kv_connector_cache_layout(): the connector class's wish, before allocation.
        import importlib
        cls = getattr(importlib.import_module("pdlib.vllm"), "PdlibConnector")
        self.required_layout = cls.get_required_kvcache_layout(self.vllm_config) \
            if not cfg.get("nhd") else "NHD"
        self.workers = [Worker(self, r) for r in range(cfg["tp"])]
        self.connector = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        metadata = {w.rank: w.connector.get_handshake_metadata() for w in self.workers}
        if any(m is not None for m in metadata.values()):
            self.connector.set_xfer_handshake_metadata(metadata)
        # Scheduler state (block 0 is vLLM's null block, never handed out).
        self.free_blocks: List[int] = list(range(1, cfg["num_blocks"]))
        if cfg.get("scatter_blocks"):  # a pool after churn: a request's blocks far apart
            random.Random(self.salt).shuffle(self.free_blocks)
        self.cached: Dict[Tuple[int, ...], KVCacheBlock] = {}
        self.req_blocks: Dict[str, List[KVCacheBlock]] = {}
        self.requests: Dict[str, Request] = {}
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.finished_req_ids: Set[str] = set()
        self.finished_recving_kv_req_ids: Set[str] = set()
        self.failed_recving_kv_req_ids: Set[str] = set()
        self.hit_tokens: Dict[str, int] = {}
        self.report_counts: Dict[Tuple[str, str], int] = {}
        self.events: List[Dict[str, Any]] = []

    # -- the block pool (KVCacheManager) ----------------------------------------------------

    def _allocate(self, req: Request, num_tokens: int, hit: List[KVCacheBlock]) -> bool:
        blocks = self.req_blocks.setdefault(req.request_id, list(hit))
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            blocks.append(KVCacheBlock(self.free_blocks.pop(0)))
        return True

    def _lookup(self, req: Request) -> Tuple[List[KVCacheBlock], int]:
        if not self.enable_prefix_caching:
            return [], 0
        tokens = req._all_token_ids
        hit: List[KVCacheBlock] = []
        for i in range((req.num_tokens - 1) // self.block_size):
            block = self.cached.get(tuple(tokens[:(i + 1) * self.block_size]))
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def _cache_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        for i, block in enumerate(self.req_blocks[req.request_id][:num_tokens // self.block_size]):
            key = tuple(req._all_token_ids[:(i + 1) * self.block_size])
            if block.block_hash is None and key not in self.cached:
                block.block_hash = key
                self.cached[key] = block

    def _free(self, req: Request) -> None:
        for block in self.req_blocks.pop(req.request_id, []):
            if block.block_hash is None:
                self.free_blocks.append(block.block_id)

    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # -- Scheduler ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def schedule(self) -> Tuple[SchedulerOutput, Dict[str, Tuple[int, int]]]:
        scheduled: Dict[str, int] = {}
        for req in self.running:
            n = req.num_tokens - req.num_computed_tokens
            if self._allocate(req, req.num_computed_tokens + n, []):
                scheduled[req.request_id] = n
        skipped: List[Request] = []
        while self.waiting:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if self._update_waiting_for_remote_kv(req):
                    req.status = RequestStatus.WAITING
                else:
                    skipped.append(self.waiting.pop(0))
                    continue
            ext, load_async = 0, False
            if req.num_computed_tokens == 0:
                hit, local = self._lookup(req)
                ext, load_async = self.connector.get_num_new_matched_tokens(req, local)
                if ext is None:
                    skipped.append(self.waiting.pop(0))
                    continue
                req.num_external_computed_tokens = ext
                num_computed = local + ext
            else:
                hit, local, num_computed = [], 0, req.num_computed_tokens
            num_new = 0 if load_async else req.num_tokens - num_computed
            if not self._allocate(req, num_computed + num_new, hit):
                break
            self.hit_tokens[req.request_id] = local
            self.connector.update_state_after_alloc(
                req, KVCacheBlocks((self.req_blocks[req.request_id],)), ext)
            self.waiting.pop(0)
            if load_async:
                skipped.append(req)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                continue
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            scheduled[req.request_id] = num_new
        self.waiting = skipped + self.waiting
        out = SchedulerOutput(num_scheduled_tokens=scheduled,
                              total_num_scheduled_tokens=sum(scheduled.values()),
                              finished_req_ids=self.finished_req_ids)
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        ranges = {}
        for req_id, n in scheduled.items():  # _update_after_schedule
            req = self.requests[req_id]
            ranges[req_id] = (req.num_computed_tokens, n)
            req.num_computed_tokens += n
        self.finished_req_ids = set()
        return out, ranges

    def _update_waiting_for_remote_kv(self, req: Request) -> bool:
        if req.request_id not in self.finished_recving_kv_req_ids:
            return False
        if req.request_id in self.failed_recving_kv_req_ids:
            if req.num_computed_tokens:
                self._cache_blocks(req, req.num_computed_tokens)
            else:
                self._free(req)
            self.failed_recving_kv_req_ids.remove(req.request_id)
        else:
            n = min(len(self.req_blocks[req.request_id]) * self.block_size, req.num_tokens)
            if n == req.num_tokens:
                n -= 1
            self._cache_blocks(req, n)
            req.num_computed_tokens = n
        self.finished_recving_kv_req_ids.remove(req.request_id)
        return True

    def finish_requests(self, req_id: str, status: RequestStatus) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished():
            return
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        delay = False
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            delay = req_id not in self.finished_recving_kv_req_ids
            self.finished_recving_kv_req_ids.discard(req_id)
            self.failed_recving_kv_req_ids.discard(req_id)
        req.status = status
        self._free_request(req, delay)

    def _free_request(self, req: Request, delay_free_blocks: bool = False
                      ) -> Optional[Dict[str, Any]]:
        blocks = [b.block_id for b in self.req_blocks.get(req.request_id, [])]
        delay, params = self.connector.request_finished(req, blocks)
        self.finished_req_ids.add(req.request_id)
        if not (delay or delay_free_blocks):
            self._free_blocks(req)
        self.events.append({"event": "finished", "id": req.request_id,
                            "status": req.status.name, "kv_transfer_params": params,
                            "num_computed_tokens": req.num_computed_tokens,
                            "output_len": req.num_output_tokens})
        return params

    def _free_blocks(self, req: Request) -> None:
        self._free(req)
        del self.requests[req.request_id]

    def update_from_output(self, out: SchedulerOutput, kvo: KVConnectorOutput) -> None:
        if kvo.invalid_block_ids:
            self._handle_invalid_blocks(kvo.invalid_block_ids)
        for req_id in out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.is_finished() or req.num_computed_tokens < req.num_tokens:
                continue
            self._cache_blocks(req, req.num_computed_tokens)
            req.append_output_token_ids(1000 + req.num_output_tokens)
            if req.num_output_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.running.remove(req)
                self._free_request(req)
        self.connector.update_connector_output(kvo)
        for req_id in kvo.finished_recving or ():
            assert req_id in self.requests, req_id
            req = self.requests[req_id]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
                self.events.append(self._received(req, kvo.invalid_block_ids))
            else:
                assert RequestStatus.is_finished(req.status)
                self._free_blocks(req)
                self.events.append({"event": "freed", "id": req_id, "side": "decode"})
        for req_id in kvo.finished_sending or ():
            assert req_id in self.requests, req_id
            self._free_blocks(self.requests[req_id])
            self.events.append({"event": "freed", "id": req_id, "side": "prefill"})

    def _handle_invalid_blocks(self, invalid: Set[int]) -> None:
        # Recompute policy, async loads (the only kind this connector makes).
        for req in self.waiting:
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            blocks = [b.block_id for b in self.req_blocks[req.request_id]]
            computed = req.num_computed_tokens \
                if req.request_id in self.failed_recving_kv_req_ids \
                else len(blocks) * self.block_size
            n = -(-computed // self.block_size)
            for idx, block in enumerate(blocks[:n]):
                if block in invalid:
                    req.num_computed_tokens = idx * self.block_size
                    self.failed_recving_kv_req_ids.add(req.request_id)
                    break

    def _received(self, req: Request, invalid: Set[int]) -> Dict[str, Any]:
        """Checks what decode loaded, as soon as vLLM learns it arrived: tokens after the local
        prefix hit hold prefill's values (except blocks reported invalid), the hit's tokens
        still hold this engine's own."""
        blocks = [b.block_id for b in self.req_blocks[req.request_id]]
        hit = self.hit_tokens[req.request_id]
        tokens = req._all_token_ids
        checked = wrong = kept_checked = kept_wrong = 0
        for w in (self.workers if self.cfg.get("model", True) else []):
            c, bad = w.check(self.cfg["remote_salt"], tokens, blocks, hit, req.num_prompt_tokens,
                             set(invalid))
            checked, wrong = checked + c, wrong + bad
            c, bad = w.check(self.salt, tokens, blocks, 0, hit, set())
            kept_checked, kept_wrong = kept_checked + c, kept_wrong + bad
        return {"event": "received", "id": req.request_id, "t": time.monotonic(),
                "blocks": blocks, "hit_tokens": hit,
                "invalid": sorted(b for b in invalid if b in blocks), "bytes_checked": checked,
                "bytes_wrong": wrong, "prefix_bytes_checked": kept_checked,
                "prefix_bytes_wrong": kept_wrong}

    # -- Executor -----------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, ranges: Dict[str, Tuple[int, int]]
                ) -> KVConnectorOutput:
        per_worker = []
        for w in self.workers:
            c = w.connector
            # The executor sends each worker the SchedulerOutput pickled (multiproc executor).
            c.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
            c.start_load_kv(None)
            for req_id, (start, n) in ranges.items():
                req = self.requests[req_id]
                w.write(self.salt, req._all_token_ids,
                        [b.block_id for b in self.req_blocks[req_id]], start, n)
            c.wait_for_save()
            o = KVConnectorOutput()
            o.finished_sending, o.finished_recving = c.get_finished(out.finished_req_ids)
            o.invalid_block_ids = c.get_block_ids_with_load_errors()
            o.kv_connector_stats = c.get_kv_connector_stats()
            c.clear_connector_metadata()
            per_worker.append(o)
        # KVOutputAggregator: an id is finished once every worker reported it.
        merged = KVConnectorOutput(finished_sending=set(), finished_recving=set())
        for o in per_worker:
            merged.invalid_block_ids |= o.invalid_block_ids
            for kind, ids in (("send", o.finished_sending), ("recv", o.finished_recving)):
                for req_id in ids or ():
                    key = (kind, req_id)
                    self.report_counts[key] = self.report_counts.get(key, 0) + 1
                    if self.report_counts[key] == len(self.workers):
                        del self.report_counts[key]
                        target = merged.finished_sending if kind == "send" \
                            else merged.finished_recving
                        assert target is not None
                        target.add(req_id)
        return merged

    def step(self) -> bool:
        """One engine-core step; True when it did anything (scheduled or finished work)."""
        out, ranges = self.schedule()
        kvo = self.execute(out, ranges)
        self.update_from_output(out, kvo)
        return bool(ranges or kvo.finished_sending or kvo.finished_recving)

    def shutdown(self) -> None:
        self.connector.shutdown()
        for w in self.workers:
            w.connector.shutdown()


class Backoff:
    """The loop's idle wait, like pdlib-transfer-bench's drivers (bench_ranks.cc, Idler) but
    with fewer yields, since each pass here is a whole engine step (~100 us of Python), not one
    poll: a pass that changed nothing yields twice, then sleeps 20 us doubling up to 1 ms; a pass
    that did resets it. On a GPU vLLM steps back to back; here a busy loop would take the CPU
    that pdlib's progress threads copy with (2 cores)."""

    def __init__(self) -> None:
        self.delay, self.idle = 20e-6, 0
        try:  # prctl(PR_SET_TIMERSLACK, 1 us): short sleeps stay short
            import ctypes
            ctypes.CDLL(None).prctl(29, ctypes.c_ulong(1000), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def wait(self, progressed: bool) -> None:
        if progressed:
            self.delay, self.idle = 20e-6, 0
        elif self.idle < 2:
            self.idle += 1
            os.sched_yield()
        else:
            time.sleep(self.delay)
            self.delay = min(self.delay * 2, 1e-3)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        engine = Engine(cfg)
    except Exception as e:  # reported to the test, which asserts on it
        print(json.dumps({"event": "error", "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"event": "ready", "free_blocks": engine.num_free_blocks()}), flush=True)
    buf = b""
    idle = Backoff()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    engine.shutdown()
                    print(json.dumps({"event": "bye"}), flush=True)
                    return
                if cmd["op"] == "add":
                    extra = None if cmd.get("kv_transfer_params") is None else \
                        {"kv_transfer_params": cmd["kv_transfer_params"]}
                    engine.add_request(Request(
                        cmd["id"], cmd["prompt"],
                        SamplingParams(max_tokens=cmd["max_tokens"], extra_args=extra), None))
                elif cmd["op"] == "abort":
                    engine.finish_requests(cmd["id"], RequestStatus.FINISHED_ABORTED)
                elif cmd["op"] == "stats":
                    decode = sum(w.connector.pdlib_stats().get("decode", {}).get(
                        "bytes_transferred", 0) for w in engine.workers)
                    engine.events.append({"event": "stats",
                                          "free_blocks": engine.num_free_blocks(),
                                          "requests": sorted(engine.requests),
                                          "decode_bytes": decode})
        try:
            progressed = engine.step()
        except Exception:
            print(json.dumps({"event": "error", "error": traceback.format_exc()}), flush=True)
            return
        for event in engine.events:
            print(json.dumps(event), flush=True)
        progressed = progressed or bool(engine.events)
        engine.events.clear()
        idle.wait(bool(ready) or progressed)


if __name__ == "__main__":
    main()
