"""The router's OpenAPI 3.1 document, and the request schemas the server validates with.

The request schemas below are used twice: published at ``/openapi.json`` and enforced by
``scheduler/service/validation.py`` on every write, so documentation and behaviour cannot drift.
"""

from __future__ import annotations

from typing import Any, Final

from xdc import __version__
from xdc.linkreport import CLUSTER_NAME
from xdc.linkreport import SCHEMA as LINK_REPORT

__all__ = [
    "CACHE_EVENT",
    "CACHE_EVENTS",
    "DECISION",
    "FAILURES",
    "LINK_REPORT",
    "NODE_REPORT",
    "NODE_REPORTS",
    "ROUTE_REQUEST",
    "document",
]

MAX_PROMPT_TOKENS: Final = 1 << 24
MAX_BLOCK_HASHES: Final = 65_536
MAX_TOKEN_IDS: Final = 1 << 22
MAX_EVENTS: Final = 1024
MAX_SCHEMES: Final = 8
MAX_NODE_REPORTS: Final = 1024
MAX_NAME: Final = 128

_HASH = {"type": "integer", "minimum": 0, "maximum": (1 << 64) - 1}
_TOKEN = {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}
_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME}
_CLUSTER = {
    "type": "string",
    "pattern": CLUSTER_NAME.pattern,
    "maxLength": 64,
    "description": "a cluster of the router's profile: pd, or a PrfaaS cluster's name",
}
_NONNEG = {"type": "number", "minimum": 0}
_NOT_BOTH = {
    "not": {"required": ["block_hashes", "token_ids"]},
    "x-not-message": "give block_hashes or token_ids, not both",
}

ROUTE_REQUEST: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "One request to place. Prefix information is either the chained block hashes "
        "(as in Mooncake traces; block size = router.block_size) or the raw token ids, which "
        "the router hashes (xxh3-64 chained, seed 0). Neither = no prefix information."
    ),
    "additionalProperties": False,
    "required": ["rid", "prompt_len"],
    "properties": {
        "rid": {**_NAME, "description": "request id, echoed back"},
        "prompt_len": {"type": "integer", "minimum": 1, "maximum": MAX_PROMPT_TOKENS},
        "block_hashes": {"type": "array", "maxItems": MAX_BLOCK_HASHES, "items": _HASH},
        "token_ids": {"type": "array", "maxItems": MAX_TOKEN_IDS, "items": _TOKEN},
        "scheme_keys": {
            "type": "array",
            "maxItems": MAX_SCHEMES,
            "description": (
                "block keys per key scheme of GET /v1/schemes, computed by the gateway: what "
                "a long prompt sends instead of its token ids (a leading part of them is "
                "enough; prompt_len says the rest)"
            ),
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["scheme", "hashes"],
                "properties": {
                    "scheme": _NAME,
                    "hashes": {"type": "array", "maxItems": MAX_BLOCK_HASHES, "items": _HASH},
                },
            },
        },
        "ttft_slo_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 86400,
            "description": "per-request TTFT SLO; default router.ttft_slo_s",
        },
        "dry_run": {
            "type": "boolean",
            "description": "decide but do not count the request against node queues",
        },
    },
    **_NOT_BOTH,
}

CACHE_EVENT: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "A node stored or evicted blocks. seq increases per (cluster, node) with every event; "
        "it lets the router ignore duplicates and stale reordered events. token_ids means the "
        "full blocks of that token prefix (from block 0)."
    ),
    "additionalProperties": False,
    "required": ["kind", "cluster", "node", "seq"],
    "properties": {
        "kind": {"type": "string", "enum": ["stored", "evicted"]},
        "cluster": _CLUSTER,
        "node": _NAME,
        "seq": {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1},
        "block_hashes": {"type": "array", "maxItems": MAX_BLOCK_HASHES, "items": _HASH},
        "token_ids": {"type": "array", "maxItems": MAX_TOKEN_IDS, "items": _TOKEN},
    },
    **_NOT_BOTH,
}

CACHE_EVENTS: Final[dict[str, Any]] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["events"],
    "properties": {
        "events": {"type": "array", "maxItems": MAX_EVENTS, "items": CACHE_EVENT},
    },
}

