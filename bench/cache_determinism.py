"""Does a plain vLLM engine decode a prompt the same after a full prefill and after a
prefix-cache hit? The control behind issue 26's differential test, per dtype.

    python bench/cache_determinism.py bfloat16 float32

Prompts: ``random.seed(7)`` and ``randrange(300, 2000)`` ids, 200, 3,000 and 4,000 long (the
issue's), each decoded greedily (12 tokens) cold, then again from the prefix cache.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xdc.lab.vllm_rig import Engine


def main() -> int:
    dtypes = sys.argv[1:] or ["bfloat16", "float32"]
    if any(d not in ("bfloat16", "float32") for d in dtypes):
        print("dtypes: bfloat16 float32", file=sys.stderr)
        return 2
    rng = random.Random(7)
    prompts = [[rng.randrange(300, 2000) for _ in range(n)] for n in (200, 3000, 4000)]
    for dtype in dtypes:
        t0 = time.monotonic()
        e = Engine("plain", core=0, dtype=dtype, prefix_caching=True)
        try:
            cold = [e.generate([p], None, 12)[0]["token_ids"] for p in prompts]
            cached = [e.generate([p], None, 12)[0]["token_ids"] for p in prompts]
        finally:
            e.close()
        same = [a == b for a, b in zip(cold, cached, strict=True)]
        print(
            f"{dtype}: cold == cached for {sum(same)}/{len(same)} prompts {same} "
            f"({time.monotonic() - t0:.0f} s)"
        )
        for p, a, b in zip(prompts, cold, cached, strict=True):
            if a != b:
                print(f"  {len(p)} tokens: cold {a}\n  {' ' * len(str(len(p)))}  cached {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
