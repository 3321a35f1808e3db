"""xdc: move LLM KV cache between datacenters (Prefill-as-a-Service)."""

__version__ = "0.1.0"
