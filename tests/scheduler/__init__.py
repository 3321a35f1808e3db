"""The router and the throughput model: policy, planner, profiles, replay, cache index, the HTTP
API, vLLM event and metrics intake."""
