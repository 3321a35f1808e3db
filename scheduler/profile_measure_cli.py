"""`xdc profile measure`: drive the engines a router will route to through their OpenAI
endpoint (the path the gateway uses) and write the profile the router, ``xdc plan`` and
``xdc replay`` load, instead of a hand-declared one.

Per engine (``--pd`` and ``--prfaas``, the same URL twice when one engine stands for both): a
sweep of prompt lengths (time to first token of prompts no cache holds, median of repeats)
and of decode batch sizes (the gap between tokens while that many streams decode together).
The link's capacity and RTT come from the sender's monitor (``--sender``, its status URL).
The cluster's counts are the ``--base`` profile's unless ``--n-prfaas`` / ``--n-pd`` /
``--homogeneous-instances`` say what the measured system is; the workload is the base's.
Bounded by ``--budget-s``; an engine that is down or answers wrongly is one clear line, exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from xdc.monitor.monitor_cli import fetch_link, status_url
from xdc.scheduler.measured import (
    DecodeSample,
    EngineMeasurement,
    KvSample,
    LinkMeasurement,
    PrefillSample,
    instance_table,
    kv_curve,
    measured_profile,
    render_toml,
    with_cluster,
)
from xdc.scheduler.profile import Profile, ProfileError, read_profile_data
from xdc.transport.engine_client import DecodeClient

from xdc.errors import RemoteRequestError, XdcError

MAX_ANSWER = 1 << 20
# text whose tokens make the prompts: any engine's tokenizer turns it into valid ids, and
# prompts are drawn from those ids at random so that no two share a cached prefix
SEED_TEXT = " ".join(
    f"{w}{i}" for i in range(64) for w in ("alpha", "river", "stone", "cloud", "seven", "lamp")
)


class MeasureError(RemoteRequestError):
    """An engine or the sender could not be measured: down, too slow, or answering wrongly."""


@dataclass(frozen=True)
class Sweep:
    lengths: tuple[int, ...]
    repeats: int
    batches: tuple[int, ...]
    decode_tokens: int
    decode_prompt: int
    timeout_s: float
    seed: int
    token_ids: tuple[int, int] | None  # the prompts' id range; None: from the tokenizer


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: comma-separated whole numbers") from None
    if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
        raise argparse.ArgumentTypeError(f"{what}: increasing whole numbers >= 1, got {text!r}")
    return vals


def _id_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not (sep and lo.strip().isdigit() and hi.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"--token-ids: LO-HI, got {text!r}")
    a, b = int(lo), int(hi)
    if not 0 <= a < b or b - a < 15:
        raise argparse.ArgumentTypeError(f"--token-ids: 0 <= LO and 16+ ids, got {text!r}")
    return a, b


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd", required=True, metavar="URL", help="a PD engine's OpenAI URL")
    parser.add_argument(
        "--prfaas", required=True, metavar="URL", help="a PrfaaS engine's OpenAI URL"
    )
    parser.add_argument(
        "--base",
        required=True,
        type=Path,
        metavar="PROFILE",
        help="profile whose cluster sizes and workload the measured one keeps",
    )
    parser.add_argument("--out", required=True, type=Path, metavar="FILE", help="profile to write")
    parser.add_argument("--model", default="", help="model name (default: the engine's first)")
    parser.add_argument(
        "--lengths",
        default="256,1024,2048",
        type=lambda s: _ints(s, "--lengths"),
        help="uncached prompt lengths to time (tokens; default 256,1024,2048)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="requests per length (median)")
    parser.add_argument(
        "--batches",
        default="1,4",
        type=lambda s: _ints(s, "--batches"),
        help="decode batch sizes (the largest is bs_max; default 1,4)",
    )
    parser.add_argument("--decode-tokens", type=int, default=24, help="tokens per decode stream")
    parser.add_argument("--decode-prompt", type=int, default=64, help="prompt of a decode stream")
    parser.add_argument(
        "--kv-bytes-per-token",
        type=float,
        default=0.0,
        help="KV bytes per token the model moves (default: the base profile's pd curve)",
    )
    parser.add_argument(
        "--sender", default="", metavar="URL", help="sender status URL: the link's capacity"
    )
    parser.add_argument(
        "--receiver-socket",
        default="",
        metavar="PATH",
        help="the decode-side receiver's engine socket: PrfaaS prompts then go through the xdc "
        "connector (do_remote_decode), each transfer is claimed there and its bytes are the "
        "profile's KV sizes",
    )
    parser.add_argument(
        "--egress-gbps",
        type=float,
        default=0.0,
        help="the link's capacity when there is no sender to ask (e.g. a configured shaper)",
    )
    shape = parser.add_argument_group(
        "the measured system's shape (default: the base profile's [cluster])"
    )
    shape.add_argument(
        "--n-prfaas", type=int, metavar="N", help="PrfaaS prefill instances behind the link"
    )
    shape.add_argument(
        "--n-pd",
        type=int,
        metavar="N",
        help="PD instances the planner splits into prefill and decode (at least 2)",
    )
    shape.add_argument(
        "--homogeneous-instances",
        type=int,
        metavar="N",
        help="instances of the all-PD baseline (usually the engines there are, at least 2)",
    )
    parser.add_argument("--budget-s", type=float, default=600.0, help="give up after (seconds)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per request (seconds)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt randomness (default: a new one each run: a seed repeated against a warm "
        "engine meets its prefix cache)",
    )
    parser.add_argument(
        "--token-ids",
        type=_id_range,
        default=None,
        metavar="LO-HI",
        help="draw prompt tokens from these ids (default: ids the engine's tokenizer gives)",
    )


class Prober:
    """One engine's OpenAI endpoint, asked the way the gateway asks it."""

    def __init__(self, session: aiohttp.ClientSession, url: str, sweep: Sweep) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.sweep = sweep
        self.model = ""
        self.pool: list[int] = []

    def _fail(self, what: str) -> MeasureError:
        return MeasureError(f"engine {self.url}: {what}")

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        t = aiohttp.ClientTimeout(total=self.sweep.timeout_s, sock_connect=5)
        try:
            async with self.session.request(method, self.url + path, json=body, timeout=t) as r:
                raw = await r.content.read(MAX_ANSWER + 1)
                status = r.status
        except TimeoutError:
            raise self._fail(f"{path}: no answer within {self.sweep.timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise self._fail(f"unreachable ({type(e).__name__}: {e})"[:300]) from None
        if status != 200:
            raise self._fail(f"{path}: HTTP {status}: {raw[:200]!r}")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise self._fail(f"{path}: answer is not JSON: {raw[:200]!r}") from None

    async def open(self, model: str, token_ids: tuple[int, int] | None) -> None:
        """Find the model and a pool of valid token ids for the prompts (``token_ids``, or
        what the engine's tokenizer makes of a seed text)."""
        data = await self._json("GET", "/v1/models")
        listed = data.get("data") if isinstance(data, dict) else None
        names = [
            m["id"] for m in listed or [] if isinstance(m, dict) and isinstance(m.get("id"), str)
        ]
        if not names:
            raise self._fail(f"/v1/models lists no model: {str(data)[:200]}")
        if model and model not in names:
            raise self._fail(f"serves {names}, not {model!r}")
        self.model = model or names[0]
        if token_ids is not None:
            self.pool = list(range(token_ids[0], token_ids[1] + 1))
            return
        try:
            tok = await self._json("POST", "/tokenize", {"model": self.model, "prompt": SEED_TEXT})
        except MeasureError as e:
            raise MeasureError(
                f"{e} (cannot tokenize; an engine without a tokenizer, "
                "--skip-tokenizer-init, needs --token-ids LO-HI)"
            ) from None
        ids = tok.get("tokens") if isinstance(tok, dict) else None
        if not isinstance(ids, list) or len(set(ids)) < 16:
            raise self._fail(f"/tokenize gave no usable token ids: {str(tok)[:200]}")
        self.pool = sorted({int(i) for i in ids if isinstance(i, int) and i > 0})

    async def stream(
        self, ids: list[int], max_tokens: int, kv: dict[str, Any] | None = None
    ) -> list[float]:
        """Send one streamed completion (``kv``: its kv_transfer_params); the arrival time of
        each token (monotonic)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "detokenize": False,  # vLLM: token ids are enough, and a tokenizer may be absent
            "return_token_ids": True,  # how many tokens each streamed event carries
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if kv is not None:
            body["kv_transfer_params"] = kv
        t = aiohttp.ClientTimeout(total=self.sweep.timeout_s, sock_connect=5)
        arrivals: list[float] = []
        usage: dict[str, Any] = {}
        try:
            async with self.session.post(
                self.url + "/v1/completions", json=body, timeout=t
            ) as resp:
                if resp.status != 200:
                    raw = await resp.content.read(4096)
                    raise self._fail(f"completion: HTTP {resp.status}: {raw[:200]!r}")
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    try:
                        ev = json.loads(payload)
                    except (ValueError, RecursionError):
                        raise self._fail(f"bad stream event {payload[:100]!r}") from None
                    if not isinstance(ev, dict):
                        raise self._fail(f"bad stream event {payload[:100]!r}")
                    if isinstance(ev.get("usage"), dict):
                        usage = ev["usage"]
                    choices = ev.get("choices")
                    if choices and isinstance(choices, list) and isinstance(choices[0], dict):
                        # an event may carry several tokens (a busy server coalesces them):
                        # each gets its share of the time since the previous event
                        now = time.monotonic()
                        got = choices[0].get("token_ids")
                        k = len(got) if isinstance(got, list) and got else 1
                        prev = arrivals[-1] if arrivals else now
                        arrivals += [prev + (now - prev) * j / k for j in range(1, k + 1)]
        except TimeoutError:
            raise self._fail(f"completion: no end within {self.sweep.timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise self._fail(f"completion failed ({type(e).__name__}: {e})"[:300]) from None
        if usage.get("prompt_tokens") != len(ids):
            raise self._fail(f"read {usage.get('prompt_tokens')} prompt tokens of {len(ids)} sent")
        if len(arrivals) < max_tokens:
            raise self._fail(f"streamed {len(arrivals)} tokens of {max_tokens} asked")
        return arrivals

    def prompt(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.pool, k=n)

    async def ttft(self, rng: random.Random, n: int, kv: dict[str, Any] | None = None) -> float:
        t0 = time.monotonic()
        arrivals = await self.stream(self.prompt(rng, n), 1, kv)
        return arrivals[0] - t0

    async def step(self, rng: random.Random, batch: int) -> float:
        """The median gap between tokens while ``batch`` streams decode together (the first
        two gaps of each stream are left out: the batch is still filling)."""
        sw = self.sweep
        prompts = [self.prompt(rng, sw.decode_prompt) for _ in range(batch)]
        runs = await asyncio.gather(*(self.stream(ids, sw.decode_tokens) for ids in prompts))
        gaps = [b - a for r in runs for a, b in itertools.pairwise(r[2:])]
        if not gaps:
            raise self._fail(f"--decode-tokens {sw.decode_tokens} leaves no gap to time")
        return statistics.median(gaps)


async def measure_engine(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    sweep: Sweep,
    say: Callable[[str], None],
    label: str,
    kv_socket: str = "",
) -> EngineMeasurement:
    p = Prober(session, url, sweep)
    await p.open(model, sweep.token_ids)
    rng = random.Random(f"{sweep.seed}:{label}")

    async def prefill(n: int) -> tuple[float, int | None]:
        """One prompt of ``n`` tokens: its time to first token, and with ``kv_socket`` the
        KV bytes its transfer moved (prefilled through the connector, as an offloaded
        prompt is)."""
        if not kv_socket:
            return await p.ttft(rng, n), None
        rid = f"xdc-measure-{uuid.uuid4().hex[:12]}"
        ttft = await p.ttft(rng, n, {"do_remote_decode": True, "xdc_rid": rid})
        return ttft, await asyncio.to_thread(claim_bytes, kv_socket, rid, sweep.timeout_s)

    # warm-up, the way the samples go: first-request costs (the connector's sockets and pool
    # mappings, the engine's own) are not prefill
    await prefill(min(sweep.lengths))
    pre: list[PrefillSample] = []
    moved: list[KvSample] = []
    total = len(sweep.lengths) * sweep.repeats
    for n in sweep.lengths:
        for _ in range(sweep.repeats):
            ttft, got = await prefill(n)
            pre.append(PrefillSample(n, ttft))
            extra = ""
            if got is not None:
                moved.append(KvSample(n, got))
                extra = f", {got / n:.0f} KV bytes/token moved"
            say(f"{label} prefill {len(pre)}/{total}: {n} tokens {ttft * 1e3:.1f} ms{extra}")
    dec: list[DecodeSample] = []
    for b in sweep.batches:
        dec.append(DecodeSample(b, await p.step(rng, b)))
        say(f"{label} decode batch {b}: {dec[-1].step_s * 1e3:.1f} ms/token")
    return EngineMeasurement(p.url, p.model, tuple(pre), tuple(dec), tuple(moved))


def claim_bytes(socket_path: str, rid: str, timeout_s: float) -> int:
    """Claim request ``rid`` on the receiver's engine socket (as a decode engine would), and
    release it: the bytes its KV took on the way, every layer's buffer."""
    try:
        with DecodeClient(socket_path) as rx:
            req = rx.await_request(rid, timeout=timeout_s)
            try:
                return int(req.total_bytes)
            finally:
                req.release()
    except (XdcError, OSError) as e:
        raise MeasureError(f"receiver {socket_path}: transfer {rid} not delivered: {e}") from None


def _kv_per_token(declared: Profile, given: float) -> float:
    if given > 0:
        return given
    pd = declared.pd
    return float(pd.kv_bytes[-1]) / float(pd.lengths[-1])


def read_link(url: str) -> LinkMeasurement:
    try:
        link = fetch_link(status_url(url), 5.0)
    except (OSError, ValueError) as e:
        raise MeasureError(f"sender {url}: {e}"[:300]) from None
    cap = link.get("capacity_bps") if link else None
    if not isinstance(cap, int | float) or not cap > 0:
        raise MeasureError(f"sender {url}: no link capacity yet (status link: {link})"[:300])
    rtt = link.get("rtt_ms") if link else None
    return LinkMeasurement(
        float(cap),
        float(rtt) if isinstance(rtt, int | float) else None,
        str(link.get("capacity_source", "")) if link else "",
    )


async def _measure(
    args: argparse.Namespace, sweep: Sweep, say: Callable[[str], None]
) -> tuple[EngineMeasurement, EngineMeasurement]:
    async with aiohttp.ClientSession() as session, asyncio.timeout(args.budget_s):
        pd = await measure_engine(session, args.pd, args.model, sweep, say, "pd")
        if args.prfaas.rstrip("/") == args.pd.rstrip("/") and not args.receiver_socket:
            return pd, pd
        prfaas = await measure_engine(
            session, args.prfaas, args.model, sweep, say, "prfaas", args.receiver_socket
        )
        return pd, prfaas


def run(args: argparse.Namespace) -> int:
    sweep = Sweep(
        args.lengths,
        args.repeats,
        args.batches,
        args.decode_tokens,
        args.decode_prompt,
        args.timeout_s,
        args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32),
        args.token_ids,
    )
    problems = [
        m
        for ok, m in (
            (1 <= args.repeats <= 100, "--repeats: 1..100"),
            (len(args.lengths) >= 2, "--lengths: at least two lengths make a profile"),
            (4 <= args.decode_tokens <= 4096, "--decode-tokens: 4..4096"),
            (1 <= args.decode_prompt <= 1 << 20, "--decode-prompt: 1..1048576"),
            (1 <= args.budget_s <= 86400, "--budget-s: 1..86400"),
            (0.1 <= args.timeout_s <= 3600, "--timeout-s: 0.1..3600"),
            (args.kv_bytes_per_token >= 0, "--kv-bytes-per-token: >= 0"),
            (0 <= args.egress_gbps <= 1e5, "--egress-gbps: 0..100000"),
            (not (args.sender and args.egress_gbps), "--sender or --egress-gbps, not both"),
        )
        if not ok
    ]
    if problems:
        raise ProfileError(problems)
    counts = {
        k: v
        for k, v in (
            ("n_prfaas", args.n_prfaas),
            ("n_pd", args.n_pd),
            ("homogeneous_instances", args.homogeneous_instances),
        )
        if v is not None
    }
    base, declared = with_cluster(read_profile_data(args.base), args.base.parent, counts)
    kv = _kv_per_token(declared, args.kv_bytes_per_token)
    link = read_link(args.sender) if args.sender else None
    if args.egress_gbps:
        link = LinkMeasurement(args.egress_gbps * 1e9, None, "--egress-gbps")
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    try:
        pd, prfaas = asyncio.run(_measure(args, sweep, say))
    except TimeoutError:
        print(f"xdc profile measure: not done within --budget-s {args.budget_s:g}", file=sys.stderr)
        return 1
    except MeasureError as e:
        print(f"xdc profile measure: {e}", file=sys.stderr)
        return 1
    gpus = {s: int(base.get(s, {}).get("gpus", 1)) for s in ("prfaas", "pd")}
    # the same model on both: what PrfaaS prompts moved is what a PD prompt's KV takes
    moved = kv_curve(prfaas.kv) if prfaas.kv else None
    try:
        tables = {
            "prfaas": instance_table(prfaas, f"measured {prfaas.model}", gpus["prfaas"], kv, moved),
            "pd": instance_table(pd, f"measured {pd.model}", gpus["pd"], kv, moved),
        }
    except ValueError as e:
        print(f"xdc profile measure: {e}", file=sys.stderr)
        return 1
    profile = measured_profile(base, args.base.parent, tables["prfaas"], tables["pd"], link)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"Measured by `xdc profile measure` on {when} (base profile: {args.base}).",
        f"pd: {pd.url} ({pd.model}); prfaas: {prfaas.url} ({prfaas.model}).",
        f"Prefill: time to first token, median of {sweep.repeats} at each length; decode: "
        f"median gap between tokens at batch {', '.join(map(str, sweep.batches))}; "
        f"prompt seed {sweep.seed}.",
        (
            f"KV bytes: as moved through xdc by {len(prfaas.kv)} PrfaaS prompts "
            f"(claimed at {args.receiver_socket}); PrfaaS prefill through the connector."
            if moved
            else f"KV bytes per token: {kv:g} "
            f"({'given' if args.kv_bytes_per_token else 'base profile'})."
        ),
        (
            f"Link: {link.capacity_bps / 1e9:.3f} Gbit/s ({link.source}), RTT {link.rtt_ms} ms, "
            f"from {args.sender or 'the flag'}."
            if link
            else "Link: the base profile's egress (no --sender)."
        ),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(render_toml(profile, header))
    tmp.replace(args.out)  # a reader never sees half a profile
    print(
        json.dumps(
            {
                "out": str(args.out),
                "pd_prefill_s": tables["pd"]["prefill_s"],
                "prfaas_prefill_s": tables["prfaas"]["prefill_s"],
                "lengths": tables["pd"]["lengths"],
                "pd_t_decode_s": tables["pd"]["t_decode_s"],
                "bs_max": tables["pd"]["bs_max"],
                "kv_bytes": tables["pd"]["kv_bytes"],
                "egress_gbps": profile["cluster"].get("egress_gbps"),
            }
        )
    )
    return 0
