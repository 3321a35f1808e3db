"""A small seeded random Llama checkpoint, written locally (no model hub): the test and demo
model for the vLLM integration.

Random weights with ``initializer_range`` 0.05 make the output depend on the context: wrong KV
(zeroed, shifted, another request's) changes the generated tokens, so token equality with a
plain run is a real check of the moved bytes. 4 layers, hidden 256, 4 heads / 2 KV heads,
head_dim 64, vocab 2048: ~7 MB, written in a second. Prompts are token ids (no tokenizer):
engines run with ``skip_tokenizer_init=True``.

    python -m xdc.integrations.vllm.testmodel DIR      (or: xdc vllm make-model DIR)

Runs where vLLM is installed (it needs torch and transformers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LAYERS = 4
VOCAB = 2048


def write_model(out: Path, *, layers: int = LAYERS, seed: int = 0) -> Path:
    """Write the checkpoint into ``out`` (created); idempotent for the same arguments."""
    marker = out / "xdc-testmodel.json"
    want = {"layers": layers, "seed": seed, "version": 1}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.05,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(want))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="directory to write the checkpoint into")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 1 <= a.layers <= 64:
        ap.error("--layers: 1..64")
    print(write_model(a.dir, layers=a.layers, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
