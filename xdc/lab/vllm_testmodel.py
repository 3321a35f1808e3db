"""A small seeded random Llama checkpoint, written locally (no model hub): the test and demo
model for the vLLM integration.

Random weights with ``initializer_range`` 0.05 make the output depend on the context: wrong KV
(zeroed, shifted, another request's) changes the generated tokens, so token equality with a
plain run is a real check of the moved bytes. 4 layers, hidden 256, 4 heads / 2 KV heads,
head_dim 64, vocab 2048: ~7 MB, written in a second. Tests send token ids (engines may run
with ``skip_tokenizer_init=True``); a byte-level tokenizer with a plain chat template is
written beside the weights so an OpenAI server can take text and chat messages too (the
gateway's text path). Every id in the vocabulary decodes: 3 specials, the 256 byte symbols,
and 1,789 two-byte merges, so whatever the random weights generate can be detokenized.

    python -m xdc.lab.vllm_testmodel DIR      (or: xdc vllm make-model DIR)

Runs where vLLM is installed (it needs torch and transformers).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

LAYERS = 4
VOCAB = 2048


MARKER = "xdc-testmodel.json"


def _written_already(out: Path, want: Mapping[str, object]) -> bool:
    """The checkpoint in ``out`` was written with these arguments (writing is idempotent)."""
    marker = out / MARKER
    return marker.exists() and json.loads(marker.read_text()) == want


# What every test model shares, so that a dense and a hybrid one compare (bench: KV bytes per
# prompt token at the same hidden size and layer count).
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "initializer_range": 0.05,
}


def _write(out: Path, want: dict[str, Any], make: Callable[[dict[str, Any]], Any]) -> Path:
    """Write ``make(SHAPE)``'s seeded random weights (bf16) and the tokenizer into ``out``,
    unless a checkpoint written with the same ``want`` is there already."""
    if _written_already(out, want):
        return out
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(want["seed"]))
    make(dict(SHAPE)).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    (out / MARKER).write_text(json.dumps(want))
    return out


def write_model(out: Path, *, layers: int = LAYERS, seed: int = 0) -> Path:
    """Write the checkpoint into ``out`` (created); idempotent for the same arguments."""

    def make(shape: dict[str, Any]) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        shape["num_hidden_layers"] = layers
        return LlamaForCausalLM(
            LlamaConfig(
                **shape,
                max_position_embeddings=4096,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
                torch_dtype="bfloat16",
            )
        )

    return _write(out, {"layers": layers, "seed": seed, "version": 2}, make)


def write_hybrid_model(out: Path, *, seed: int = 0, full_every: int = 2, kv_heads: int = 2) -> Path:
    """A tiny random Qwen3-Next-shaped checkpoint (gated-delta-net linear attention beside full
    attention, one full layer in every ``full_every``: 2 is 1:1, 4 is Qwen3.5's and Kimi
    Linear's 3:1; MoE MLPs): a hybrid model vLLM's CPU build runs (../shared/VLLM.md).
    ``kv_heads`` 1 makes the full-attention KV whole at every tensor-parallel rank beside a
    state split by heads: Kimi Linear's shape (its latent beside KDA state), which vLLM's CPU
    build can not run itself."""
    if not 1 <= full_every <= LAYERS:
        raise ValueError(f"full_every: 1..{LAYERS}")
    if kv_heads not in (1, 2, 4):
        raise ValueError("kv_heads: 1, 2 or 4 (a divisor of the 4 attention heads)")

    def make(shape: dict[str, Any]) -> Any:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        shape["num_key_value_heads"] = kv_heads
        return Qwen3NextForCausalLM(
            Qwen3NextConfig(
                **shape,
                linear_num_value_heads=4,
                linear_num_key_heads=2,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
                linear_conv_kernel_dim=4,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
                decoder_sparse_step=1,
                full_attention_interval=full_every,
                max_position_embeddings=8192,
            )
        )

    want: dict[str, Any] = {"kind": "qwen3-next", "seed": seed, "version": 1}
    if full_every != 2:
        want["full_every"] = full_every
    if kv_heads != 2:
        want["kv_heads"] = kv_heads
    return _write(out, want, make)


def write_sliding_model(out: Path, *, seed: int = 0) -> Path:
    """A tiny random Gemma-3-shaped checkpoint: three sliding-window layers (window 64 tokens)
    to one full-attention layer, like MiMo-V2-Flash's SWA + GQA mix (PrfaaS Table 1)."""

    def make(shape: dict[str, Any]) -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(
            Gemma3TextConfig(
                **shape,
                sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                max_position_embeddings=8192,
                query_pre_attn_scalar=64,
                # untied: with tied embeddings a random Gemma echoes its last input token
                tie_word_embeddings=False,
            )
        )

    return _write(out, {"kind": "gemma3-swa", "seed": seed, "version": 1}, make)


def write_mla_model(out: Path, *, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V2-shaped checkpoint: multi-head latent attention (the
    full-attention layers of Kimi Linear and Ring-2.5 are MLA), a 512 + 64 latent per token,
    the only latent size vLLM's CPU MLA backend takes; dense MLPs."""

    def make(shape: dict[str, Any]) -> Any:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        shape["num_key_value_heads"] = shape["num_attention_heads"]
        return DeepseekV2ForCausalLM(
            DeepseekV2Config(
                **shape,
                kv_lora_rank=512,
                q_lora_rank=None,
                qk_rope_head_dim=64,
                qk_nope_head_dim=64,
                v_head_dim=64,
                moe_intermediate_size=128,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=LAYERS,
                max_position_embeddings=8192,
                tie_word_embeddings=False,
            )
        )

    return _write(out, {"kind": "deepseek-v2-mla", "seed": seed, "version": 1}, make)


SLIDING_WINDOW = 64

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE covering all VOCAB ids (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<unk>", "<s>", "</s>"]
    symbols = sorted(ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + symbols)}
    letters = [c for c in "etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLU" if c in vocab]
    merges: list[tuple[str, str]] = []
    for a in ["\u0120", *letters]:  # "\u0120" is the byte-level space
        for b in letters:
            if len(vocab) >= VOCAB:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    n = 0
    while len(vocab) < VOCAB:  # pad with three-letter merges if the pairs ran out
        a, b = letters[n % len(letters)] + letters[n // len(letters) % len(letters)], letters[0]
        if a in vocab and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
        n += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="directory to write the checkpoint into")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--full-every",
        type=int,
        default=2,
        help="with --hybrid: one full-attention layer in every N (2: 1:1, 4: 3:1)",
    )
    ap.add_argument(
        "--kv-heads",
        type=int,
        default=2,
        choices=(1, 2, 4),
        help="with --hybrid: full-attention KV heads (1: whole at every tensor-parallel rank)",
    )
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument(
        "--hybrid",
        action="store_true",
        help="a Qwen3-Next-shaped model (linear attention beside full attention) instead",
    )
    kind.add_argument(
        "--mla",
        action="store_true",
        help="a DeepSeek-V2-shaped model (multi-head latent attention) instead",
    )
    kind.add_argument(
        "--sliding",
        action="store_true",
        help="a Gemma-3-shaped model (sliding-window layers beside full attention) instead",
    )
    a = ap.parse_args(argv)
    if not 1 <= a.layers <= 64:
        ap.error("--layers: 1..64")
    if a.full_every != 2 and not a.hybrid:
        ap.error("--full-every goes with --hybrid")
    if a.kv_heads != 2 and not a.hybrid:
        ap.error("--kv-heads goes with --hybrid")
    if not 1 <= a.full_every <= LAYERS:
        ap.error(f"--full-every: 1..{LAYERS}")
    if a.hybrid:
        print(write_hybrid_model(a.dir, seed=a.seed, full_every=a.full_every, kv_heads=a.kv_heads))
        return 0
    if a.sliding:
        print(write_sliding_model(a.dir, seed=a.seed))
        return 0
    if a.mla:
        print(write_mla_model(a.dir, seed=a.seed))
        return 0
    print(write_model(a.dir, layers=a.layers, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