NODE_REPORT: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "A node announces its role and load. queue_s replaces the router's own estimate of "
        "the node's prefill backlog; decode_load (fraction of decode capacity in use) its "
        "decode estimate."
    ),
    "additionalProperties": False,
    "required": ["name", "cluster", "role"],
    "properties": {
        "name": _NAME,
        "cluster": _CLUSTER,
        "role": {"type": "string", "enum": ["prefill", "decode"]},
        "queue_s": {"type": "number", "minimum": 0, "maximum": 86400},
        "queue_depth": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "decode_load": {"type": "number", "minimum": 0, "maximum": 100},
        "decode_waiting": {
            "type": "integer",
            "minimum": 0,
            "maximum": 1_000_000,
            "description": (
                "decode requests the node holds that hold no KV yet (their KV is on its way): "
                "with decode_load, replaces the router's bookings; each counts as one booking"
            ),
        },
        "healthy": {"type": "boolean"},
        "instance": {
            **_NAME,
            "description": (
                "the engine instance this node is a role of: a PD-P node whose instance also "
                "decodes (a PD-D node of the same instance) decodes its own requests there"
            ),
        },
    },
}

MAX_FAILURES: Final = 256

FAILURE: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "A remote plan whose KV did not reach its decode node (the gateway saw it: the "
        "prefill answered xdc_failed, or the decode answered xdc_recomputed). A reason that "
        "names the culprit (sender_down, receiver_gone, peer_unreachable...) takes that link "
        "or decode node out of offloading for router.outage_hold_s; an ambiguous one "
        "(never_arrived, timeout...) when it repeats."
    ),
    "additionalProperties": False,
    "required": ["cluster", "decode_node", "reason", "stage"],
    "properties": {
        "rid": _NAME,
        "cluster": {**_CLUSTER, "description": "the PrfaaS cluster that prefilled"},
        "decode_node": {"type": "string", "minLength": 1, "maxLength": 64},
        "reason": {"type": "string", "pattern": "^[a-z_]{1,32}$"},
        "stage": {"type": "string", "enum": ["prefill", "decode"]},
    },
}

PREFILL: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "A remote prefill that handed its KV over, as the gateway timed it (the PrfaaS "
        "engine's queue and prefill). Folded into the PrfaaS profile-drift estimate only "
        "where the router scrapes no PrfaaS engine's /metrics."
    ),
    "additionalProperties": False,
    "required": ["cluster", "seconds", "uncached_tokens"],
    "properties": {
        "rid": _NAME,
        "cluster": {**_CLUSTER, "description": "the PrfaaS cluster that prefilled"},
        "seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 86_400},
        "uncached_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_PROMPT_TOKENS},
    },
}

FAILURES: Final[dict[str, Any]] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["failures"],
    "properties": {
        "failures": {"type": "array", "maxItems": MAX_FAILURES, "items": FAILURE},
        "prefills": {"type": "array", "maxItems": MAX_FAILURES, "items": PREFILL},
    },
}

NODE_REPORTS: Final[dict[str, Any]] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["nodes"],
    "properties": {"nodes": {"type": "array", "maxItems": MAX_NODE_REPORTS, "items": NODE_REPORT}},
}

_NUM_OR_NULL = {"type": ["number", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}

_CACHE_TRANSFER = {
    "type": "object",
    "properties": {
        "source_cluster": {"type": "string"},
        "source_node": _STR_OR_NULL,
        "dest_cluster": {"type": "string"},
        "first_block": {"type": "integer"},
        "blocks": {"type": "integer"},
        "bytes": {"type": "integer"},
        "seconds": _NUM_OR_NULL,
    },
}

DECISION: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "predicted_ttft_s = transfer_s + queue_s + prefill_s (Mooncake Algorithm 1); "
        "reasons explain the rule applied; null numbers mean 'no node could take it'."
    ),
    "required": ["rid", "target", "rejected", "reasons", "predicted_ttft_s"],
    "properties": {
        "rid": {"type": "string"},
        "target": {"type": "string", "description": "cluster that prefills: pd or a PrfaaS one"},
        "link": {
            **_STR_OR_NULL,
            "description": "the link the KV crosses (PrfaaS cluster->pd); null for PD-P",
        },
        "prefill_node": _STR_OR_NULL,
        "decode_node": _STR_OR_NULL,
        "uncached_tokens": {"type": "integer"},
        "cached_tokens": {"type": "integer"},
        "cache_transfer": {"oneOf": [{"type": "null"}, _CACHE_TRANSFER]},
        "predicted_ttft_s": _NUM_OR_NULL,
        "effective_t": _NUM_OR_NULL,
        "reasons": {"type": "array", "items": {"type": "string"}},
        "rejected": {"type": "boolean"},
        "mode": {"type": "string", "enum": ["scarce", "abundant"]},
        "queue_s": _NUM_OR_NULL,
        "prefill_s": _NUM_OR_NULL,
        "transfer_s": _NUM_OR_NULL,
        "kv_bytes": {"type": "integer"},
    },
}

