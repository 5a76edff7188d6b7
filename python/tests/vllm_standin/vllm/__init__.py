"""A stand-in of the parts of vLLM that pdlib.vllm and its tests touch, for the tests only (vLLM
cannot be installed here). Each class keeps upstream's name, module, constructor signature and
the attributes the connector or the replayed scheduler reads; nothing else. Upstream
vllm-project/vllm files, read at: distributed/kv_transfer/kv_connector/v1/base.py @003df2961dd8,
kv_connector/factory.py (create_connector: module path, then the 3-argument constructor),
config/kv_transfer.py @007c643b4abb, v1/request.py @000a0d5f815c, v1/outputs.py
(KVConnectorOutput), v1/core/kv_cache_manager.py @003df2961dd8 (KVCacheBlocks),
v1/core/sched/scheduler.py @00024d314514 (SchedulerOutput fields the connector sees)."""
