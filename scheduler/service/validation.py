"""Strict JSON body checking against the same schemas the OpenAPI document publishes.

One source of truth: ``scheduler/service/openapi.py`` holds the request schemas, this module checks
bodies against them, so the document cannot drift from what the server accepts. Only the
JSON Schema subset those schemas use is implemented (type, properties, required,
additionalProperties: false, enum, min/max, lengths, pattern, items, not). Every problem is reported
at once, each with a path, so a client fixes a request in one round.

JSON's number model is also tightened: ``true`` is not an integer, ``1.0`` is not an integer,
NaN/Infinity (which Python's json accepts) are not numbers, and nesting is depth-limited
before parsing so a "[[[[..." body cannot exhaust the stack.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import orjson

from xdc.errors import RemoteRequestError

MAX_DEPTH: Final = 32
MAX_PROBLEMS: Final = 20

Schema = Mapping[str, Any]


class BodyError(RemoteRequestError, ValueError):
    """The body is not acceptable; ``problems`` says why, one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems[:MAX_PROBLEMS]
        super().__init__("; ".join(self.problems))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _depth_ok(text: str, limit: int) -> bool:
    """Bracket depth outside strings never exceeds ``limit``.

    Counting first makes the common small body free; otherwise string literals are cut out
    and only the brackets are walked (C-speed regex passes, then a short Python loop).
    """
    if text.count("[") + text.count("{") <= limit:
        return True
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Decode a request body; BodyError for anything that is not strict JSON.

    orjson first (about 3x the stdlib's speed, and as strict: UTF-8 checked, no NaN or
    Infinity) when the bracket count alone bounds the depth; anything it refuses goes through
    the stdlib path below, which names the problem (or accepts what only orjson cannot hold:
    integers beyond 64 bits, which the schema then rejects by range).
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return _parse_stdlib(raw, max_depth)


