"""Client requests as the OpenAI API defines them, checked and normalised (pure), and the
error bodies it answers with.

Both endpoints become one ``Job``: token ids for the engines (a text prompt or chat messages
are tokenised by an engine first, so prefill and decode see the very same ids), sampling
fields passed through by name, and how to shape the answer (completion or chat). Unknown
fields are refused, as OpenAI does, rather than silently dropped: a client that thinks it set
something must learn that it did not.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xdc.errors import RemoteRequestError

# Sampling fields handed to the engine unchanged (after a type check).
_NUMBERS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 2.0),
}
_INTS = {"top_k": (-1, 1 << 20), "seed": (-(1 << 63), (1 << 63) - 1)}
_BOOLS = ("ignore_eos", "return_token_ids", "skip_special_tokens")
_IGNORED = ("user", "stream_options", "n", "echo", "logprobs", "suffix", "best_of")
_COMMON = {"model", "max_tokens", "stream", "stop", "stop_token_ids", *_NUMBERS, *_INTS, *_BOOLS}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", *_IGNORED})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", *_IGNORED})
MAX_PROMPT_TOKENS = 1 << 20
MAX_STOP = 4


class BadRequest(RemoteRequestError, ValueError):
    """A client error: 4xx with an OpenAI-shaped body naming the parameter."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.error_code = message, param, status, code


def error_body(
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(slots=True)
class Job:
    """One client request, normalised."""

    chat: bool
    model: str
    stream: bool
    max_tokens: int
    sampling: dict[str, Any]
    prompt_ids: list[int] | None = None  # given as token ids
    prompt_text: str | None = None  # to tokenise
    messages: list[dict[str, Any]] | None = None  # to tokenise with the chat template
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def engine_body(
        self,
        ids: list[int],
        *,
        max_tokens: int | None = None,
        kv: Mapping[str, Any] | None = None,
        stream: bool | None = None,
    ) -> dict[str, Any]:
        """The /v1/completions body an engine gets: always token ids."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
            **self.sampling,
        }
        s = self.stream if stream is None else stream
        body["stream"] = s
        if s:
            body["stream_options"] = {"include_usage": True}
        if kv is not None:
            body["kv_transfer_params"] = dict(kv)
        return body


def _num(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise BadRequest(f"{name}: expected a number", name)
    if not lo <= v <= hi:
        raise BadRequest(f"{name}: {v} is outside [{lo}, {hi}]", name)
    return float(v)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name}: expected an integer", name)
    if not lo <= v <= hi:
        raise BadRequest(f"{name}: {v} is outside [{lo}, {hi}]", name)
    return v


def _token_ids(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise BadRequest(f"{name}: expected a non-empty list of token ids", name)
    if len(v) > MAX_PROMPT_TOKENS:
        raise BadRequest(f"{name}: more than {MAX_PROMPT_TOKENS} tokens", name)
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 31:
            raise BadRequest(f"{name}: token ids are integers in [0, 2^31)", name)
    return v


def parse(
    body: Any, *, chat: bool, model: str, default_max_tokens: int, max_tokens_limit: int
) -> Job:
    """Check a decoded JSON body; BadRequest names the first wrong parameter."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0]
        extra = " (the gateway sets it)" if name == "kv_transfer_params" else ""
        raise BadRequest(f"Unrecognized request argument supplied: {name}{extra}", name)
    if body.get("model") != model:
        raise BadRequest(
            f"The model {str(body.get('model'))[:100]!r} does not exist (this gateway serves "
            f"{model!r})",
            "model",
            404,
            "model_not_found",
        )
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        raise BadRequest("n: only 1 is supported", "n")
    for name in ("echo", "logprobs", "suffix"):
        if body.get(name) not in (None, False):
            raise BadRequest(f"{name}: not supported by this gateway", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise BadRequest('stream_options: only {"include_usage": bool}', "stream_options")
    include_usage = bool(opts and opts.get("include_usage") is True)
    mt_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    mt = _int(body, mt_name, 1, max_tokens_limit)
    sampling: dict[str, Any] = {}
    for name, (lo, hi) in _NUMBERS.items():
        if (f := _num(body, name, lo, hi)) is not None:
            sampling[name] = f
    for name, (ilo, ihi) in _INTS.items():
        if (i := _int(body, name, ilo, ihi)) is not None:
            sampling[name] = i
    for name in _BOOLS:
        v = body.get(name)
        if v is not None:
            if not isinstance(v, bool):
                raise BadRequest(f"{name}: expected a boolean", name)
            sampling[name] = v
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stops)
        ):
            raise BadRequest(f"stop: a string or up to {MAX_STOP} strings", "stop")
        sampling["stop"] = stops
    if body.get("stop_token_ids") is not None:
        sampling["stop_token_ids"] = _token_ids(body["stop_token_ids"], "stop_token_ids")[:64]
    job = Job(chat, model, stream, mt or default_max_tokens, sampling, include_usage=include_usage)
    if chat:
        job.messages = _messages(body.get("messages"))
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt: must not be empty", "prompt")
            job.prompt_text = p
        elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            if len(p) != 1:
                raise BadRequest("prompt: one prompt per request (send several requests)", "prompt")
            job.prompt_ids = _token_ids(p[0], "prompt")
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise BadRequest("prompt: one prompt per request (send several requests)", "prompt")
            job.prompt_text = p[0]
        else:
            job.prompt_ids = _token_ids(p, "prompt")
    return job


