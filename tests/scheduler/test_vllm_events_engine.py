"""A real vLLM engine (CPU build) feeds the router: the router keys prompts exactly as vLLM
hashes blocks, and after the engine serves a prompt, a request sharing its prefix is routed to
that engine's node with the prefix counted as cached.

Needs the vLLM venv that deploy/setup-test-env.sh installs (XDC_VLLM_VENV, default
/opt/xdc-vllm); without it these tests skip and say so, unless XDC_REQUIRE_VLLM=1 (CI)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdc.scheduler.vllm_hash import VllmBlockHash
from xdc.transport.launcher import free_port

from tests.router_rig import RouterRig
from tests.vllm_fixtures import PY, need_vllm, vllm_env
from xdc.lab import vllm_rig

pytestmark = pytest.mark.vllm

BLOCK = 32
_need_vllm = need_vllm


def _env() -> dict[str, str]:
    """vLLM's hash seed must be its default: no PYTHONHASHSEED from the test environment."""
    env = vllm_env(0)
    env.pop("PYTHONHASHSEED", None)
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return env


PARITY = textwrap.dedent(
    """
    import json, sys
    from vllm.utils.hashing import get_hash_fn_by_name
    import vllm.v1.core.kv_cache_utils as u
    tokens, block = json.loads(sys.argv[1]), int(sys.argv[2])
    out = {}
    for algo in ("sha256", "sha256_cbor"):
        fn = get_hash_fn_by_name(algo)
        u.init_none_hash(fn)
        parent, digests = None, []
        for i in range(len(tokens) // block):
            parent = u.hash_block_tokens(fn, parent, tokens[i * block:(i + 1) * block], None)
            digests.append(bytes(parent).hex())
        out[algo] = digests
    print(json.dumps(out))
    """
)


def test_router_keys_equal_vllms_own_block_hashes() -> None:
    _need_vllm()
    tokens = [(i * 7919) % 2048 for i in range(5 * BLOCK + 3)]
    res = subprocess.run(
        [str(PY), "-c", PARITY, json.dumps(tokens), str(BLOCK)],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    for algo in ("sha256", "sha256_cbor"):
        ours = [d.hex() for d in VllmBlockHash(BLOCK, algo).digests(tokens)]
        assert ours == theirs[algo], algo
        assert len(ours) == 5


ENGINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model, pub, replay, block = sys.argv[1:5]
        llm = LLM(
            model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
            block_size=int(block), enable_prefix_caching=True, max_model_len=2048,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=pub,
                replay_endpoint=replay,
            ),
        )
        print("READY", flush=True)
        for line in sys.stdin:
            ids = json.loads(line)
            llm.generate(
                [TokensPrompt(prompt_token_ids=ids)],
                SamplingParams(max_tokens=1, detokenize=False),
                use_tqdm=False,
            )
            print("DONE", flush=True)
    """
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


class Engine:
    """One offline vLLM engine publishing KV events, driven line by line over stdin."""

    def __init__(self, tmp: Path, pub: str, replay_port: int) -> None:
        model = tmp / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(CONFIG))
        self._start(tmp, ENGINE, str(model), pub, replay_port, str(BLOCK))

    def _start(self, tmp: Path, script: str, model: str, pub: str, replay: int, *more: str) -> None:
        """``pub``: an ``ipc://`` path, which vLLM binds and the router connects to (given
        tcp://127.0.0.1:PORT vLLM would connect, and only replays would arrive)."""
        self.log = (tmp / "engine.log").open("w+")
        self.proc = subprocess.Popen(
            [
                str(PY),
                "-c",
                script,
                model,
                pub,
                f"tcp://127.0.0.1:{replay}",
                *more,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=_env(),
        )
        self.ready = self._expect("READY", 240)

    def _expect(self, word: str, timeout: float) -> list[str]:
        """The words after ``word`` on the first line the engine printed that starts with it."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            said = line.split()
            if said[:1] == [word]:
                return said[1:]
        self.log.seek(0)
        raise AssertionError(f"engine did not say {word}:\n{self.log.read()[-4000:]}")

    def serve(self, tokens: list[int]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(tokens) + "\n")
        self.proc.stdin.flush()
        self._expect("DONE", 120)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def _pub_endpoint(tmp: Path) -> str:
    return f"ipc://{tmp}/kv-events.sock"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, str, int]]:
    _need_vllm()
    pub, replay = _pub_endpoint(tmp_path), free_port()
    e = Engine(tmp_path, pub, replay)
    try:
        yield e, pub, replay
    finally:
        e.close()


def test_a_prompt_a_vllm_engine_cached_is_routed_to_its_node(
    engine: tuple[Engine, str, int],
) -> None:
    eng, pub, replay = engine
    shared = [(i * 31 + 5) % 2000 + 1 for i in range(12 * BLOCK)]
    with RouterRig(block_size=BLOCK) as rig:
        node = "pd/pd-2"
        rig.start(f"{node}={pub}|tcp://127.0.0.1:{replay}")
        follow_up = shared + [7] * (4 * BLOCK)
        assert rig.route(follow_up)["cached_tokens"] == 0
        eng.serve([*shared, 9, 9, 9])  # the engine caches the 12 full blocks of the prefix
        rig.wait_for(lambda: rig.route(follow_up)["cached_tokens"] >= 12 * BLOCK, timeout=20)
        d = rig.route(follow_up)
        assert d["target"] == "pd" and d["prefill_node"] == "pd-2", d
        assert d["cached_tokens"] == 12 * BLOCK, d
        st = rig.source_counts(node)
        assert st["events"] >= 1 and st.get("malformed", 0) == 0, st
        # a prompt the engine never saw finds nothing
        assert rig.route([5] * (12 * BLOCK))["cached_tokens"] == 0
    print(f"vLLM events from the engine: {st}", file=sys.stderr)


HYBRID_ENGINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model, pub, replay = sys.argv[1:4]
        llm = LLM(
            model=model, enforce_eager=True, enable_prefix_caching=True, max_model_len=4096,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=pub,
                replay_endpoint=replay,
            ),
        )
        # with the block vLLM settled on for the hybrid model, which depends on the host
        print("READY", llm.llm_engine.vllm_config.cache_config.block_size, flush=True)
        for line in sys.stdin:
            out = llm.generate(
                [TokensPrompt(prompt_token_ids=json.loads(line))],
                SamplingParams(max_tokens=1, detokenize=False),
                use_tqdm=False,
            )[0]
            print("DONE", flush=True)
            print(json.dumps({"cached": out.num_cached_tokens}), flush=True)
    """
)


