"""Write a synthetic Mooncake-format trace, to check policies on workloads other than the shipped one.

Requests mix four kinds, drawn by a seeded random generator from a :class:`Workload`:

* multi-turn conversations: a Zipf-popular shared system prompt, then turns that each add a
  few blocks (the previous turn's prompt becomes the next turn's prefix), arriving after a
  random think time;
* agent loops: like conversations, with short think times and many turns;
* one-off documents: long prompts that share at most the system prompt (a scan);
* questions about shared documents (retrieval): a document drawn from a Zipf-popular library,
  then a question; other sessions ask about the same documents.

Each request carries its session's ``kind`` (``conversation``, ``agent``, ``document``,
``question``) and ``shared_prefix``, how many of its first blocks other sessions share (a
system prompt, a library document): fields trace readers ignore, which
``bench/policy_table.py`` uses for a reference. ``partial_tail`` makes each request's last
block its own, as in real traces where a prompt ends inside a block, so the next turn's
block at that position differs. :data:`PROFILES` names workloads with different
statistics; ``bench/policy_table.py`` reports every one of them.

Block ids follow the Mooncake convention: one id per 512-token block, equal ids mean equal
prefixes. Example: ``python bench/synth_trace.py --profile rag --seed 3 > rag.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Workload:
    """The statistics of a synthetic trace (rates per second, lengths in 512-token blocks)."""

    arrivals: float = 3.0          # new sessions per second
    prompts: int = 60              # distinct system prompts
    prompt_skew: float = 1.1       # Zipf exponent of system-prompt popularity
    doc_share: float = 0.15        # sessions that are one long one-off document
    doc_blocks: tuple[int, int] = (10, 60)
    agent_share: float = 0.15      # sessions that are agent loops
    agent_turns: tuple[int, int] = (21, 60)
    agent_think: float = 5.0       # mean seconds between an agent's turns
    rag_share: float = 0.0         # sessions that ask about a shared document
    library: int = 2000            # shared documents
    library_skew: float = 1.0      # Zipf exponent of document popularity
    chat_turns: float = 3.0        # a conversation has 1 + int(Exp(mean chat_turns)) turns
    chat_think: float = 90.0       # mean seconds between a conversation's turns
    first_blocks: tuple[int, int] = (1, 6)
    turn_blocks: tuple[int, int] = (1, 4)
    partial_tail: bool = False     # a request's last block is its own


PROFILES: dict[str, Workload] = {
    "mixed": Workload(),
    "docs": Workload(doc_share=0.4, agent_share=0.05),
    "chat": Workload(doc_share=0.05, agent_share=0.0, chat_turns=1.0, chat_think=150.0,
                     first_blocks=(2, 30), turn_blocks=(1, 6), partial_tail=True),
    "agents": Workload(doc_share=0.05, agent_share=0.5, agent_think=20.0, agent_turns=(5, 40),
                       partial_tail=True, arrivals=1.0),
    "rag": Workload(doc_share=0.1, agent_share=0.0, rag_share=0.6, chat_turns=0.5,
                    doc_blocks=(20, 120), partial_tail=True, arrivals=2.0),
    "scan": Workload(doc_share=0.35, doc_blocks=(60, 200), agent_share=0.05, prompt_skew=1.4,
                     chat_think=60.0, partial_tail=True),
}
"""Named workloads with different reuse statistics (docs/policies.md reports each)."""


def generate(requests: int, seed: int, workload: Workload = Workload()) -> list[dict]:
    """``requests`` requests of ``workload``, in arrival order, reproducible from ``seed``."""
    w = workload
    rng = random.Random(seed)
    ids: dict[tuple, int] = {}

    def block_id(prefix_key: tuple) -> int:
        return ids.setdefault(prefix_key, len(ids))

    prompt_weights = [1.0 / (k + 1) ** w.prompt_skew for k in range(w.prompts)]
    prompt_len = [rng.randint(1, 4) for _ in range(w.prompts)]
    doc_weights = [1.0 / (k + 1) ** w.library_skew for k in range(w.library)]
    doc_len = [rng.randint(*w.doc_blocks) for _ in range(w.library)]
    pending: list[tuple[float, int, list[tuple], int, float, str]] = []  # time, session, chain, turns left, think, kind
    out: list[dict] = []
    now, session = 0.0, 0
    while len(out) < requests:
        now += rng.expovariate(w.arrivals)
        due = [p for p in pending if p[0] <= now]
        pending = [p for p in pending if p[0] > now]
        for _, conv, chain, turns_left, think, kind in due:
            chain = chain + [(conv, len(chain), rng.random()) for _ in range(rng.randint(*w.turn_blocks))]
            out.append(_request(now, chain, block_id, rng, w.partial_tail, kind))
            if turns_left > 1:
                pending.append((now + rng.expovariate(1 / think), conv, chain, turns_left - 1, think,
                                kind))
        session += 1
        system = rng.choices(range(w.prompts), weights=prompt_weights)[0]
        chain = [("sys", system, i) for i in range(prompt_len[system])]
        kind = rng.random()
        if kind < w.doc_share:
            chain += [(session, i, "doc") for i in range(rng.randint(*w.doc_blocks))]
            out.append(_request(now, chain, block_id, rng, w.partial_tail, "document"))
            continue
        kind -= w.doc_share
        if kind < w.rag_share:
            doc = rng.choices(range(w.library), weights=doc_weights)[0]
            chain += [("lib", doc, i) for i in range(doc_len[doc])]
        chain += [(session, i, "q") for i in range(rng.randint(*w.first_blocks))]
        agent = w.rag_share <= kind < w.rag_share + w.agent_share
        label = "agent" if agent else "question" if kind < w.rag_share else "conversation"
        out.append(_request(now, chain, block_id, rng, w.partial_tail, label))
        if agent:
            turns, think = rng.randint(*w.agent_turns), w.agent_think
        else:
            turns, think = 1 + int(rng.expovariate(1 / w.chat_turns)), w.chat_think
        if turns > 1:
            pending.append((now + rng.expovariate(1 / think), session, chain, turns - 1, think,
                            label))
    return out[:requests]


def _request(now: float, chain: list[tuple], block_id, rng: random.Random,
             partial_tail: bool, kind: str) -> dict:
    hash_ids, key = [], ()
    for part in chain:
        key = key + (part,)
        hash_ids.append(block_id(key))
    if partial_tail:      # the prompt ends inside its own last block
        hash_ids.append(block_id(key + (("tail", now, rng.random()),)))
    return {
        "timestamp": int(now * 1000),
        "input_length": 512 * (len(hash_ids) - 1) + rng.randint(1, 512),
        "output_length": rng.randint(10, 800),
        "hash_ids": hash_ids,
        "kind": kind,
        "shared_prefix": sum(1 for part in chain if part[0] in ("sys", "lib")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=12_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="mixed")
    numbers = {"float": float, "int": int}
    for f in fields(Workload):
        if f.type in numbers:
            parser.add_argument("--" + f.name.replace("_", "-"), type=numbers[f.type], default=None,
                                help=f"override the profile's {f.name}")
    args = parser.parse_args()
    overrides = {f.name: getattr(args, f.name) for f in fields(Workload)
                 if getattr(args, f.name, None) is not None}
    workload = replace(PROFILES[args.profile], **overrides)
    for req in generate(args.requests, args.seed, workload):
        sys.stdout.write(json.dumps(req) + "\n")


if __name__ == "__main__":
    main()