def _messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise BadRequest("messages: expected a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "user",
            "assistant",
            "developer",
            "tool",
        ):
            raise BadRequest(
                f"messages[{i}]: expected {{role, content}} with a known role", "messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                for c in content
            ):
                raise BadRequest(
                    f"messages[{i}].content: only text parts are supported", "messages"
                )
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: expected a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


# --- answers --------------------------------------------------------------------------------


def _envelope(job: Job, obj: str, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
    """Our id and the client's model name on every answer (not the engine's)."""
    out: dict[str, Any] = {
        "id": f"{'chatcmpl' if job.chat else 'cmpl'}-{job.id}",
        "object": obj,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out


def _choice(
    job: Job, c: Mapping[str, Any], *, chat_key: str, first: bool = False
) -> dict[str, Any]:
    """One engine choice -> a completion choice (``text``) or a chat one (``message`` or
    ``delta``, as ``chat_key`` says)."""
    text = c.get("text") or ""
    ch: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": c.get("finish_reason")}
    if not job.chat:
        ch["text"] = text
    elif chat_key == "message":
        ch["message"] = {"role": "assistant", "content": text}
    else:
        ch["delta"] = {"content": text, **({"role": "assistant"} if first else {})}
    if c.get("token_ids") is not None:
        ch["token_ids"] = c["token_ids"]
    return ch


class BadEngineAnswer(RemoteRequestError, ValueError):
    """An engine answer without the shape of an OpenAI completion. The gateway reports it as
    an engine failure and passes none of it on: a client must never get a wrongly typed field
    (or a half-relayed object) that looks like an answer."""


def _engine_parts(engine: Any) -> tuple[Mapping[str, Any] | None, Any]:
    """(first choice or None, usage or None) of an engine completion or stream chunk, checked
    for the fields the gateway relays; BadEngineAnswer names the first that is wrong."""
    if not isinstance(engine, Mapping):
        raise BadEngineAnswer(f"answer is not an object: {str(engine)[:100]}")
    usage = engine.get("usage")
    if usage is not None and not isinstance(usage, Mapping):
        raise BadEngineAnswer("usage is not an object")
    choices = engine.get("choices")
    if choices is None or choices == []:
        return None, usage
    if not isinstance(choices, list) or not isinstance(choices[0], Mapping):
        raise BadEngineAnswer("choices is not a list of objects")
    c = choices[0]
    if not isinstance(c.get("text", ""), (str, type(None))):
        raise BadEngineAnswer("choices[0].text is not a string")
    if not isinstance(c.get("finish_reason"), (str, type(None))):
        raise BadEngineAnswer("choices[0].finish_reason is not a string")
    ids = c.get("token_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)
    ):
        raise BadEngineAnswer("choices[0].token_ids is not a list of token ids")
    return c, usage


def completion_answer(job: Job, engine: Any) -> dict[str, Any]:
    """The engine's non-streamed completion, re-addressed to the client's request and, for
    chat, reshaped into a chat completion. BadEngineAnswer if its shape is wrong."""
    c, usage = _engine_parts(engine)
    obj = "chat.completion" if job.chat else "text_completion"
    return _envelope(job, obj, [_choice(job, c or {}, chat_key="message")], usage)


def stream_chunk(job: Job, engine: Any, *, first: bool) -> dict[str, Any] | None:
    """One engine SSE chunk -> the client's chunk (None: nothing to send, e.g. a usage-only
    chunk the client did not ask for). BadEngineAnswer if its shape is wrong."""
    obj = "chat.completion.chunk" if job.chat else "text_completion"
    c, usage = _engine_parts(engine)
    if c is None:
        if usage is None or not job.include_usage:
            return None
        return _envelope(job, obj, [], usage)
    return _envelope(job, obj, [_choice(job, c, chat_key="delta", first=first)], None)