class HybridEngine(Engine):
    """The seeded Qwen3-Next-shaped hybrid test model (linear attention beside full
    attention) with prefix caching and KV events; ``serve`` answers vLLM's own prefix hit."""

    def __init__(self, tmp: Path, pub: str, replay_port: int) -> None:
        self._start(tmp, HYBRID_ENGINE, str(vllm_rig.hybrid_model()), pub, replay_port)
        self.block = int(self.ready[0])  # tokens per block

    def cached(self, tokens: list[int]) -> int:
        """Serve ``tokens``; the prompt tokens vLLM found in its prefix cache."""
        self.serve(tokens)
        assert self.proc.stdout is not None
        return int(json.loads(self.proc.stdout.readline())["cached"])


def test_the_router_predicts_a_hybrid_engines_own_prefix_hits() -> None:
    """A hybrid engine reuses a cached prefix only up to a block whose state it kept (vLLM keeps
    one at the last full block of each prefill). The router now reads its state group's events
    as such and predicts vLLM's own hits, asked before each prefill: a prompt that shares 700
    of a cached 1,000-token prompt's tokens (some of its attention blocks, not the last full
    one) hits nothing, and the cached prompt again hits all its full blocks. Before, every
    batch with a state store was dropped as malformed (a state's token_ids cover the whole
    prefix it ends, with one key), so the router learned nothing from a hybrid engine: 0
    predicted for both, and no wait here ended. The block is the engine's own (256 tokens on
    the Intel hosts with AMX, 128 on an AMD EPYC: vLLM sizes it to hold the state), and the
    router is given it as an operator would."""
    _need_vllm()
    replay = free_port()
    a = [(i * 31 + 5) % 2000 + 1 for i in range(1000)]
    b = a[:700] + [(i * 17 + 3) % 2000 + 1 for i in range(300)]
    with tempfile.TemporaryDirectory() as tmp:
        pub = _pub_endpoint(Path(tmp))
        eng = HybridEngine(Path(tmp), pub, replay)
        try:
            block = eng.block
            full = 1000 // block * block  # a's full blocks: where its prefill kept a state
            assert 0 < 700 // block * block < full, f"a {block}-token block leaves no test here"
            with RouterRig(block_size=block) as rig:
                rig.start(f"pd/pd-2={pub}|tcp://127.0.0.1:{replay}")
                assert eng.cached(a) == 0
                rig.wait_for(lambda: rig.route(a)["cached_tokens"] > 0, timeout=20)
                # the router's prediction first, then vLLM's own answer (an offline engine
                # publishes a request's last events only at its next step: b's prefill may not
                # be known yet when a is asked about, and a's prediction does not depend on it)
                seen = [(rig.route(p)["cached_tokens"], eng.cached(p)) for p in (b, a)]
                assert seen == [(0, 0), (full, full)], (block, seen)
                print(f"block {block}; router predicted / vLLM hit (b, a): {seen}", file=sys.stderr)
                st = rig.source_counts("pd/pd-2")
                assert st.get("malformed", 0) == 0, st
        finally:
            eng.close()


