"""Block hashing throughput: kvstrata's xxh3 chain vs vLLM's default sha256-over-pickle.

The baseline hashes ``pickle.dumps((parent_hash, tuple(block_tokens)))`` with sha256 for each
block, which is what vLLM's default prefix-cache hash does; both sides start from the same
Python lists of token ids: ``--prompts`` prompts of ``--prompt-tokens`` tokens each (an engine
hashes one prompt at a time; 8K tokens is about the Mooncake trace's mean prompt). Prints
blocks/s for each and the ratio (goal >= 4x); also ours from numpy arrays, and the one-token-
at-a-time path an engine uses while decoding.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random

import numpy as np
from _common import best_of, result_line

from kvstrata.tokens import TokenSequence, hash_blocks


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
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_prompts = max(1, args.prompts // 8) if args.quick else args.prompts
    rng = random.Random(0)
    prompts = [[rng.randrange(128_000) for _ in range(args.prompt_tokens)] for _ in range(n_prompts)]
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    blocks = n_prompts * (args.prompt_tokens // args.block_size)
    repeats = 3 if args.quick else 7
    bs = args.block_size

    # Interleave ours and the baseline so machine noise hits both alike.
    t_ours = t_base = t_np = float("inf")
    for _ in range(repeats):
        t_ours = min(t_ours, best_of(1, lambda: [hash_blocks(p, bs) for p in prompts]))
        t_base = min(t_base, best_of(1, lambda: [baseline_sha256_pickle(p, bs) for p in prompts]))
        t_np = min(t_np, best_of(1, lambda: [hash_blocks(a, bs) for a in arrays]))

    def incremental():
        for p in prompts[: max(1, n_prompts // 8)]:
            seq = TokenSequence(block_size=bs)
            for t in p:
                seq.append(t)

    incr_tokens = max(1, n_prompts // 8) * args.prompt_tokens
    t_incr = best_of(max(1, repeats - 4), incremental)
    print(f"block size {bs}: {n_prompts} prompts x {args.prompt_tokens:,} tokens = {blocks:,} blocks "
          f"(best of {repeats}, interleaved)")
    print(f"  kvstrata hash_blocks, list input     {blocks / t_ours:>12,.0f} blocks/s")
    print(f"  kvstrata hash_blocks, numpy input    {blocks / t_np:>12,.0f} blocks/s")
    print(f"  kvstrata TokenSequence.append        {incr_tokens / bs / t_incr:>12,.0f} blocks/s "
          f"({incr_tokens / t_incr:,.0f} tokens/s, one call per token)")
    print(f"  baseline sha256(pickle((p, toks)))   {blocks / t_base:>12,.0f} blocks/s")
    print(result_line("hashing", blocks / t_ours, blocks / t_base, " blocks/s", ">=4x"))


if __name__ == "__main__":
    main()
