"""Remote G2 -> local G2 reads over NIXL: kvstrata against a bare NIXL loop and memcpy.

Two OS processes on loopback (UCX): an exporter holding a chain of blocks in the G2 of a
``KvBlockManager`` (``kvstrata.testing.exporter``), and this process, which imports its block set.
Per block size, interleaved (the order rotated each round) and best of ``--repeats``; the
``pairs`` column is the median over rounds of the bare read's time over ours in the same
round, steadier than best-of when the machine's load changes:

* **kvstrata** -- ``RemotePeer.lease`` (a control round trip: the exporter pins the blocks and
  names their slots and checksums), ``RemotePeer.read`` (NIXL read of every block, each
  verified against its checksum, slots sealed) and ``release``: what a reader really pays;
* **kvstrata unverified** -- the same with ``verify=False`` (no hash pass over the bytes;
  the lease still guarantees they are not rewritten);
* **bare NIXL** -- the same two processes, the same remote addresses into the same local
  buffer: ``initialize_xfer`` + ``transfer`` + polling until DONE, nothing else;
* **memcpy** -- the same bytes copied within one process (the ceiling on this machine).

Goals (issue 11): kvstrata >= 80 % of bare NIXL at 2 MiB blocks, >= 50 % at 64 KiB.
Usage: ``python bench/bench_nixl.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("UCX_MODULES", "^ib")
# the exporter serves only peers holding the deployment's secret: one for this run (its
# exporter process inherits it) unless the environment names one
os.environ.setdefault("KVSTRATA_SHARING_SECRET", __import__("secrets").token_hex(32))

import numpy as np  # noqa: E402

from _common import result_line  # noqa: E402

# block size -> (layers, kv_heads, head_dim) with 16-token pages, bf16
GEOMETRIES = {2 << 20: (16, 8, 256), 64 << 10: (4, 2, 128)}
GOALS = {2 << 20: 0.80, 64 << 10: 0.50}


def bare_read(agent, peer: str, local, remote) -> None:
    """The baseline: one NIXL READ of the same ranges, polled to completion."""
    ldescs = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
    rdescs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
    handle = agent.initialize_xfer("READ", ldescs, rdescs, peer)
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError("bare NIXL read failed")


def run(block_bytes: int, blocks: int, repeats: int) -> dict:
    from kvstrata.physical.storage.host import HostStorage
    from kvstrata.protocol.layout import LayoutConfig
    from kvstrata.protocol.layout_codec import SharedLayout
    from kvstrata.remote.blockset import byte_ranges
    from kvstrata.remote.importer import BlockSetImporter
    from kvstrata.testing.exporter import start_exporter

    layers, heads, dim = GEOMETRIES[block_bytes]
    ex = start_exporter(chains=1, chain_blocks=blocks, g2_blocks=blocks,
                        geometry=dict(layers=layers, kv_heads=heads, head_dim=dim))
    assert ex.block_bytes == block_bytes, (ex.block_bytes, block_bytes)
    local = HostStorage(LayoutConfig(num_blocks=blocks, num_layers=layers, outer_dim=2,
                                     page_size=16, inner_dim=heads * dim, dtype="bfloat16",
                                     alignment=4096))
    importer = BlockSetImporter(local)
    try:
        peer = importer.connect(ex.control)
        chain = ex.chains[0]
        slots = list(range(blocks))
        lease = peer.lease(chain, ttl=60)
        remote = peer.blockset.block_ranges([b[1] for b in lease.blocks])
        peer.release(lease)
        mine = byte_ranges(SharedLayout(local.layout, local.descriptors()), slots)
        raw_agent = importer._agent._agent
        nbytes = blocks * block_bytes

        def ours() -> None:
            lease = peer.lease(chain, ttl=60)
            peer.read(lease, slots)
            peer.release(lease)

        def trusting() -> None:
            lease = peer.lease(chain, ttl=60)
            peer.read(lease, slots, verify=False)
            peer.release(lease)

        def bare() -> None:
            bare_read(raw_agent, peer.blockset.name, mine, remote)

        src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)

        def memcpy() -> None:
            np.copyto(dst, src)

        runs = (("ours", ours), ("trusting", trusting), ("bare", bare), ("memcpy", memcpy))
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _, fn in runs:                              # warm-up
            fn()
        for repeat in range(repeats):
            # rotated each round, so each kind follows every other one equally often (the
            # memcpy evicts the caches and the TLB: a fixed order would favour whichever kind
            # runs right after the one that touched the same buffers)
            shift = repeat % len(runs)
            for name, fn in runs[shift:] + runs[:shift]:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        gbps = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
        # the same round's bare read over ours, per round: steadier than best-of on a
        # machine whose load changes between rounds
        gbps["pair_median"] = statistics.median(b / o for o, b in zip(times["ours"],
                                                                       times["bare"]))
        return gbps
    finally:
        importer.close()
        ex.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    print(f"{'block':>8} {'kvstrata':>12} {'unverified':>12} {'bare NIXL':>12} {'memcpy':>10} "
          f"{'ratio':>6} {'pairs':>6} {'unverif.':>9}  goal (verified)")
    for block_bytes, goal in GOALS.items():
        blocks = (32 if args.quick else 64) if block_bytes >= 1 << 20 else \
            (256 if args.quick else 1024)
        gbps = run(block_bytes, blocks, repeats)
        ratio = gbps["ours"] / gbps["bare"]
        print(f"{block_bytes >> 10:>6}Ki {gbps['ours']:>7.2f} GB/s {gbps['trusting']:>7.2f} GB/s "
              f"{gbps['bare']:>7.2f} GB/s {gbps['memcpy']:>5.1f} GB/s {ratio:>6.2f} "
              f"{gbps['pair_median']:>6.2f} "
              f"{gbps['trusting'] / gbps['bare']:>9.2f}  >= {goal:.2f}: "
              f"{'met' if ratio >= goal else 'NOT met'} ({blocks} blocks per read)")
        print(result_line(f"nixl_remote_read_{block_bytes >> 10}k", gbps["ours"] * 1e3,
                          gbps["bare"] * 1e3, "MB/s", f">={goal}"))


if __name__ == "__main__":
    main()