ERROR: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {"type": "string"},
        "problems": {"type": "array", "items": {"type": "string"}},
        "id": {"type": "string", "description": "correlates with the server log (500 only)"},
    },
}

_OBJ = {"type": "object"}


def _json(schema_ref: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}},
    }


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "malformed body: bad JSON, wrong types, unknown or missing fields",
        401: "missing or wrong bearer token",
        413: "body larger than router.max_body_bytes",
        415: "Content-Type is not application/json",
    }
    return {str(c): _json("Error", text[c]) for c in codes}


def _write(
    op_id: str, summary: str, req: str, ok: str, security: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "security": [{security: []}],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{req}"}}
                },
            },
            "responses": {
                "200": _json(ok, "accepted"),
                **(extra or {}),
                **_errors(400, 401, 413, 415),
            },
        }
    }


def _read(op_id: str, summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "responses": {
                "200": {
                    "description": "ok",
                    "content": {
                        content_type: {
                            "schema": _OBJ if "json" in content_type else {"type": "string"}
                        }
                    },
                }
            },
        }
    }


def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (a fresh dict each call)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "xdc router",
            "version": __version__,
            "description": (
                "Routes LLM requests between a PrfaaS prefill cluster and a local PD cluster "
                "(PrfaaS section 3.4.3): prefix-cache aware, bandwidth aware, with early "
                "rejection (429) when no placement meets the TTFT SLO."
            ),
        },
        "components": {
            "securitySchemes": {
                "gatewayToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "router.gateway_token; required by /v1/route",
                },
                "daemonToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "router.daemon_token; required by cache events, links, nodes",
                },
            },
            "schemas": {
                "RouteRequest": ROUTE_REQUEST,
                "Decision": DECISION,
                "CacheEvents": CACHE_EVENTS,
                "CacheEvent": CACHE_EVENT,
                "LinkReport": LINK_REPORT,
                "NodeReports": NODE_REPORTS,
                "Failures": FAILURES,
                "Error": ERROR,
                "Ack": {"type": "object"},
            },
        },
        "paths": {
            "/v1/route": _write(
                "route",
                "Decide where one request prefills and decodes",
                "RouteRequest",
                "Decision",
                "gatewayToken",
                {"429": _json("Decision", "rejected: no placement meets the TTFT SLO")},
            ),
            "/v1/cache/events": _write(
                "cacheEvents", "Report stored/evicted blocks", "CacheEvents", "Ack", "daemonToken"
            ),
            "/v1/links": _write(
                "linkReport",
                "Report one sender's share of a PrfaaS egress link",
                "LinkReport",
                "Ack",
                "daemonToken",
                {"429": _json("Error", "too many live reporters on this link")},
            ),
            "/v1/nodes": _write(
                "nodes", "Report node roles and load", "NodeReports", "Ack", "daemonToken"
            ),
            "/v1/outcomes": _write(
                "outcomes",
                "Report remote plans whose KV did not come, and remote prefill times (the gateway)",
                "Failures",
                "Ack",
                "gatewayToken",
            ),
            "/v1/plan": _read("plan", "Current plan and latest long-term recommendation"),
            "/v1/state": _read("state", "Link, threshold, cache index and node state"),
            "/v1/schemes": _read(
                "schemes",
                "The block key schemes prompts are matched in, for a gateway that sends "
                "scheme_keys instead of token ids",
            ),
            "/metrics": _read("metrics", "Prometheus metrics", "text/plain"),
            "/healthz": _read(
                "healthz",
                "Liveness; with replicas also the shared state's health (replication ok, "
                "degraded while Redis is unreachable: routing goes on with the last state)",
            ),
            "/openapi.json": _read("openapi", "This document"),
        },
    }
