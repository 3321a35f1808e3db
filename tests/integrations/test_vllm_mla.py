"""Multi-head latent attention through xdc on real vLLM CPU engines (issue 27): the
full-attention layers of Kimi Linear and Ring-2.5 are MLA, whose KV is one latent per token
(512 + 64 values here, what vLLM's CPU MLA backends take, in blocks of 16 tokens). A tiny
DeepSeek-V2-shaped model stands in for them: vLLM 0.32 maps KimiLinearForCausalLM to its
NVIDIA implementation (vllm/models/kimi_k3/nvidia), which does not load on the CPU build (its
MLA weight absorption sees the CPU linear layer's repacked kv_b_proj as empty).

The engines run bf16 on vLLM's reference MLA backend (``MLA_ENGINE``; vLLM picks its AMX MLA
backend where the host has AMX, so it is named, for the same kernels on every host), with the
rotary embedding done by PyTorch's ops: the CPU build's rotary kernel misreads MLA's slices
(``xdc.lab.vllm_rig.MLA_CUSTOM_OPS`` says how), which made a token's cached latent depend on
the prompt's length. Until that was found (2026-12-01) these engines ran float32, since in
bf16 a 10-token prompt decoded other tokens through xdc than the reference, every run: the
producer had prefilled 10 tokens, so token 1's k_pe was rotated for position 9, where the
reference, prefilling 9, left it unrotated. With PyTorch's rotation 10, 19, 28, 300 and
1,000 tokens agree in bf16 and the producer's latents of a prompt's first tokens are the same
bytes whatever its length.

The reference decodes the last prompt token the way the decode instance does. vLLM's CPU
build turns chunked prefill and prefix caching off for MLA, so a plain engine prefills a
whole prompt with its prefill kernel (SDPA over decompressed K/V), while the decode instance,
which loaded the KV of the whole prompt, recomputes the last token with the absorbed decode
kernel (``mla_decode_kvcache_cpu``); in bf16 the two pick different tokens now and then (with
the rotation fixed: at 29 and 53 of 17 prompt lengths from 5 to 1,000 tokens, 2026-12-01),
by rounding: the decode kernel matches a float32 softmax(q K^T) V over the same blocks to
0.7% in bf16 and to 1e-6 in float32 at 1 to 300 tokens. So each prompt is a prefix ``p``
and the token the plain engine generates after it, ``t``: the plain engine then prefills
``p`` and decodes ``t`` with the decode kernel, as the decode instance does, and its next 8
tokens are the reference."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm_fixtures import Engine, KvPair, kv_pair, mla_model, prompt
from xdc.lab.vllm_rig import MLA_CUSTOM_OPS, PY

pytestmark = pytest.mark.vllm

MLA_ENGINE: dict[str, Any] = {"attention_backend": "CPU_MLA", "custom_ops": MLA_CUSTOM_OPS}
LATENT_TOKEN_BYTES = (512 + 64) * 2  # bf16
# A decode that gives up on its KV recomputes, which for MLA is another kernel and may be
# other tokens (module docstring): the wait must outlast a prefill on a loaded 2-core host
# (4 s did not, twice in 3 runs of tests/integrations). A passing decode never waits it out.
WAITS = {"arrival_timeout_s": 20.0, "timeout_s": 60.0}


def mla_block(pair: KvPair) -> int:
    """Tokens per block of the decode engine's MLA cache, as its connector reported it: 16,
    which vLLM's reference CPU MLA backend forces."""
    m = re.search(r"in groups \w+/bs(\d+):[\d,]+, block bytes \[(\d+)\]", pair.consumer.log())
    assert m, pair.consumer.log()[-3000:]
    block, nbytes = int(m.group(1)), int(m.group(2))
    assert block == 16 and nbytes == block * LATENT_TOKEN_BYTES, m.group(0)
    return block


@pytest.fixture(scope="module")
def mla() -> Iterator[KvPair]:
    with kv_pair(mla_model(), engine=MLA_ENGINE, consumer={"extra": WAITS}) as made:
        yield made


def _prompt_and_reference(plain: Engine, n: int, seed: int) -> tuple[list[int], list[int]]:
    """A prompt of ``n`` tokens whose last one is the plain engine's own next token, and the
    8 tokens the plain engine decodes after it (see the module docstring)."""
    p = prompt(n - 1, seed=seed)
    out = plain.generate([p], None, 9)[0]["token_ids"]
    return [*p, out[0]], list(out[1:])


