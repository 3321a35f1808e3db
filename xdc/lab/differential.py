"""The differential end-to-end rig (issue 26): seeded random sequences through the whole
system, every completion compared token by token with a plain engine's.

The system is ``xdc up``'s (router, gateway, a PrfaaS vLLM producer and a PD vLLM consumer,
xdc daemons across a shaped namespace link with random loss). The workload mixes lengths
around the router's threshold t (some prefill remotely, some locally), shared and partly
shared prefixes (both clusters' prefix caches and the router's cache transfers are hit),
exact repeats, streams, clients that leave before their answer, prompts the engines refuse,
concurrent waves, and a sender and a receiver SIGKILLed and restarted while a wave runs.

The comparison is only worth something if the reference is deterministic under the same
cache states. bf16 on vLLM's CPU build is not (a long prompt decodes differently after a
full prefill and after a prefix-cache hit, with or without xdc: rounding, not a misread like
MLA's rotary kernel, xdc.lab.vllm_rig.MLA_CUSTOM_OPS; a 2,600-token prompt's KV cold and
after a 1,024-token hit is the same bytes in layer 0 and differs by at most 0.031 on values
up to 4, median 7.8e-3 relative, by layer 3; 161 tokens after a 96-token hit, the same bytes
in every layer, 2026-12-01), so everything runs in float32 and a control shows, for these
very sequences, that a plain engine decodes each the same cold (no prefix caching), and
twice with prefix caching on (partly then fully cached): plain against plain, cold against
cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from xdc.gateway.up import MODELS
from xdc.lab.vllm_rig import close_engines, hybrid_model, sliding_model, start_engines

MAX_MODEL_LEN = 4096
DTYPE = "float32"


@dataclass(frozen=True)
class ModelRun:
    """How a differential run drives one of ``xdc up``'s test models: the engines' dtype,
    prompt lengths (``k * align + 1``) and prefill budget per step (the reference's too)."""

    model: str
    dtype: str
    align: int
    chunk: int
    bind: bool  # engines on one core and thread each, as xdc up runs this model's

    def checkpoint(self) -> Path | None:
        """The seeded checkpoint the reference loads (None: the dense default)."""
        made = {"sliding": sliding_model, "hybrid": hybrid_model}.get(self.model)
        return made() if made else None


def model_run(model: str) -> ModelRun:
    """float32 where the model runs in it (module docstring); the hybrid model in bf16 with
    its chunk rule (``xdc.gateway.up.HYBRID_CHUNK``)."""
    m = MODELS[model]
    dtype = DTYPE if DTYPE in m.dtypes else m.dtypes[0]
    return ModelRun(model, dtype, m.chunk or 1, m.chunk, m.bind)


async def sse_tokens(content: Any) -> tuple[list[int], bool, str]:
    """Read a completions stream (an aiohttp response's ``content``): the token ids of its
    events, whether it ended with ``[DONE]``, and the error event's text if one came."""
    tokens: list[int] = []
    async for raw in content:
        line = raw.strip()
        if line == b"data: [DONE]":
            return tokens, True, ""
        if line.startswith(b"data: "):
            ev = json.loads(line[6:])
            if "error" in ev:
                return tokens, False, str(ev)
            tokens += ev["choices"][0].get("token_ids") or []
    return tokens, False, ""


@dataclass(frozen=True)
class Case:
    name: str
    ids: tuple[int, ...]
    stream: bool = False
    leave: bool = False  # the client leaves before its answer ends: nothing to compare
    refused: bool = False  # longer than the engines take: a 4xx, never tokens
    leave_after_s: float = 0.0  # when it leaves: mostly while its KV is still on the way


@dataclass
class Wave:
    """Requests sent at once; ``restart`` names a daemon SIGKILLed and restarted meanwhile."""

    cases: list[Case]
    restart: str | None = None


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 2000) for _ in range(n)]


