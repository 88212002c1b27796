"""Write a synthetic Mooncake-format trace, to check policies on workloads other than the shipped one.

Requests mix three kinds, with a seeded random generator:

* multi-turn conversations: a Zipf-popular shared system prompt, then turns that each add a
  few blocks (the previous turn's prompt and answer become the next turn's prefix), arriving
  after a random think time;
* agent loops: like conversations, with short think times and many turns;
* one-off documents: long prompts that share at most the system prompt.

Block ids follow the Mooncake convention: one id per 512-token block, equal ids mean equal
prefixes. Example: ``python bench/synth_trace.py --requests 12000 --seed 1 > synth.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys


def generate(requests: int, seed: int, prompts: int = 60, doc_share: float = 0.15,
             agent_share: float = 0.15) -> list[dict]:
    rng = random.Random(seed)
    ids: dict[tuple, int] = {}

    def block_id(prefix_key: tuple) -> int:
        return ids.setdefault(prefix_key, len(ids))

    zipf_weights = [1.0 / (k + 1) ** 1.1 for k in range(prompts)]
    prompt_len = [rng.randint(1, 4) for _ in range(prompts)]
    pending: list[tuple[float, int, list[tuple], int]] = []  # (time, conv, chain keys, turns left)
    out: list[dict] = []
    now, conv_counter = 0.0, 0
    while len(out) < requests:
        now += rng.expovariate(3.0)  # ~3 new arrivals per second
        due = [p for p in pending if p[0] <= now]
        pending = [p for p in pending if p[0] > now]
        for _, conv, chain, turns_left in due:
            chain = chain + [(conv, len(chain), rng.random()) for _ in range(rng.randint(1, 4))]
            out.append(_request(now, chain, block_id, rng))
            if turns_left > 1:
                agent = turns_left > 20
                think = rng.expovariate(1 / 5.0) if agent else rng.expovariate(1 / 90.0)
                pending.append((now + think, conv, chain, turns_left - 1))
        conv_counter += 1
        system = rng.choices(range(prompts), weights=zipf_weights)[0]
        chain = [("sys", system, i) for i in range(prompt_len[system])]
        kind = rng.random()
        if kind < doc_share:
            chain += [(conv_counter, i, "doc") for i in range(rng.randint(10, 60))]
            out.append(_request(now, chain, block_id, rng))
            continue
        chain += [(conv_counter, i, "q") for i in range(rng.randint(1, 6))]
        out.append(_request(now, chain, block_id, rng))
        turns = rng.randint(21, 60) if kind < doc_share + agent_share else 1 + int(rng.expovariate(1 / 3.0))
        if turns > 1:
            pending.append((now + rng.expovariate(1 / 60.0), conv_counter, chain, turns - 1))
    return out[:requests]


def _request(now: float, chain: list[tuple], block_id, rng: random.Random) -> dict:
    hash_ids, key = [], ()
    for part in chain:
        key = key + (part,)
        hash_ids.append(block_id(key))
    return {
        "timestamp": int(now * 1000),
        "input_length": 512 * (len(hash_ids) - 1) + rng.randint(1, 512),
        "output_length": rng.randint(10, 800),
        "hash_ids": hash_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=12_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--doc-share", type=float, default=0.15)
    parser.add_argument("--agent-share", type=float, default=0.15)
    args = parser.parse_args()
    for req in generate(args.requests, args.seed, doc_share=args.doc_share, agent_share=args.agent_share):
        sys.stdout.write(json.dumps(req) + "\n")


if __name__ == "__main__":
    main()
