"""The digest that binds a transfer's KV to the prompt it was made from (pure: no vLLM, no
torch). The consumer compares it with its own prompt's before a load is reported; the real
engines' side of it is in test_vllm_connector.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from xdc.integrations.vllm.prompt_binding import prompt_digest, request_digest

IDS = list(range(1000, 1300))


def test_the_same_prompt_gives_the_same_digest_and_one_changed_token_another() -> None:
    d = prompt_digest(IDS, 300)
    assert prompt_digest(list(IDS), 300) == d
    changed = list(IDS)
    changed[150] += 1
    assert prompt_digest(changed, 300) != d
    assert prompt_digest(IDS, 299) != d  # a prefix is another prompt


def test_only_the_tokens_that_move_count() -> None:
    """A state model's producer moves all but the last token: what follows is not in the KV."""
    assert prompt_digest(IDS, 299) == prompt_digest([*IDS[:299], 7], 299)


def test_multimodal_items_lora_and_embeddings_are_part_of_the_prompt() -> None:
    base = prompt_digest(IDS, 300, mm=[("img-a", 10, 50)])
    assert prompt_digest(IDS, 300, mm=[("img-b", 10, 50)]) != base  # same placeholders
    assert prompt_digest(IDS, 300, mm=[("img-a", 11, 50)]) != base
    assert prompt_digest(IDS, 300, mm=[("img-a", 10, 50), ("img-c", 300, 5)]) == base
    assert prompt_digest(IDS, 300, lora="adapter-1") != prompt_digest(IDS, 300)
    assert prompt_digest(IDS, 300, lora="a") != prompt_digest(IDS, 300, lora="b")
    e = bytes(range(256)) * 4
    assert prompt_digest(IDS, 300, embeds=e) != prompt_digest(IDS, 300, embeds=e[:-1] + b"x")


def test_more_tokens_than_the_prompt_has_is_an_error() -> None:
    with pytest.raises(ValueError, match="301 tokens of a 300-token prompt"):
        prompt_digest(IDS, 301)


@dataclass
class _Pos:
    offset: int
    length: int


@dataclass
class _Feature:
    identifier: str
    mm_position: _Pos


@dataclass
class _Lora:
    lora_name: str
    lora_path: str = "/somewhere/else/on/each/host"


@dataclass
class _Request:
    """What the digest reads of vLLM 0.32's ``Request``, by the same names."""

    prompt_token_ids: list[int] | None
    mm_features: list[Any] = field(default_factory=list)
    lora_request: _Lora | None = None
    prompt_embeds: Any = None


def test_a_vllm_request_is_read_by_its_attribute_names() -> None:
    r = _Request(IDS, [_Feature("img-a", _Pos(10, 50))], _Lora("adapter-1"))
    assert request_digest(r, 300) == prompt_digest(
        IDS, 300, mm=[("img-a", 10, 50)], lora="adapter-1"
    )
    assert request_digest(_Request(IDS), 300) == prompt_digest(IDS, 300)
    # the adapter's path is where each host keeps it: not part of what the KV is
    assert request_digest(_Request(IDS, lora_request=_Lora("x", "/a")), 300) == request_digest(
        _Request(IDS, lora_request=_Lora("x", "/b")), 300
    )
