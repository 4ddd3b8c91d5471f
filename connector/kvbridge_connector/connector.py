"""The class vLLM loads: ``kv_connector: KvbridgeConnector``,
``kv_connector_module_path: kvbridge_connector.connector``.

A ``NixlPullConnector`` whose scheduler and worker halves are kvbridge's
subclasses; every other method is vLLM's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector

from kvbridge_connector.compat import check_vllm_version, installed_vllm_version
from kvbridge_connector.scheduler import KvbridgeConnectorScheduler
from kvbridge_connector.settings import ConnectorSettings
from kvbridge_connector.worker import KvbridgeConnectorWorker

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KvbridgeConnector(NixlPullConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        kv_transfer = vllm_config.kv_transfer_config
        extra = (kv_transfer.kv_connector_extra_config if kv_transfer else None) or {}
        # Refuse an unchecked vLLM now, at engine start, rather than fail mid-serving (compat.py).
        check_vllm_version(installed_vllm_version(), extra)
        # Skip NixlPullConnector.__init__: it would build the stock halves (and a NIXL agent).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(extra)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvbridgeConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config, self.settings
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvbridgeConnectorWorker(vllm_config, self.engine_id, kv_cache_config, self.settings)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM >= 0.33 asks at config time): sleep discards the KV cache, so retained entries
        the registry offers would point at lost blocks. vLLM then refuses --enable-sleep-mode."""
        return False

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM hands the scheduler's block pool over: used for the free-KV watermark."""
        super().bind_gpu_block_pool(gpu_block_pool)
        if isinstance(self.connector_scheduler, KvbridgeConnectorScheduler):
            self.connector_scheduler.bind_block_pool(gpu_block_pool)