def _parse_stdlib(raw: bytes, max_depth: int) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError([f"body: not UTF-8 ({e.reason} at byte {e.start})"]) from None
    if not text.strip():
        raise BodyError(["body: empty; expected a JSON object"])
    if not _depth_ok(text, max_depth):
        raise BodyError([f"body: nested deeper than {max_depth} levels"])
    try:
        value = json.loads(text, parse_constant=_no_constants, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise BodyError(
            [f"body: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}"]
        ) from None
    except (ValueError, RecursionError) as e:
        raise BodyError([f"body: invalid JSON: {e}"]) from None
    where = _lone_surrogate(value, "body")
    if where:
        # "\ud800" is valid JSON syntax but no Unicode text: it cannot be encoded again
        # (every answer or log line that echoed it would fail), so it is refused here
        raise BodyError([f"{where}: a lone UTF-16 surrogate escape is not text"])
    return value


def _lone_surrogate(v: Any, path: str) -> str:
    """Path of the first string (key or value) holding an unpaired surrogate; "" if none."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _lone_surrogate(x, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(v, dict):
        for k, x in v.items():
            found = _lone_surrogate(k, f"{path} key") or _lone_surrogate(x, f"{path}.{k}")
            if found:
                return found
    return ""


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} does not fit a 64-bit float")
    return v


def _type_name(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number" if math.isfinite(v) else "a non-finite number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _is(v: object, typ: str) -> bool:
    if typ == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if typ == "number":
        return (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, float) and math.isfinite(v)
        )
    if typ == "string":
        return isinstance(v, str)
    if typ == "boolean":
        return isinstance(v, bool)
    if typ == "array":
        return isinstance(v, list)
    if typ == "object":
        return isinstance(v, dict)
    if typ == "null":
        return v is None
    raise AssertionError(f"schema uses unsupported type {typ!r}")


def check(value: object, schema: Schema, path: str = "body") -> list[str]:
    """Problems with ``value`` under ``schema`` (empty list = valid)."""
    out: list[str] = []
    _check(value, schema, path, out)
    return out


def _check(v: object, s: Schema, path: str, out: list[str]) -> None:
    if len(out) >= MAX_PROBLEMS:
        return
    typ = s.get("type")
    if typ is not None:
        types = [typ] if isinstance(typ, str) else list(typ)
        if not any(_is(v, t) for t in types):
            out.append(f"{path}: expected {' or '.join(types)}, got {_type_name(v)}")
            return
    if "enum" in s and v not in s["enum"]:
        allowed = ", ".join(json.dumps(x) for x in s["enum"])
        shown = json.dumps(v[:40]) if isinstance(v, str) else _type_name(v)
        out.append(f"{path}: {shown} is not one of {allowed}")
        return
    if isinstance(v, str):
        if len(v) < s.get("minLength", 0):
            out.append(f"{path}: shorter than {s['minLength']} characters")
        if "maxLength" in s and len(v) > s["maxLength"]:
            out.append(f"{path}: longer than {s['maxLength']} characters")
        elif "pattern" in s and not _pattern(s["pattern"]).search(v):
            out.append(f"{path}: {json.dumps(v[:40])} does not match {s['pattern']}")
    elif isinstance(v, int | float) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"]:
            out.append(f"{path}: must be >= {s['minimum']}")
        if "exclusiveMinimum" in s and v <= s["exclusiveMinimum"]:
            out.append(f"{path}: must be > {s['exclusiveMinimum']}")
        if "maximum" in s and v > s["maximum"]:
            out.append(f"{path}: must be <= {s['maximum']}")
    elif isinstance(v, list):
        _check_array(v, s, path, out)
    elif isinstance(v, dict):
        _check_object(v, s, path, out)
    if "not" in s and not check(v, s["not"], path):
        out.append(f"{path}: {s.get('x-not-message', 'matches a forbidden form')}")


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _pattern(text: str) -> re.Pattern[str]:
    p = _PATTERNS.get(text)
    if p is None:
        p = _PATTERNS[text] = re.compile(text)
    return p


def _check_array(v: list[object], s: Schema, path: str, out: list[str]) -> None:
    if len(v) < s.get("minItems", 0):
        out.append(f"{path}: needs at least {s['minItems']} items")
    if "maxItems" in s and len(v) > s["maxItems"]:
        out.append(f"{path}: more than {s['maxItems']} items")
        return
    items = s.get("items")
    if items is None:
        return
    # Fast path for the hot case, a long list of bounded integers (block hashes, token ids):
    # type and range checks as C-level passes; the per-item walk only runs to name a problem.
    if items.get("type") == "integer" and set(items) <= {"type", "minimum", "maximum"}:
        if not v:
            return
        lo, hi = items.get("minimum", -math.inf), items.get("maximum", math.inf)
        if set(map(type, v)) == {int}:
            ints = cast(list[int], v)
            if lo <= min(ints) and max(ints) <= hi:
                return
    for i, x in enumerate(v):
        _check(x, items, f"{path}[{i}]", out)
        if len(out) >= MAX_PROBLEMS:
            return


def _check_object(v: dict[str, object], s: Schema, path: str, out: list[str]) -> None:
    props: Mapping[str, Schema] = s.get("properties", {})
    if s.get("additionalProperties") is False:
        unknown = sorted(k for k in v if k not in props)
        if unknown:
            names = ", ".join(repr(k)[:60] for k in unknown[:10])
            out.append(f"{path}: unknown field(s) {names}; known: {', '.join(sorted(props))}")
    missing = [k for k in s.get("required", ()) if k not in v]
    if missing:
        out.append(f"{path}: missing required field(s): {', '.join(missing)}")
    for k, sub in props.items():
        if k in v:
            _check(v[k], sub, f"{path}.{k}", out)


Pred = Callable[[object], bool]
_KNOWN = frozenset(
    {
        "type",
        "enum",
        "minLength",
        "maxLength",
        "pattern",
        "minimum",
        "exclusiveMinimum",
        "maximum",
        "minItems",
        "maxItems",
        "items",
        "properties",
        "additionalProperties",
        "required",
        "not",
        "description",
        "x-not-message",
    }
)
_COMPILED: dict[int, tuple[Schema, Pred]] = {}


def accepts(value: object, schema: Schema) -> bool:
    """True iff ``check(value, schema)`` finds nothing, without building any message.

    The schema is compiled once into nested closures (no per-call dictionary walks of the
    schema), so the common case, a valid body, costs a fraction of ``check``; a body it
    refuses goes through ``check`` for the messages. Both read the same schema.
    """
    hit = _COMPILED.get(id(schema))
    if hit is None or hit[0] is not schema:
        hit = _COMPILED[id(schema)] = (schema, _compile(schema))
    return hit[1](value)


def _compile(s: Schema) -> Pred:
    if not set(s) <= _KNOWN:
        return lambda v: False  # unknown keyword: let check() judge (and name) it
    preds: list[Pred] = []
    typ = s.get("type")
    if typ is not None:
        types = [typ] if isinstance(typ, str) else list(typ)
        preds.append(lambda v: any(_is(v, t) for t in types))
    if "enum" in s:
        allowed = list(s["enum"])
        preds.append(lambda v: v in allowed)
    lo_len: float = s.get("minLength", 0)
    hi_len: float = s.get("maxLength", math.inf)
    pat = _pattern(s["pattern"]) if "pattern" in s else None
    lo: float = s.get("minimum", -math.inf)
    hi: float = s.get("maximum", math.inf)
    xlo: float = s.get("exclusiveMinimum", -math.inf)
    items = _compile(s["items"]) if "items" in s else None
    int_items = "items" in s and (
        s["items"].get("type") == "integer" and set(s["items"]) <= {"type", "minimum", "maximum"}
    )
    ilo = s["items"].get("minimum", -math.inf) if int_items else 0
    ihi = s["items"].get("maximum", math.inf) if int_items else 0
    lo_items: float = s.get("minItems", 0)
    hi_items: float = s.get("maxItems", math.inf)
    props = {k: _compile(v) for k, v in s.get("properties", {}).items()}
    closed = s.get("additionalProperties") is False
    required = tuple(s.get("required", ()))
    negated = _compile(s["not"]) if "not" in s else None

    def shape(v: object) -> bool:
        if isinstance(v, str):
            return lo_len <= len(v) <= hi_len and (pat is None or pat.search(v) is not None)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return lo <= v <= hi and v > xlo
        if isinstance(v, list):
            if not lo_items <= len(v) <= hi_items:
                return False
            if items is None or not v:
                return True
            if int_items and set(map(type, v)) == {int}:
                ints = cast(list[int], v)
                return ilo <= min(ints) and max(ints) <= ihi
            return all(map(items, v))
        if isinstance(v, dict):
            if closed and not v.keys() <= props.keys():
                return False
            if any(k not in v for k in required):
                return False
            return all(p(v[k]) for k, p in props.items() if k in v)
        return True

    def pred(v: object) -> bool:
        if not all(p(v) for p in preds):
            return False
        if not shape(v):
            return False
        return negated is None or not negated(v)

    return pred


def validate(raw: bytes, schema: Schema) -> dict[str, Any]:
    """Parse and check a body that must be a JSON object; BodyError lists the problems."""
    value = parse_json(raw)
    if accepts(value, schema):
        assert isinstance(value, dict)
        return value
    problems = check(value, schema)
    if problems:
        # orjson reads an integer beyond 64 bits as a float; the stdlib keeps it an integer,
        # so the problem is named by range ("must be <= ...") rather than by type
        problems = check(_parse_stdlib(raw, MAX_DEPTH), schema)
        if problems:
            raise BodyError(problems)
        raise BodyError(["body: numbers beyond 64-bit integers are not supported"])
    assert isinstance(value, dict)
    return value