SLIDING_ENGINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model, pub, replay, block, blocks = sys.argv[1:6]
        llm = LLM(
            model=model, enforce_eager=True, enable_prefix_caching=True, max_model_len=768,
            dtype="float32", block_size=int(block), num_gpu_blocks_override=int(blocks),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=pub,
                replay_endpoint=replay,
            ),
        )
        print("READY", flush=True)
        params = SamplingParams(max_tokens=1, detokenize=False)
        for line in sys.stdin:
            out = llm.generate(
                [TokensPrompt(prompt_token_ids=json.loads(line))], params, use_tqdm=False
            )[0]
            # one more step: an offline engine publishes a request's last events at its next
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
            print("DONE", flush=True)
            print(json.dumps({"cached": out.num_cached_tokens}), flush=True)
    """
)
SLIDING_BLOCK = 32  # what vLLM 0.32's CPU build makes the sliding test model's blocks
SLIDING_POOL = 100  # blocks: later prompts evict earlier ones


class SlidingEngine(HybridEngine):
    """The seeded Gemma-3-shaped test model (three 64-token window layers beside one
    full-attention layer) with a small KV pool, prefix caching and KV events."""

    def __init__(self, tmp: Path, pub: str, replay_port: int) -> None:
        self._start(
            tmp,
            SLIDING_ENGINE,
            str(vllm_rig.sliding_model()),
            pub,
            replay_port,
            str(SLIDING_BLOCK),
            str(SLIDING_POOL),
        )


def _mix(rng: random.Random, n: int, top: int) -> list[list[int]]:
    """``n`` seeded prompts: most share a random-length prefix of one of four long ones, some
    repeat an earlier prompt, the rest are new."""
    bases = [[rng.randrange(1, 2000) for _ in range(top)] for _ in range(4)]
    out: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            base = rng.choice(bases)
            k = rng.randrange(32, top - 40)
            out.append(base[:k] + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 40))])
        elif r < 0.8 and out:
            out.append(rng.choice(out))
        else:
            out.append([rng.randrange(1, 2000) for _ in range(rng.randrange(40, top))])
    return out


def _settled(rig: RouterRig, node: str, quiet_s: float = 1.0, timeout: float = 20.0) -> None:
    """Until the router has applied every batch the engine published (none new for
    ``quiet_s``; the engine publishes a step's events as the step ends)."""
    deadline = time.monotonic() + timeout
    last, since = rig.source_counts(node).get("last_seq"), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, rig.source_counts(node)
        time.sleep(0.1)
        seq = rig.source_counts(node).get("last_seq")
        if seq != last:
            last, since = seq, time.monotonic()


def test_the_router_predicts_a_sliding_window_engines_own_prefix_hits() -> None:
    """vLLM 0.32 caches a window layer's blocks only where its window still reads them (the
    end of each prefill, and the window before a prefix other requests share), and a small
    pool evicts them beside the full-attention blocks: vLLM resumes a prefix only where the
    window layers hold its last window. The router reads the window groups' events and
    predicts vLLM's own hit, asked before each prefill, for every prompt of a sequence that
    evicts: six made for the cases below, then a seeded mix of 24 (shared prefixes of random
    length, repeats, new prompts).

    Before: every batch with a window store was dropped as malformed (a window store carries
    the tokens of every block the step cached, with keys for the window's alone), and had it
    been read, the 9 full-attention blocks the second prompt shares with the first would have
    been promised where vLLM reuses none (seen[1]); a block cached twice (a request computed
    it again) lost its key with its first copy."""
    _need_vllm()
    replay = free_port()

    def p(n: int, seed: int) -> list[int]:
        return [((i + 1) * 2654435761 + seed * 97) % 2000 + 1 for i in range(n)]

    a = p(600, 1)
    prompts = [a, [*a[:300], *p(100, 7)], p(700, 3), [*a[:300], *p(100, 8)], a, [*a[:450], 9]]
    prompts += _mix(random.Random(54), 24, top=700)
    node = "pd/pd-2"
    with tempfile.TemporaryDirectory() as tmp, RouterRig(block_size=SLIDING_BLOCK) as rig:
        # events arrive live: ``_settled`` sees each prompt's as its step ends
        pub = _pub_endpoint(Path(tmp))
        eng = SlidingEngine(Path(tmp), pub, replay)
        try:
            rig.start(f"{node}={pub}|tcp://127.0.0.1:{replay}")
            seen = []
            for ids in prompts:
                _settled(rig, node)
                seen.append((rig.route(ids)["cached_tokens"], eng.cached(ids)))
            print(f"router predicted / vLLM hit: {seen}", file=sys.stderr)
            assert [want for want, _ in seen] == [got for _, got in seen], seen
            assert any(got > 0 for _, got in seen[6:]), seen  # the mix hits too (2 of 24)
            # the case the window decides: the second prompt's 9 shared blocks are cached in
            # the full-attention group, and vLLM reuses none of them
            assert seen[1] == (0, 0), seen
            assert any(got > 0 for _, got in seen), seen  # and some prefix is reused
            st = rig.source_counts(node)
            assert st.get("malformed", 0) == 0 and st["dropped"] == {}, st
            assert st["held_window_blocks"] > 0, st
        finally:
            eng.close()
