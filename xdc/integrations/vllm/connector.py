"""``XdcConnector``: vLLM's KV connector (v1 API, vLLM 0.32) over the xdc daemons.

Producer (prefill instance): a request whose ``kv_transfer_params`` say ``do_remote_decode``
becomes an xdc transfer; in every step, ``save_kv_layer`` copies the blocks that step made final
from vLLM's KV tensor into the sender's shared memory and hands them over (``layer_ready`` with
``upto``), so layer i is on the wire while layer i+1 computes, and a chunked prefill streams as
it computes. Consumer (decode instance): ``do_remote_prefill`` makes the request an
asynchronous load; each engine step asks the local receiver (without waiting) for the pending
transfers, copies the verified blocks of complete ones into the blocks vLLM allocated, and
reports those requests finished. A transfer
that fails (deadline, checksum, peer gone, layout mismatch, never arrived) is reported in
``failed_recving``: vLLM recomputes the prompt locally (the connector requires
``kv_load_failure_policy = "recompute"``), a counter and a log line say why. Bytes an engine
reads were verified by the receiver, chunk by chunk, and both sides declare the same layout
string (model, dtype, every KV cache group and its layers, every layer's block bytes) or the
receiver refuses the transfer before any byte moves.

Hybrid models (issue 27) move every KV cache group: full-attention and MLA blocks, the tail of
a sliding window, and the linear-attention / SSM state, which is copied in ``wait_for_save``
of the prompt's last step (vLLM makes no ``save_kv_layer`` call for those layers); with a state
the producer stops one token short and the decode computes it (blocks.py says why).

Each side copies once: vLLM tensor -> sender shared memory, receiver shared memory -> vLLM
tensor, through ``xdc.integrations.kvcopy`` (chosen once at ``register_kv_caches`` from the
tensors' device). What a block is comes from the tensor vLLM hands over and the layout it
resolved; a block moves as its elements in logical order. On a GPU the copies never make the
engine wait: saves land on a side stream and are handed over by a completion thread
(``saves.py``), loads are reported finished only once their device copies completed and
checked. Scheduler-side calls made every engine step (``build_connector_meta``,
``get_transfer_results``) only move small lists, since the engine spins through them while
requests wait.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from xdc.errors import ResultCode, TransferError, XdcError
from xdc.integrations.kvcopy import (
    BlockCopier,
    BlockShape,
    CudaCopier,
    block_shape,
    copier_for,
    pool_tensor,
)
from xdc.integrations.vllm.admission import Admit
from xdc.integrations.vllm.admit_gate import AdmissionGate
from xdc.integrations.vllm.blocks import (
    LAYOUT_TAG,
    NULL_BLOCK,
    GroupKind,
    GroupSpec,
    KvPlan,
    LoadSpec,
    SaveState,
    SaveStep,
    digest_layer_bytes,
    load_pieces,
)
from xdc.integrations.vllm.loads import FAULT, LOAD_FAILURES, Loader
from xdc.integrations.vllm.params import (
    ConnectorConfig,
    LoadParams,
    SendParams,
    failed_params,
    handover_params,
    merge_reasons,
    parallel_split,
    parse_request,
    shard_rid,
    tensor_parallel_size,
)
from xdc.integrations.vllm.parts import (
    Part,
    PartLoaders,
    split_parts,
    transfer_names,
    transfers_per_request,
)
from xdc.integrations.vllm.prompt_binding import request_digest
from xdc.integrations.vllm.saves import Handover, Outgoing, SavedCopy
from xdc.transport.engine_client import PrefillClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# under "vllm." so that vLLM's logging configuration shows it
log = logging.getLogger("vllm.xdc.connector")

SENDS = Counter(
    "xdc_vllm_kv_sends", "Prefill requests handed to the xdc sender, by outcome", ["outcome"]
)


def layout_string(
    vllm_config: VllmConfig,
    plan: KvPlan | None = None,
    block_bytes: Sequence[int] = (),
    rank: int = 0,
    shards: int | None = None,
) -> str:
    """What the bytes of a transfer are: both sides must produce the same string. Every KV
    cache group is in it (kind, block size, window, which layers) and every layer's block
    size in bytes; a readable head, then a hash of all of it (the wire takes 512 chars).
    Under tensor parallel the rank is in it too: two ranks' shares of the KV heads have the
    same shape, so a share at the wrong rank would otherwise load and decode wrong. A part
    held as ``shards`` distinct copies (``parts.py``; None: one per rank) names the copy
    (``rank``) of that many: one every rank holds (MLA's latent) reads as a one-rank
    engine's."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = mc.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [getattr(hf, "model_type", "?")])
    tp = tensor_parallel_size(vllm_config.parallel_config) if shards is None else shards
    head = [
        "vllm-kv-v2",
        arch[:60],
        f"h{getattr(hf, 'hidden_size', '?')}",
        f"L{mc.get_num_layers(vllm_config.parallel_config)}",
        str(mc.dtype).removeprefix("torch."),
        f"kvdtype={cc.cache_dtype}",
        f"v{getattr(hf, 'vocab_size', '?')}",
        f"tp{tp}" if tp == 1 else f"tp{tp}r{rank}",
    ]
    full = [
        *head,
        f"kv{mc.get_num_kv_heads(vllm_config.parallel_config)}x{mc.get_head_size()}",
        f"bs{cc.block_size}",
        plan.describe() if plan is not None else "",
        "B" + ",".join(str(b) for b in block_bytes),
        LAYOUT_TAG,  # a digest layer follows the KV layers (blocks.py)
    ]
    kinds = "+".join(g.describe() for g in plan.groups) if plan is not None else "?"
    digest = xxhash.xxh3_64_hexdigest("|".join(full).encode())
    return "|".join([*head, kinds[:120], f"#{digest}", LAYOUT_TAG])


def plan_groups(kv_cache_config: Any) -> tuple[list[GroupSpec], dict[str, int]] | str:
    """What moves of each of vLLM's KV cache groups, and each layer's group; a str names what
    the connector can not move (the engine then serves those requests locally)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return "no KV cache groups"
    out: list[GroupSpec] = []
    layers: dict[str, int] = {}
    for k, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = type(spec)
        if kind in (FullAttentionSpec, MLAAttentionSpec):
            out.append(GroupSpec(GroupKind.FULL, spec.block_size))
        elif kind in (SlidingWindowSpec, SlidingWindowMLASpec):
            if spec.extra_retained_tokens:
                return f"{kind.__name__} with extra_retained_tokens (speculative decoding)"
            out.append(GroupSpec(GroupKind.WINDOW, spec.block_size, spec.sliding_window))
        elif kind is MambaSpec:
            if spec.num_speculative_blocks:
                return "MambaSpec with speculative blocks (speculative decoding)"
            out.append(GroupSpec(GroupKind.STATE, spec.block_size))
        else:
            return f"KV cache group {k} is a {kind.__name__}"
        for name in g.layer_names:
            layers[name] = k
    return out, layers


def group_shards(kv_cache_config: Any, model_config: Any, ranks: int) -> list[int]:
    """How many distinct copies of each KV cache group the ``ranks`` tensor-parallel ranks
    hold (``parts.py``): MLA keeps one latent per token, not split by heads, so every rank
    holds all of it (1); attention with K KV heads, fewer than the ranks, is replicated
    (vLLM gives rank r head r * K // ranks: K copies); a linear-attention or SSM state and
    attention with enough heads are split by heads (``ranks``)."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if ranks == 1:
        return [1] * len(groups)
    try:
        heads = int(model_config.get_total_num_kv_heads())
    except Exception:  # a model config that does not say: as if split (each rank moves)
        heads = ranks
    attention = ranks if heads >= ranks else max(1, heads)
    out = []
    for g in groups:
        kind = type(g.kv_cache_spec)
        if kind in (MLAAttentionSpec, SlidingWindowMLASpec):
            out.append(1)
        elif kind is MambaSpec:
            out.append(ranks)
        else:
            out.append(attention)
    return out


@dataclass
class XdcMetadata(KVConnectorMetadata):  # type: ignore[misc]
    saves: list[SaveStep] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # xdc rids the producer gives up
    loads: list[LoadSpec] = field(default_factory=list)
    # vLLM request ids that finished (aborted, timed out, done) with a load maybe pending:
    # vLLM has let go of their blocks, so nothing may land there any more
    drops: list[str] = field(default_factory=list)


@dataclass
class XdcWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler: why loads failed (vLLM request id -> reason), so the decode
    request's answer can say it was recomputed (``xdc_recomputed`` in its
    ``kv_transfer_params``) and a gateway can count it."""

    recomputed: dict[str, str] = field(default_factory=dict)
    # producer: vLLM request id -> why its KV will not reach the decode (begin refused...)
    send_failed: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, XdcWorkerMetadata):
            merge_reasons(self.recomputed, other.recomputed)
            self.send_failed.update(other.send_failed)
        return self


def kv_groups(kv_cache_config: Any) -> list[str]:
    """The kinds of the KV cache groups vLLM made (FullAttentionSpec, MambaSpec,
    SlidingWindowSpec, ...); one group of full attention is a dense model."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [type(getattr(g, "kv_cache_spec", g)).__name__ for g in groups]


class XdcConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Subclassing SupportsHMA keeps vLLM's hybrid memory allocator on, so hybrid models
    (linear attention or SSM layers, sliding windows, beside full attention) run with their
    small KV: every KV cache group of a request moves (``blocks.py`` says what of each kind).
    A group kind the connector can not move (chunked local attention, sinks, speculative
    decoding's extra state blocks) is named at start-up and its requests are served locally,
    with a count (reason ``unsupported_kv``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        planned = plan_groups(kv_cache_config) if kv_cache_config is not None else None
        # why this engine's KV can not move (its requests are then served locally)
        self.unsupported: str | None = planned if isinstance(planned, str) else None
        self._groups: list[GroupSpec] = [GroupSpec(GroupKind.FULL, self.block_size)]
        self._layer_group: dict[str, int] = {}
        if isinstance(planned, tuple):
            self._groups, self._layer_group = planned
        if self.unsupported:
            log.warning(
                "xdc: KV cache groups %s: %s, which the connector does not move; requests "
                "are served locally",
                kv_groups(kv_cache_config),
                self.unsupported,
            )
        pc = vllm_config.parallel_config
        self.ranks = tensor_parallel_size(pc)
        self._rank = 0  # this worker's tensor-parallel rank (register_kv_caches)
        split = parallel_split(pc)
        if split and not self.unsupported:
            self.unsupported = split
            log.warning(
                "xdc: %s, which the connector does not move; requests are served locally", split
            )
        # Groups every rank holds whole (MLA's latent) or replicated (attention with fewer KV
        # heads than ranks) move once per distinct copy, by the first rank that holds it, and
        # every rank of a decode that holds it reads that one transfer (the receiver frees it
        # once all did); groups split by heads move one transfer per rank (parts.py).
        self._shards = [self.ranks] * len(self._groups)
        if kv_cache_config is not None and not self.unsupported:
            self._shards = group_shards(kv_cache_config, vllm_config.model_config, self.ranks)
        # transfers per request, as the prefill's answer says (xdc_ranks)
        self.transfers = transfers_per_request(self._shards, self.ranks)
        self._parts: list[Part] = []  # this rank's (register_kv_caches)
        if self.ranks > 1 and not self.unsupported:
            self._say_parts()
        # the scheduler needs the groups only (layers: register_kv_caches)
        self.plan = KvPlan(tuple(self._groups), ())
        ktc = vllm_config.kv_transfer_config
        self.producer = ktc.kv_role in ("kv_producer", "kv_both")
        self.consumer = ktc.kv_role in ("kv_consumer", "kv_both")
        self.cfg = ConnectorConfig.parse(
            ktc.kv_connector_extra_config, producer=self.producer, consumer=self.consumer
        )
        if self.consumer and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            raise ValueError(
                "XdcConnector: set kv_transfer_config.kv_load_failure_policy = 'recompute' so "
                "that a request whose KV transfer fails is prefilled locally instead of failing"
            )
        self.vllm_config = vllm_config
        # scheduler side
        self._saving: dict[str, SaveState] = {}
        self._loading: set[str] = set()  # vLLM ids of requests given a LoadSpec, until finished
        # vLLM ids of decode requests prefilled locally instead of loaded -> why (bounded: an
        # entry goes when its request finishes)
        self._recomputed: dict[str, str] = {}
        # producer: vLLM ids of requests whose KV will not reach their decode -> why, until
        # they finish (their answer says ``xdc_failed``, and the gateway recovers at once)
        self._send_failed: dict[str, str] = {}
        self._admitter: PrefillClient | None = None  # the scheduler's own sender connection
        # consumer: requests kept out of the schedule until their KV is complete, and what
        # is left of an admitted one's total wait (vLLM id -> seconds) for its load
        self._gate = (
            AdmissionGate(self.cfg.receiver_socket)
            if self.consumer and self.cfg.admit == "complete"
            else None
        )
        self._left: dict[str, float] = {}
        self._meta = XdcMetadata()
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._bb: list[int] = []  # bytes of one block, per layer
        self._layouts: list[str] = []  # per part
        self._part_bb: list[list[int]] = []  # per part: bytes of one block of each of its layers
        self._where: dict[int, tuple[int, int]] = {}  # layer -> (its part, its place there)
        self._shapes: list[BlockShape] = []  # what a block of each layer is
        self._copier: BlockCopier | None = None  # chosen once, from the tensors' device
        self._handover: Handover | None = None  # copies landing -> the sender (saves.py)
        self._tx: PrefillClient | None = None
        self._tx_pool: torch.Tensor | None = None  # the sender's pool, pinned while in use
        self._out: dict[str, Outgoing] = {}
        # rids this step began (or failed to): start_load_kv and save_kv_layer both see the
        # step's begin flag, in either order
        self._handled: set[str] = set()
        self._worker_send_failed: dict[str, str] = {}  # vLLM id -> why, for the scheduler
        self._loader: PartLoaders | None = None

    def _say_parts(self) -> None:
        if set(self._shards) == {1}:
            log.info(
                "xdc: tensor parallel size %d: every rank holds the same KV (%s); rank 0 moves "
                "it once and every rank of the decode reads that copy",
                self.ranks,
                ", ".join(kv_groups(self._kv_cache_config)),
            )
        elif min(self._shards, default=self.ranks) < self.ranks:
            kinds = kv_groups(self._kv_cache_config)
            log.info(
                "xdc: tensor parallel size %d: KV cache groups held as %s distinct copies "
                "(%s): each copy moves once, by the first rank that holds it, and is read by "
                "every decode rank that holds it; %d transfers per request",
                self.ranks,
                "/".join(str(n) for n in self._shards),
                ", ".join(kinds),
                sum(sorted(set(self._shards))),
            )

    # --- scheduler side -----------------------------------------------------------------------

    def _params(self, request: Request) -> SendParams | LoadParams | None:
        try:
            return parse_request(request.kv_transfer_params)
        except ValueError as e:
            log.error("xdc: request %s: %s; served without a transfer", request.request_id, e)
            LOAD_FAILURES.labels("bad_params").inc()
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.consumer:
            return 0, False
        p = self._params(request)
        if not isinstance(p, LoadParams):
            return 0, False
        if self.unsupported:
            return self._recompute(
                request,
                "unsupported_kv",
                f"this model's KV is not carried ({self.unsupported})",
                logging.WARNING,
            )
        if p.ranks is not None and p.ranks != self.transfers:
            return self._recompute(
                request,
                "rank_mismatch",
                f"its KV was moved as {p.ranks} transfer(s), one per prefill rank; this "
                f"engine's {self.ranks} rank(s) read {self.transfers}",
            )
        prompt = len(request.prompt_token_ids or ())
        if p.num_tokens != prompt:
            return self._recompute(
                request,
                "token_count",
                f"xdc_num_tokens {p.num_tokens} but the prompt has {prompt} tokens",
            )
        n = self.plan.moved_tokens(prompt) - num_computed_tokens
        if n <= 0:
            self._done_with(request)
            return 0, False
        if self._gate is not None:
            # no KV blocks until the KV is complete at the receiver (admission.py)
            timeout = p.timeout_s or self.cfg.timeout_s
            v, left = self._gate.check(
                request.request_id,
                transfer_names(p.rid, self._shards),
                self._arrival_s(p, timeout),
                timeout,
            )
            if v.admit is Admit.WAIT:
                return None, False
            if v.admit is Admit.RECOMPUTE:
                return self._recompute(
                    request, v.reason, f"transfer {p.rid}: {v.why}", logging.WARNING
                )
            self._left[request.request_id] = left
        return n, True

    def _recompute(
        self, request: Request, reason: str, why: str, level: int = logging.ERROR
    ) -> tuple[int, bool]:
        """Serve a decode request that asked for a load by prefilling it here; its answer
        names ``reason`` (``xdc_recomputed``)."""
        log.log(level, "xdc: request %s: %s; prefilling locally", request.request_id, why)
        LOAD_FAILURES.labels(reason).inc()
        self._recomputed[request.request_id] = reason
        self._done_with(request)
        return 0, False

    def _arrival_s(self, p: LoadParams, timeout_s: float) -> float:
        """How long the transfer may take to begin: the request's own wait (the gateway's
        prefill timeout), else the instance's, never past what is left of the whole wait."""
        return min(p.arrival_s or self.cfg.arrival_timeout_s, timeout_s)

    @staticmethod
    def _done_with(request: Request) -> None:
        """The request is loaded (or will not be): a later scheduling pass must not ask again."""
        if isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["do_remote_prefill"] = False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0 or not self.consumer:
            return
        p = self._params(request)
        if not isinstance(p, LoadParams):
            return
        tokens = self.plan.moved_tokens(p.num_tokens)
        pieces = load_pieces(self.plan, tokens, request.num_computed_tokens, blocks.get_block_ids())
        timeout = self._left.pop(request.request_id, None) or p.timeout_s or self.cfg.timeout_s
        self._meta.loads.append(
            LoadSpec(
                request.request_id,
                p.rid,
                tokens,
                pieces if isinstance(pieces, tuple) else (),
                timeout,
                self._arrival_s(p, timeout),
                pieces if isinstance(pieces, str) else "",
                request_digest(request, tokens),
            )
        )
        self._loading.add(request.request_id)
        self._done_with(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._meta = self._meta, XdcMetadata()
        if not self.producer:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            st = self._saving.get(new.req_id)
            if st is None:
                continue
            step = st.step(
                [list(b) for b in new.block_ids],
                new.num_computed_tokens,
                scheduler_output.num_scheduled_tokens.get(new.req_id, 0),
            )
            self._add_save(meta, st, step)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._saving.get(req_id)
            if st is None:
                continue
            if req_id in cached.resumed_req_ids:
                # preempted mid-prefill: its blocks were freed; the decode side recomputes
                log.warning(
                    "xdc: request %s preempted mid-prefill; its transfer is cancelled", req_id
                )
                meta.cancels.append(st.rid)
                del self._saving[req_id]
                continue
            new_ids = cached.new_block_ids[i]
            step = st.step(
                [list(b) for b in new_ids] if new_ids else [],
                cached.num_computed_tokens[i],
                scheduler_output.num_scheduled_tokens.get(req_id, 0),
            )
            self._add_save(meta, st, step)
        return meta

    def _add_save(self, meta: XdcMetadata, st: SaveState, step: SaveStep | None) -> None:
        if step is None:
            return
        if any(b == NULL_BLOCK for p in step.pieces for b in p.block_ids):
            # vLLM dropped a block the transfer carries (a sliding window's edge on a
            # prefix-cache hit): the decode side recomputes rather than read a hole
            log.warning(
                "xdc: request %s: vLLM holds no block for part of its transfer; cancelled",
                st.req_id,
            )
            meta.cancels.append(st.rid)
            self._saving.pop(st.req_id, None)
            return
        meta.saves.append(step)

    def on_new_request(self, request: Request) -> None:
        if not self.producer:
            return
        p = self._params(request)
        if not isinstance(p, SendParams):
            return
        if self.unsupported:
            self._refuse(request.request_id, p.rid, "unsupported_kv", self.unsupported)
            return
        prompt = len(request.prompt_token_ids or ())
        tokens = self.plan.moved_tokens(prompt)
        if tokens <= 0:
            self._refuse(
                request.request_id,
                p.rid,
                "nothing_to_move",
                f"a {prompt}-token prompt leaves nothing to move",
            )
            return
        why = self._admit(p.peer)
        if why is not None:
            self._refuse(request.request_id, p.rid, *why)
            return
        made_from = request_digest(request, tokens)  # before the prompt is cut short
        if tokens < prompt:
            _stop_short(request, prompt - tokens)
        self._saving[request.request_id] = SaveState(
            request.request_id,
            p.rid,
            tokens,
            self.plan,
            p.deadline_s or self.cfg.deadline_s,
            prompt_len=prompt,
            peer=p.peer,
            prompt_digest=made_from,
        )

    ADMIT_TIMEOUT_S = 1.0  # the longest the scheduler waits for its sender's word

    def _admit(self, peer: str | None) -> tuple[str, str] | None:
        """Ask the sender whether it would ship to ``peer`` now; (reason, why) if not.
        One unix-socket round trip per offloaded request, on the scheduler's own
        connection: it lets the request's answer say at once that its KV will not come.
        A connection from before a sender restart fails once and is replaced at once."""
        while True:
            reused = self._admitter is not None
            try:
                if self._admitter is None:
                    self._admitter = PrefillClient(self.cfg.sender_socket, self.ADMIT_TIMEOUT_S)
                a = self._admitter.admit(peer, self.ADMIT_TIMEOUT_S)
            except (XdcError, OSError) as e:
                if self._admitter is not None:
                    with contextlib.suppress(Exception):
                        self._admitter.close()
                    self._admitter = None
                if isinstance(e, XdcError) and e.code == ResultCode.BAD_OP:
                    return None  # a sender from before admission: try anyway
                if reused:
                    continue  # the next pass connects afresh (and does not come back here)
                return "sender_down", str(e)
            return None if a.ok else (a.reason, a.why)

    def _refuse(self, req_id: str, rid: str, reason: str, why: str) -> None:
        log.warning(
            "xdc: cannot send %s (request %s): %s; its decode will prefill by itself",
            rid,
            req_id,
            why,
        )
        SENDS.labels("refused").inc()
        self._send_failed[req_id] = reason

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, XdcWorkerMetadata):
            merge_reasons(self._recomputed, meta.recomputed)
            for req_id, why in meta.send_failed.items():
                # a prefill still running: its answer can still say so (one that finished
                # in the step that failed has answered already; its decode times out)
                if self._saving.pop(req_id, None) is not None:
                    self._send_failed[req_id] = why

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's call: one block list per KV cache group. The blocks were
        copied out as they became final, so none is held back."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._left.pop(request.request_id, None)
        if self._gate is not None:
            self._gate.forget(request.request_id)  # aborted while its KV was still coming
        if request.request_id in self._loading:
            # its blocks are freed when this returns and may go to another request in the
            # very next step: the worker drops the load (before it lands anything that step)
            self._loading.discard(request.request_id)
            self._meta.drops.append(request.request_id)
        why = self._recomputed.pop(request.request_id, None)
        if why is not None:
            # the decode's answer says its KV did not come through xdc, and why
            return False, {"xdc_recomputed": why}
        failed = self._send_failed.pop(request.request_id, None)
        if failed is not None:
            return False, failed_params(failed)
        st = self._saving.pop(request.request_id, None)
        if st is None:
            return False, None
        if not st.complete:  # aborted before its prompt was computed
            self._meta.cancels.append(st.rid)
            return False, None
        # the blocks were copied into the sender's memory synchronously: free them now
        return False, handover_params(st.rid, st.prompt_len, self.transfers)

    # --- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """What a block of each layer is comes from its tensor and the layout vLLM resolved
        (``kvcopy.block_shape``); a layer xdc can not read is named and nothing is moved."""
        why = self.unsupported
        if why is None and self.ranks > 1:
            rank = tp_rank()
            if isinstance(rank, str):
                why = rank
            else:
                self._rank = rank
        layout = self._declared_layout()
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        shapes: list[BlockShape] = []
        if why is None:
            for name, t in kv_caches.items():
                if self._layer_group and name not in self._layer_group:
                    why = f"layer {name} is in no KV cache group"
                    break
                shape = block_shape(t, num_blocks, layout)
                if isinstance(shape, str):
                    why = f"layer {name}: {shape}"
                    break
                shapes.append(shape)
        if (
            why is None
            and not self._layer_group
            and len({(s.rows, s.row_shape) for s in shapes}) > 1
        ):
            why = "layers of several shapes and no KV cache groups to tell them apart"
        copier = copier_for(list(kv_caches.values())) if why is None else None
        if isinstance(copier, str):
            why = copier
        if why or copier is None or isinstance(copier, str):
            self.unsupported = why
            log.warning("xdc: %s: nothing is moved, requests are served locally", why)
            return
        self._copier = copier
        self._shapes = shapes
        self._kv = dict(kv_caches)
        self._layers = list(self._kv.values())  # by transfer layer index
        names = list(self._kv)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self.plan = KvPlan(tuple(self._groups), tuple(self._layer_group.get(n, 0) for n in names))
        self._bb = [sh.block_bytes for sh in shapes]
        parts = split_parts(self.plan, self._shards, self._rank, self.ranks)
        if isinstance(parts, str):
            self.unsupported = parts
            log.warning("xdc: %s: nothing is moved, requests are served locally", parts)
            return
        self._parts = parts
        self._where = {i: (k, j) for k, p in enumerate(parts) for j, i in enumerate(p.layers)}
        self._part_bb = [[self._bb[i] for i in p.layers] for p in parts]
        self._layouts = [
            layout_string(self.vllm_config, p.plan, bb, p.index, shards=p.shards)
            for p, bb in zip(parts, self._part_bb, strict=True)
        ]
        log.info(
            "xdc: rank %d/%d: %d layers in groups %s, block bytes %s, layout %s (%s), %s copies",
            self._rank,
            self.ranks,
            len(self._kv),
            self.plan.describe(),
            sorted(set(self._bb)),
            " + ".join(self._layouts),
            layout or "undeclared",
            copier.device,
        )
        if self.producer and any(p.mover for p in parts):
            self._handover = Handover(
                self._send_failed_worker, _handed_over, threaded=isinstance(copier, CudaCopier)
            )
        if self.consumer:
            self._loader = PartLoaders(
                [
                    (
                        p,
                        Loader(
                            self.cfg,
                            self._layouts[k],
                            {names[i]: self._layers[i] for i in p.layers},
                            [shapes[i] for i in p.layers],
                            p.plan,
                            copier,
                            readers=p.readers,
                            ranks=self.ranks,
                        ),
                    )
                    for k, p in enumerate(parts)
                ],
                self._load_rid,
            )

    @staticmethod
    def _load_rid(part: Part, rid: str) -> str:
        """The transfer this worker's rank loads of ``part`` for ``rid`` (planted fault
        ``other_shard``: the next copy's, what a mix-up of ranks would do; its layout names
        the other copy)."""
        if FAULT == "other_shard" and part.shards > 1:
            return shard_rid(rid, (part.index + 1) % part.shards, part.shards)
        return part.rid(rid)

    def _declared_layout(self) -> str | None:
        """The KVCacheLayout vLLM resolved for this engine (its name), if it says."""
        name = getattr(self._kv_cache_config, "kv_cache_layout", None) or getattr(
            self.vllm_config.cache_config, "kv_cache_layout", None
        )
        return str(getattr(name, "name", name)) if name else None

    def _send_failed_worker(self, out: Outgoing, why: str) -> None:
        """A request's KV will not reach its decode (called under the hand-over lock)."""
        SENDS.labels("failed").inc()
        self._give_up(out.req_id, why, but=out)

    def _give_up(self, req_id: str, why: str, but: Outgoing | None = None) -> None:
        """Say why ``req_id``'s KV will not reach its decode, and give up its other parts'
        transfers (``parts.py``): the decode recomputes anyway, and they would only hold
        pool space on both sides. (Called under the hand-over lock, or before any copy.)"""
        self._worker_send_failed.setdefault(req_id, why)
        for key, o in list(self._out.items()):
            if o is not but and o.req_id == req_id and not o.ended:
                o.ended = True
                del self._out[key]
                if self._tx is not None:
                    with contextlib.suppress(XdcError, OSError):
                        self._tx.cancel(o.transfer.rid, "another part of the request failed")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, XdcMetadata)
        if meta.loads and self._loader is not None:
            self._loader.add(meta.loads)
        if meta.drops and self._loader is not None:
            self._loader.drop(meta.drops)
        for rid in meta.cancels:
            for part in self._parts:
                out = self._out.pop(part.rid(rid), None)
                if out is not None and self._tx is not None and self._handover is not None:
                    with self._handover.lock, contextlib.suppress(XdcError, OSError):
                        out.ended = True
                        self._tx.cancel(out.transfer.rid, "vLLM gave the request up")
        for step in meta.saves:
            self._begin(step)

    def _sender(self) -> PrefillClient:
        if self._tx is not None and self._tx.broken:
            # a call on it failed (the sender died mid-transfer, say): whichever call saw
            # it, the next request connects afresh instead of failing on the dead socket
            self._drop_sender()
        if self._tx is None:
            self._tx = PrefillClient(self.cfg.sender_socket)
            if self._copier is not None:  # the pool becomes a DMA target (GPU)
                self._tx_pool = pool_tensor(self._tx.segment.view)
                self._copier.pin(self._tx_pool)
        return self._tx

    def _drop_sender(self) -> None:
        """The sender's socket failed or is closing: no copy may still write its pool when
        it is unpinned and unmapped. (Caller holds the hand-over lock.)"""
        for out in self._out.values():
            if not out.ended:  # its KV will not reach its decode: the gateway recovers now
                out.ended = True
                self._send_failed_worker(out, "sender_down")
        self._out.clear()
        if self._copier is not None and self._tx_pool is not None:
            self._copier.quiesce()
            self._copier.unpin(self._tx_pool)
        self._tx_pool = None
        if self._tx is not None:
            with contextlib.suppress(Exception):
                self._tx.close()
        self._tx = None

    def _begin(self, step: SaveStep) -> None:
        """Announce the transfer, once. vLLM 0.32 on CPU runs the forward pass (and so
        ``save_kv_layer``) before ``start_load_kv``, so whichever comes first begins it."""
        if not step.begin or step.rid in self._handled or self._handover is None:
            return
        with self._handover.lock:
            self._begin_locked(step)

    def _begin_locked(self, step: SaveStep) -> None:
        """One transfer per part this rank moves; if one can not begin, those begun already
        are given up with it (the decode recomputes)."""
        self._handled.add(step.rid)
        for k, part in enumerate(self._parts):
            if not part.mover:
                continue
            counts = part.plan.per_layer(part.counts(step.counts))
            sizes = [n * bb for n, bb in zip(counts, self._part_bb[k], strict=True)]
            sizes.append(digest_layer_bytes(counts))
            try:
                t = self._sender().begin(
                    part.rid(step.rid),
                    sizes,
                    deadline_s=step.deadline_s,
                    layout=self._layouts[k],
                    peer=step.peer,
                )
            except (XdcError, OSError) as e:
                log.error("xdc: cannot send %s: %s; its decode will prefill locally", step.rid, e)
                SENDS.labels("refused").inc()
                code = e.code if isinstance(e, XdcError) else None
                # the daemon refused this request (a bad peer, a full pool...), or it is gone
                refused = isinstance(e, TransferError) and code is not ResultCode.TIMEOUT
                why = "begin_refused" if refused else "sender_down"
                if not isinstance(e, XdcError) or code != ResultCode.BAD_REQUEST:
                    # the daemon or its socket is gone: connect afresh for the next request
                    self._drop_sender()
                self._give_up(step.req_id, why)
                return
            self._out[part.rid(step.rid)] = Outgoing(
                t,
                [None] * len(part.layers),
                counts,
                self._part_bb[k],
                step.req_id,
                step.prompt_digest,
            )

    def _save_layer(self, step: SaveStep, i: int) -> None:
        """Copy this step's final blocks of layer ``i`` into the transfer of its part; they
        are handed over once the copy landed (at once on CPU; on a GPU, ``saves.Handover``)."""
        k, j = self._where.get(i, (-1, -1))
        if k < 0 or not self._parts[k].mover or self._handover is None:
            return
        key = self._parts[k].rid(step.rid)
        out = self._out.get(key)
        if out is None or out.ended or j in out.saved:
            return
        out.saved.add(j)
        piece = step.piece(self.plan.layer_groups[i])
        if piece is None:
            return
        assert self._copier is not None
        bb = self._bb[i]
        with self._handover.lock:
            try:
                view = out.views[j]
                if view is None:
                    view = out.views[j] = torch.from_numpy(out.transfer.layer_buffer(j))
            except (XdcError, OSError) as e:
                log.error("xdc: sending %s failed at layer %d: %s", key, i, e)
                self._out.pop(key, None)
                out.ended = True
                self._send_failed_worker(out, "send_failed")
                return
        copy = self._copier.save(
            self._layers[i], self._shapes[i], piece.block_ids, view, piece.first
        )
        upto = None if step.last else (piece.first + len(piece.block_ids)) * bb
        if step.last:
            out.views[j] = None
        self._handover.submit(
            out, SavedCopy(j, piece.first, len(piece.block_ids), upto, view, copy)
        )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, XdcMetadata) or not meta.saves:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for step in meta.saves:
            self._begin(step)
            self._save_layer(step, i)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def wait_for_save(self) -> None:
        """The step's forward is done: layers vLLM makes no ``save_kv_layer`` call for (a
        linear-attention or SSM layer, whose state is final now) are copied here, then a
        finished transfer's digest layer goes."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, XdcMetadata) and self._handover is not None:
            for step in meta.saves:
                self._begin(step)
                for i in range(len(self._kv)):
                    self._save_layer(step, i)
                for part in self._parts:
                    out = self._out.get(part.rid(step.rid))
                    if out is None:
                        continue
                    out.saved.clear()
                    if step.last:
                        self._out.pop(part.rid(step.rid), None)
                        self._handover.last_step_copied(out)  # then the digest layer goes
        self._handled.clear()
        if self._tx is not None and self._handover is not None:
            with self._handover.lock:
                if self._tx.broken:  # its transfers' decodes recompute now, not at a timeout
                    self._drop_sender()
                    return
                try:
                    for o in self._tx.poll_outcomes():
                        if not o.ok:
                            log.warning("xdc: transfer %s failed: %s %s", o.rid, o.code, o.error)
                except (XdcError, OSError) as e:
                    log.error("xdc: the sender's socket failed: %s", e)
                    self._drop_sender()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._loader is None:
            return KVConnectorTransferResults()
        done, failed = self._loader.take()
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reasons = self._loader.reasons if self._loader is not None else {}
        with self._handover.lock if self._handover is not None else contextlib.nullcontext():
            failed, self._worker_send_failed = self._worker_send_failed, {}
        if not reasons and not failed:
            return None
        meta = XdcWorkerMetadata(reasons, failed)
        if self._loader is not None:
            self._loader.clear_reasons()
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return None, r.finished_recving or None

    def shutdown(self) -> None:
        if self._gate is not None:
            self._gate.close()
        if self._admitter is not None:
            self._admitter.close()
            self._admitter = None
        if self._loader is not None:
            self._loader.stop()
        if self._handover is not None:
            self._handover.stop()
            with self._handover.lock:
                self._drop_sender()


def tp_rank() -> int | str:
    """This worker's tensor-parallel rank, or why it can not be known."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception as e:  # not initialised: vLLM raises AssertionError, others may vary
        return f"the tensor parallel rank is unknown ({type(e).__name__}: {e})"


def _stop_short(request: Request, backoff: int) -> None:
    """Make the producer prefill all but the last ``backoff`` prompt tokens (a state group's
    rule, blocks.py): the decode side computes those itself. As vLLM's NIXL connector does
    it; the producer's one sampled token is never used (the gateway streams the decode's)."""
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1


def _handed_over(out: Outgoing) -> None:
    SENDS.labels("handed_over").inc()


__all__ = ["XdcConnector", "layout_string"]