def make_workload(
    seed: int, waves: int, t: int, *, per_wave: int = 3, max_tokens: int = 16, align: int = 1
) -> list[Wave]:
    """``waves`` waves of ``per_wave`` requests (seeded): see the module docstring. ``t`` is
    the router's threshold in tokens; prompts stay within the engines' context. ``align``:
    every prompt the engines take is ``k * align + 1`` tokens long (the hybrid model's rule,
    ``xdc.gateway.up.HYBRID_CHUNK``); 1 draws the same workload as before it existed."""
    if not 1 <= align <= 128:  # a longer step could push a shared prompt past the context
        raise ValueError(f"align must be 1..128 tokens, not {align}")
    rng = random.Random(seed)
    top = MAX_MODEL_LEN - max_tokens - 8

    def fit(n: int) -> int:  # the longest aligned length <= n, at least align + 1
        return max(n - (n - 1) % align, align + 1)

    bases = [_ids(rng, top) for _ in range(3)]
    sent: list[tuple[int, ...]] = []
    out: list[Wave] = []
    kinds = ["long", "short", "near", "shared", "shared", "repeat", "leave", "refused"]
    for w in range(waves):
        cases: list[Case] = []
        for i in range(per_wave):
            kind = rng.choice(kinds) if sent else "shared"
            name = f"w{w}-{i}-{kind}"
            if kind == "long":
                ids = tuple(_ids(rng, fit(rng.randrange(t + 200, top))))
            elif kind == "short":
                ids = tuple(_ids(rng, fit(rng.randrange(64, max(65, t - 300)))))
            elif kind == "near":
                ids = tuple(_ids(rng, fit(rng.randrange(max(64, t - 150), t + 150))))
            elif kind == "shared":
                base = rng.choice(bases)
                k = rng.randrange(512, top - 256)
                n = fit(k + rng.randrange(16, top - k))
                n = n if n - k >= 16 else n + align * -(-(16 - n + k) // align)
                ids = tuple(base[:k] + _ids(rng, n - k))
            elif kind == "repeat":
                ids = rng.choice(sent)
            elif kind == "leave":
                ids = tuple(_ids(rng, fit(rng.randrange(t + 200, top))))
            else:  # refused
                ids = tuple(_ids(rng, MAX_MODEL_LEN + rng.randrange(1, 400)))
            stream = kind == "leave" or rng.random() < 0.4
            leave_after = round(rng.uniform(0.05, 1.2), 2) if kind == "leave" else 0.0
            case = Case(name, ids, stream, kind == "leave", kind == "refused", leave_after)
            cases.append(case)
            if not case.leave and not case.refused:
                sent.append(ids)
        restart = None
        if w == waves // 3:
            restart = "receiver"
        elif w == (2 * waves) // 3:
            restart = "sender"
        out.append(Wave(cases, restart))
    return out


def compared(waves: list[Wave]) -> list[tuple[int, ...]]:
    """The distinct sequences whose completions are compared, in first-sent order."""
    seen: dict[tuple[int, ...], None] = {}
    for w in waves:
        for c in w.cases:
            if not c.leave and not c.refused:
                seen.setdefault(c.ids, None)
    return list(seen)


# --- the reference and its control ---------------------------------------------------------


@dataclass
class Reference:
    want: dict[tuple[int, ...], list[int]]
    # per sequence: (cold, first pass with prefix caching, second pass) where they differ
    unstable: list[tuple[int, list[int], list[int], list[int]]]
    seconds: float


def reference(
    seqs: list[tuple[int, ...]],
    max_tokens: int,
    model: Path | None = None,
    *,
    dtype: str = DTYPE,
    chunk: int = 0,
    bind: bool = False,
) -> Reference:
    """Decode every sequence on a plain engine cold (prefix caching off), and on another
    twice with prefix caching on, in the order the system gets them (``model``: the seeded
    checkpoint the system serves, by default the dense one; ``dtype`` and ``chunk``, the
    prefill budget per step, and ``bind``, as the system's engines run it)."""
    t0 = time.monotonic()
    # side by side, one per core: they share nothing, and each decodes in order
    kw = {"dtype": dtype, "model": model, "max_num_batched_tokens": chunk, "bind": bind}
    cached, cold_engine = start_engines(
        ("plain", {"core": 0, "prefix_caching": True, **kw}),
        ("plain", {"core": 1, **kw}),
    )
    try:
        first, cold = [], []
        for s in seqs:
            cached.submit([list(s)], None, max_tokens)
            cold_engine.submit([list(s)], None, max_tokens)
            first.append(cached.result()[0]["token_ids"])
            cold.append(cold_engine.result()[0]["token_ids"])
        second = [cached.generate([list(s)], None, max_tokens)[0]["token_ids"] for s in seqs]
    finally:
        close_engines([cached, cold_engine])
    unstable = [
        (len(s), c, a, b)
        for s, c, a, b in zip(seqs, cold, first, second, strict=True)
        if not c == a == b
    ]
    return Reference(dict(zip(seqs, cold, strict=True)), unstable, time.monotonic() - t0)


# --- driving the system --------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    status: int
    tokens: list[int]
    route: dict[str, str]
    seconds: float
    error: str = ""


def _route(raw: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in raw.split("; ") if "=" in p)


async def _one(
    s: aiohttp.ClientSession, case: Case, token: str, max_tokens: int, timeout: float
) -> Outcome:
    body = {
        "model": "xdc-test",
        "prompt": list(case.ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "stream": case.stream,
    }
    t0 = time.monotonic()
    if case.leave:  # the client hangs up after leave_after_s, answered or not
        status = 0
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout(case.leave_after_s):
                async with s.post(
                    "http://gateway/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {token}"},
                ) as r:
                    status = r.status
                    await r.read()
        return Outcome(case, status, [], {}, time.monotonic() - t0)
    try:
        async with s.post(
            "http://gateway/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            route = _route(r.headers.get("x-xdc-route", ""))
            if r.status != 200:
                return Outcome(case, r.status, [], route, time.monotonic() - t0, await r.text())
            if not case.stream:
                data = await r.json()
                toks = list(data["choices"][0]["token_ids"])
                return Outcome(case, 200, toks, route, time.monotonic() - t0)
            tokens, done, error = await sse_tokens(r.content)
            err = error or ("" if done else "stream ended without [DONE]")
            return Outcome(case, 200 if done else 599, tokens, route, time.monotonic() - t0, err)
    except (aiohttp.ClientError, TimeoutError) as e:
        return Outcome(case, 0, [], {}, time.monotonic() - t0, f"{type(e).__name__}: {e}")


async def drive(
    system: Any, waves: list[Wave], token: str, max_tokens: int, timeout: float = 120
) -> list[Outcome]:
    """Send the waves through the gateway's unix socket; restarts happen 0.3 s into their
    wave, while its requests are in flight."""
    out: list[Outcome] = []
    conn = aiohttp.UnixConnector(path=system.gateway_unix)
    async with aiohttp.ClientSession(connector=conn) as s:
        for w in waves:
            jobs = [_one(s, c, token, max_tokens, timeout) for c in w.cases]
            if w.restart:

                async def restart(name: str = w.restart) -> None:
                    await asyncio.sleep(0.3)
                    await asyncio.to_thread(system.restart, name)

                results = await asyncio.gather(*jobs, restart())
                out += [r for r in results if isinstance(r, Outcome)]
            else:
                out += await asyncio.gather(*jobs)
    return out


@dataclass
class Tally:
    sequences: int = 0
    completions: int = 0  # compared token by token
    mismatches: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # wrong status, error, no answer
    paths: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        return (
            f"{self.sequences} sequences, {self.completions} completions compared, "
            f"{len(self.mismatches)} mismatches, {len(self.failures)} failures; "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.paths.items()))
        )


def judge(outcomes: list[Outcome], ref: Reference) -> Tally:
    t = Tally(sequences=len(ref.want))
    for o in outcomes:
        c = o.case
        if c.leave:
            t.paths["left"] += 1
            continue
        if c.refused:
            t.paths["refused"] += 1
            if not 400 <= o.status < 500 or o.tokens:
                t.failures.append(f"{c.name}: {len(c.ids)} tokens answered {o.status}")
            continue
        if o.status != 200:
            t.failures.append(f"{c.name}: status {o.status} {o.error[:300]}")
            continue
        t.completions += 1
        t.paths[o.route.get("path", "?")] += 1
        if o.route.get("cache_transfer"):
            t.paths["cache_transfer"] += 1
        want = ref.want[c.ids]
        if o.tokens != want:
            t.mismatches.append(
                f"{c.name} ({len(c.ids)} tokens, {o.route}): got {o.tokens}, want {want}"
            )
    return t
