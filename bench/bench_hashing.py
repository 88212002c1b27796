"""Block hashing throughput: kvstrata's xxh3 chain vs Dynamo's router (Rust) and vLLM's default.

Both sides start from the same Python lists of token ids: ``--prompts`` prompts of
``--prompt-tokens`` tokens each (an engine hashes one prompt at a time; 8K tokens is about the
Mooncake trace's mean prompt), made from one seeded generator.

* The peer: Dynamo's own code, ``dynamo._core.compute_block_hash_for_seq(tokens,
  block_size)`` from ai-dynamo-runtime (Rust, PyO3), which returns the *local* block hashes
  only. It runs in its own process from ``.venv-peers`` (``scripts/setup_peers.sh``; another
  interpreter with ``$KVSTRATA_PEERS_PYTHON``), timing itself the same way; it is skipped with
  a message when absent. Its hashes are checked equal to ours (the scheme is Dynamo's).
* kvstrata's ``hash_blocks`` returns local *and* sequence (chained) hashes, with the native
  path (``_tokenhash``, when built) and with the pure-Python one.
* Also: vLLM's default prefix-cache hash, sha256 of ``pickle((parent, tokens))``, and ours
  from numpy arrays and one token at a time.

Rounds alternate between the peer's process and ours (noise hits both alike); the best round
counts. Goals: >= 1x Dynamo's local-only hashing while producing both hashes; >= 4x sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import best_of, result_line

import kvstrata.tokens as tokens_module
from kvstrata.tokens import TokenSequence, hash_blocks

ROOT = Path(__file__).resolve().parent.parent

# Runs in the peers' interpreter: the same prompts, timed there, best of `repeats`.
PEER_SCRIPT = r"""
import json, random, sys, time
from dynamo._core import compute_block_hash_for_seq as f
bs, n_tokens, n_prompts, repeats = map(int, sys.argv[1:5])
rng = random.Random(0)
prompts = [[rng.randrange(128_000) for _ in range(n_tokens)] for _ in range(n_prompts)]
first = f(prompts[0], bs)
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter()
    for p in prompts:
        f(p, bs)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best, "first": first}))
"""


def peers_python() -> Path | None:
    env = os.environ.get("KVSTRATA_PEERS_PYTHON")
    path = Path(env) if env else ROOT / ".venv-peers" / "bin" / "python"
    return path if path.exists() else None


def run_peer(python: Path, bs: int, n_tokens: int, n_prompts: int, repeats: int) -> dict:
    out = subprocess.run([str(python), "-c", PEER_SCRIPT, str(bs), str(n_tokens), str(n_prompts),
                          str(repeats)], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_sha256_pickle(tokens: list[int], block_size: int) -> list[bytes]:
    out, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[start : start + block_size])))).digest()
        out.append(parent)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="alternating peer/ours rounds")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_prompts = max(1, args.prompts // 8) if args.quick else args.prompts
    rounds = 2 if args.quick else args.rounds
    bs = args.block_size
    rng = random.Random(0)   # the peer script draws the same prompts from the same seed
    prompts = [[rng.randrange(128_000) for _ in range(args.prompt_tokens)] for _ in range(n_prompts)]
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    blocks = n_prompts * (args.prompt_tokens // bs)

    peer = peers_python()
    if peer is None:
        print(f"Dynamo peer skipped: no {ROOT / '.venv-peers'} (run scripts/setup_peers.sh, "
              "or set KVSTRATA_PEERS_PYTHON)")
    native = tokens_module.NATIVE
    if not native:
        print("native hashing extension not built (pip install -e .): Python path only")

    def ours(use_native: bool) -> float:
        previous = tokens_module.use_native(use_native)
        try:
            return best_of(3, lambda: [hash_blocks(p, bs) for p in prompts])
        finally:
            tokens_module.use_native(previous)

    t_peer = t_nat = t_py = t_np = t_base = float("inf")
    for _ in range(rounds):
        if peer is not None:
            got = run_peer(peer, bs, args.prompt_tokens, n_prompts, 3)
            t_peer = min(t_peer, got["seconds"])
            assert got["first"] == hash_blocks(prompts[0], bs)[0], "Dynamo's local hashes differ"
        if native:
            t_nat = min(t_nat, ours(True))
        t_py = min(t_py, ours(False))
        t_np = min(t_np, best_of(3, lambda: [hash_blocks(a, bs) for a in arrays]))
        t_base = min(t_base, best_of(1, lambda: [baseline_sha256_pickle(p, bs) for p in prompts]))

    def incremental():
        for p in prompts[: max(1, n_prompts // 8)]:
            seq = TokenSequence(block_size=bs)
            for t in p:
                seq.append(t)

    incr_tokens = max(1, n_prompts // 8) * args.prompt_tokens
    t_incr = best_of(2, incremental)
    t_ours = t_nat if native else t_py
    print(f"block size {bs}: {n_prompts} prompts x {args.prompt_tokens:,} tokens = {blocks:,} blocks "
          f"(best of {rounds} alternating rounds)")
    if native:
        print(f"  kvstrata hash_blocks, list, native   {blocks / t_nat:>12,.0f} blocks/s (local + sequence)")
    print(f"  kvstrata hash_blocks, list, Python   {blocks / t_py:>12,.0f} blocks/s (local + sequence)")
    print(f"  kvstrata hash_blocks, numpy input    {blocks / t_np:>12,.0f} blocks/s")
    print(f"  kvstrata TokenSequence.append        {incr_tokens / bs / t_incr:>12,.0f} blocks/s "
          f"({incr_tokens / t_incr:,.0f} tokens/s, one call per token)")
    if peer is not None:
        print(f"  Dynamo compute_block_hash_for_seq    {blocks / t_peer:>12,.0f} blocks/s (local only; Rust)")
    print(f"  vLLM default sha256(pickle((p, t)))  {blocks / t_base:>12,.0f} blocks/s")
    if peer is not None:
        print(result_line("hashing_vs_dynamo", blocks / t_ours, blocks / t_peer, " blocks/s", ">=1x"))
        if native:
            print(result_line("hashing_python_path_vs_dynamo", blocks / t_py, blocks / t_peer,
                              " blocks/s"))
    print(result_line("hashing_vs_sha256", blocks / t_ours, blocks / t_base, " blocks/s", ">=4x"))


if __name__ == "__main__":
    sys.exit(main())
