"""vLLM (0.32) KV connector that ships KV cache through the xdc daemons.

Load it in vLLM with ``kv_connector="XdcConnector"`` and
``kv_connector_module_path="xdc.integrations.vllm.connector"``; see README "Two vLLM servers
with xdc between them". ``params``, ``blocks`` and ``prompt_binding`` are pure (no vLLM
import) and tested alone.
"""
