"""Block hashing throughput: kvstrata's xxh3 chain vs vLLM's default sha256-over-pickle.

The baseline hashes ``pickle.dumps((parent_hash, tuple(block_tokens)))`` with sha256 for each
block, which is what vLLM's default prefix-cache hash does; both sides start from the same
Python list of token ids. Prints blocks/s for each and the ratio (goal >= 4x).
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random

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
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_tokens = args.tokens // 8 if args.quick else args.tokens
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(n_tokens)]
    blocks = n_tokens // args.block_size
    repeats = 3 if args.quick else 5

    t_ours = best_of(repeats, lambda: hash_blocks(tokens, args.block_size))
    t_base = best_of(repeats, lambda: baseline_sha256_pickle(tokens, args.block_size))

    def incremental():
        seq = TokenSequence(block_size=args.block_size)
        for t in tokens:
            seq.append(t)

    t_incr = best_of(max(1, repeats - 2), incremental)
    print(f"block size {args.block_size}, {blocks:,} blocks from {n_tokens:,} tokens (best of {repeats})")
    print(f"  kvstrata hash_blocks (xxh3 chain)   {blocks / t_ours:>12,.0f} blocks/s")
    print(f"  kvstrata TokenSequence.append       {blocks / t_incr:>12,.0f} blocks/s "
          f"({n_tokens / t_incr:,.0f} tokens/s, one call per token)")
    print(f"  baseline sha256(pickle((p, toks)))  {blocks / t_base:>12,.0f} blocks/s")
    print(result_line("hashing", blocks / t_ours, blocks / t_base, " blocks/s", ">=4x"))


if __name__ == "__main__":
    main()
