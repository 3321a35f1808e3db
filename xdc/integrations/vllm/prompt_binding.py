"""What a transfer's KV was made from, as one 64-bit digest both engines compute.

The block digests prove the consumer holds the bytes the producer copied; they cannot tell
that those bytes belong to *this* prompt. A transfer id is only a name: a gateway that reuses
one (a restarted counter, two replicas), mixes two up, or a client that names someone else's,
hands the consumer a valid transfer of another prompt's KV, which hashes right block by block
and decodes into wrong tokens (``test_vllm_connector``'s teeth test did exactly that). So the
producer puts the digest of what its KV depends on into the transfer's digest layer, and the
consumer compares it with its own prompt's before it reports the load: a mismatch is a
recompute with the reason ``prompt_mismatch``.

What KV depends on, for the tokens that move (the first ``tokens`` of the prompt; attention is
causal, so later tokens do not matter): their ids; the multimodal items placed among them
(vLLM's content identifier, offset and length: image placeholder tokens are all alike); the
LoRA adapter by name; prompt embeddings when the prompt came as embeddings. That is what
vLLM's own prefix-cache block hash covers (the salt aside, which changes no KV), but vLLM's
hashes are seeded per process unless PYTHONHASHSEED is set, and leave out a prompt's partial
last block, so they cannot be compared across two engines.

xxh3-64 is not a MAC: this catches mistakes and blind guesses, not a client that crafts a
colliding prompt (which would only feed its own request the wrong KV).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import xxhash

VERSION = b"xdc-prompt-v1\0"


def prompt_digest(
    token_ids: Sequence[int],
    tokens: int,
    *,
    mm: Sequence[tuple[str, int, int]] = (),
    lora: str = "",
    embeds: bytes | memoryview | None = None,
) -> int:
    """The digest of the first ``tokens`` tokens of a prompt and of what else their KV
    depends on: ``mm`` as (identifier, offset, length) of each multimodal item that begins
    among them, ``lora`` the adapter's name, ``embeds`` the bytes of their embeddings."""
    if not 0 <= tokens <= len(token_ids) and embeds is None:
        raise ValueError(f"{tokens} tokens of a {len(token_ids)}-token prompt")
    h = xxhash.xxh3_64(VERSION)
    h.update(tokens.to_bytes(8, "little"))
    h.update(array.array("q", token_ids[:tokens]).tobytes())
    for ident, offset, length in mm:
        if offset < tokens:
            h.update(f"\0mm\0{ident}\0{offset}\0{length}".encode(errors="surrogatepass"))
    if lora:
        h.update(b"\0lora\0" + lora.encode(errors="surrogatepass"))
    if embeds is not None:
        h.update(b"\0embeds\0")
        h.update(embeds)
    return h.intdigest()


def request_digest(request: Any, tokens: int) -> int:
    """``prompt_digest`` of a vLLM ``Request`` (read by duck typing: its ``prompt_token_ids``,
    ``mm_features``, ``lora_request`` and ``prompt_embeds``)."""
    ids = request.prompt_token_ids or ()
    mm = []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        mm.append((str(f.identifier), int(pos.offset), int(pos.length)))
    lora = getattr(request, "lora_request", None)
    embeds = getattr(request, "prompt_embeds", None)
    data = None
    if embeds is not None:
        import torch  # only a request given as embeddings has a tensor here

        t = embeds[:tokens].detach().to("cpu").contiguous()
        data = memoryview(t.view(torch.uint8).numpy()).cast("B")
    return prompt_digest(
        ids,
        min(tokens, len(ids)) if data is not None else tokens,
        mm=mm,
        lora=str(lora.lora_name) if lora else "",
        embeds=data,
    )
