"""The vLLM connector with real vLLM CPU engines, and its KV block copier."""