@pytest.mark.parametrize("n", [10, 300, 1000])
def test_mla_decode_tokens_equal_a_plain_run(mla: KvPair, n: int) -> None:
    """10 tokens (under a block), 300 and 1000: the latent KV of all 4 layers moves, and the
    decode's tokens are the plain run's."""
    ids, want = _prompt_and_reference(mla.reference, n, 3300 + n)
    got, _, rid = mla.pair(ids)
    # a recompute (the KV refused or late) decodes with the prefill kernel: its log says why
    assert got["token_ids"] == want, (n, rid, mla.logs())
    block = mla_block(mla)
    assert (
        mla.delivered_bytes(rid) == 4 * -(-n // block) * (block * LATENT_TOKEN_BYTES + 8) + 8
    )  # + the prompt's digest
    assert "prefilling it locally" not in mla.consumer.log()


def test_another_requests_latent_kv_is_refused_and_recomputed(mla: KvPair) -> None:
    """The consumer recomputes the whole prompt as a plain engine does (prefill kernel, no
    loaded KV), so its tokens are the plain engine's for the whole prompt (``want``), not
    the decode-kernel reference of the module docstring."""
    a, _ = _prompt_and_reference(mla.reference, 300, 1)
    got, _, _ = mla.pair(a, made_from=prompt(300, seed=2))
    assert got["token_ids"] == mla.want(a)
    assert "made from another prompt" in mla.consumer.log(), mla.logs()


def test_another_requests_latent_kv_changes_the_tokens_with_the_binding_planted_away(
    mla: KvPair,
) -> None:
    """The equality has teeth: a consumer that skips the prompt check (planted fault
    XDC_CONNECTOR_FAULT=unbound_prompt) decodes prompt a from the latent KV made for b."""
    a, want = _prompt_and_reference(mla.reference, 300, 1)
    unbound = Engine(
        "consumer",
        core=1,
        model=mla_model(),
        receiver_socket=mla.rx_sock,
        extra=WAITS,
        env={"XDC_CONNECTOR_FAULT": "unbound_prompt"},
        **MLA_ENGINE,
    )
    try:
        got, _, rid = mla.pair(a, consumer=unbound, made_from=prompt(300, seed=2))
        mla.delivered_bytes(rid)
        assert got["token_ids"] != want
    finally:
        unbound.close()


# MLA's slices as DeepseekV2's layer hands them to the rotary embedding (12 tokens, 4 heads):
# which rows of k_pe and q's rope half the CPU build's kernel rotates right, in place, and
# which PyTorch's ops (what ``MLA_CUSTOM_OPS`` selects) rotate right
_ROTARY_CHECK = """
import json, torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig()):
    from vllm.model_executor.layers.rotary_embedding import get_rope
    rope = get_rope(64, max_position=8192, is_neox_style=False, dtype=torch.bfloat16,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
torch.manual_seed(0)
m = 12
kv, q = torch.randn(m, 576).bfloat16(), torch.randn(m, 4, 128).bfloat16()
pos = torch.arange(m)
want_q, want_k = rope.forward_native(pos, q[..., 64:].clone(), kv[:, 512:].clone().unsqueeze(1))
def right(a, b, r):
    return torch.allclose(a[r].float(), b[r].float(), atol=2e-2)
k_pe, q_pe = kv[:, 512:].unsqueeze(1), q[..., 64:]
nat_q, nat_k = rope.forward_native(pos, q_pe, k_pe)
ops.rotary_embedding(pos, q_pe, k_pe, 64, rope.cos_sin_cache, False)
print(json.dumps({
    "kernel_k": [r for r in range(m) if right(k_pe, want_k, r)],
    "kernel_q": [r for r in range(m) if right(q_pe, want_q, r)],
    "native_k": [r for r in range(m) if right(nat_k, want_k, r)],
    "native_q": [r for r in range(m) if right(nat_q, want_q, r)],
}))
"""


def test_the_cpu_builds_rotary_kernel_still_misreads_mla_slices() -> None:
    """Why ``MLA_CUSTOM_OPS`` is there, and that it is still needed: the kernel rotates only
    token 0 of k_pe right (it steps 64 values per token through a 576-value latent) and no
    row of q's rope half, while PyTorch's ops rotate every row right. When a vLLM upgrade
    fixes the kernel this fails: drop MLA_CUSTOM_OPS then."""
    res = subprocess.run(
        [str(PY), "-c", _ROTARY_CHECK], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert rows["native_k"] == rows["native_q"] == list(range(12)), rows
    assert rows["kernel_k"] == [0] and rows["kernel_q"] == [], (
        f"vLLM's CPU rotary kernel now rotates MLA's slices right ({rows}): "
        "xdc.lab.vllm_rig.MLA_CUSTOM_OPS can go"
    )
