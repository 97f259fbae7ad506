"""vLLM's ``NixlConnector`` with NIXL's progress thread switched off.

NIXL's progress thread polls UCX without pausing: a whole core per engine, idle or not
(measured: 1.0 CPU per agent at rest). On a CPU box the prefill and decode engines' threads
alone ate both cores and slowed every stage. vLLM's worker already progresses its transfers
and notifications on every engine step, which is all the connector needs.

vLLM loads this module inside each EngineCore process via ``kv_connector_module_path``;
importing it makes the connector's agents start without the thread. The connector class is
vLLM's own, under its own name, so vLLM's checks on the connector name still hold.
"""

from __future__ import annotations

import functools

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, base_worker

__all__ = ["NixlConnector"]

if base_worker.nixl_agent_config is not None and not isinstance(
    base_worker.nixl_agent_config, functools.partial
):
    base_worker.nixl_agent_config = functools.partial(
        base_worker.nixl_agent_config, enable_prog_thread=False
    )
