"""Human-readable output of a replay: the terminal table and the hit-rate plot."""

from __future__ import annotations

import io

from typing import TYPE_CHECKING

from .paths import write_atomically
from .tiers import is_onboard, split_path

if TYPE_CHECKING:
    from .replay import ReplayResult


def format_table(doc: dict) -> str:
    """The replay report (``ReplayResult.as_dict()``) as a plain-text table."""
    lines = [
        f"trace        {doc['trace']}",
        f"requests     {doc['requests']:,}   granularity {doc['granularity']}"
        f"   block size {doc['block_size']} tokens",
        "",
        f"{'tier':<5}{'capacity':>10}{'eviction':>10}{'admission':>17}{'looked up':>12}"
        f"{'hit':>10}{'hit %':>8}{'tokens hit %':>14}{'evictions':>11}",
    ]
    for name, t in doc["tiers"].items():
        lines.append(
            f"{name:<5}{t['capacity']:>10,}{t['eviction']:>10}{t['admission']:>17}"
            f"{t['blocks_looked_up']:>12,}{t['blocks_hit']:>10,}{100 * t['hit_rate']:>7.2f}%"
            f"{100 * t['token_hit_rate']:>13.2f}%{t['evictions']:>11,}"
        )
    lines.append(
        f"{'all':<5}{'':>10}{'':>10}{'':>17}{doc['blocks']:>12,}{doc['blocks_hit']:>10,}"
        f"{100 * doc['hit_rate']:>7.2f}%{100 * doc['token_hit_rate']:>13.2f}%"
    )
    lines.append("")
    moves = ", ".join(f"{k} {v:,}" for k, v in doc["moves"].items()) or "none"
    lines.append(f"promotions   {doc['promotions']:,}   demotions {doc['demotions']:,}   ({moves})")
    ops = f"   {doc['block_ops_per_s']:,} block-ops/s" if "block_ops_per_s" in doc else ""
    lines.append(
        f"wall time    {doc['wall_seconds']:.2f} s   {doc['block_accesses_per_s']:,} block accesses/s{ops}"
    )
    return "\n".join(lines)


def format_data_table(doc: dict) -> str:
    """The ``replay --data`` report: the tier table, then bytes and bandwidth per path."""
    head = dict(doc)
    head.setdefault("moves", {p: v["blocks"] for p, v in doc.get("paths", {}).items()})
    onboard = sum(v for p, v in head["moves"].items() if is_onboard(*split_path(p)))
    head.setdefault("promotions", onboard)
    head.setdefault("demotions", sum(head["moves"].values()) - onboard)
    head.setdefault("block_accesses_per_s",
                    round(doc["blocks"] / doc["wall_seconds"]) if doc.get("wall_seconds") else 0)
    lines = [format_table(head), ""]
    g1 = "G1 is a CPU stand-in (no GPU)" if doc.get("stand_in") else "G1 on the device"
    lines.append(f"real bytes   {doc['block_bytes']:,} bytes per block; {g1}; "
                 f"G3 O_DIRECT {'on' if doc.get('o_direct') else 'off'}")
    lines.append(f"{'path':<8}{'plans':>8}{'blocks':>10}{'bytes':>16}{'GB/s':>8}{'failed':>8}")
    for path, p in doc.get("paths", {}).items():
        lines.append(f"{path:<8}{p['plans']:>8,}{p['blocks']:>10,}{p['bytes']:>16,}"
                     f"{p['gb_per_s']:>8.2f}{p['failed_blocks']:>8,}")
    lines.append(
        f"moved {doc['bytes_moved']:,} bytes; verified {doc['verified_blocks']:,} blocks, "
        f"{doc['mismatches']} wrong, {doc['checksum_failures']} checksum failures"
    )
    cost = doc.get("cost_model")
    if cost:
        load = ", ".join(f"{t} {n:,}" for t, n in sorted(cost["would_load"].items())) or "none"
        skip = ", ".join(f"{t} {n:,}" for t, n in sorted(cost["would_recompute"].items())) \
            or "none"
        lines.append(f"cost model   at {cost['prefill_tokens_per_s']:,.0f} prefill tokens/s: "
                     f"load {load}; recompute though held {skip}; estimated "
                     f"{cost['estimated_seconds_saved']:,.2f} s saved against recomputing")
    return "\n".join(lines)


def write_plot(result: "ReplayResult", path: str) -> None:
    """Cumulative hit rate (all tiers and each tier) along the trace, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [n for n, _ in result.curve]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    series = ["total", *result.tiers]
    for name in series:
        ys = [100 * rates.get(name, 0.0) for _, rates in result.curve]
        label = "prefix hit (all tiers)" if name == "total" else f"{name} hit rate (of its look-ups)"
        ax.plot(xs, ys, label=label, linewidth=2 if name == "total" else 1)
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("cumulative hit rate, % of blocks")
    ax.set_title(f"kvstrata replay: {result.granularity} granularity, block {result.block_size}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def sharing_gain(shared: dict, isolated: dict) -> dict:
    """What the shared tier buys: hit rates of the fleet with and without sharing, and the
    blocks not recomputed thanks to it."""
    return {"hit_rate_shared": shared["hit_rate"], "hit_rate_isolated": isolated["hit_rate"],
            "points": round(100 * (shared["hit_rate"] - isolated["hit_rate"]), 2),
            "ratio": round(shared["hit_rate"] / isolated["hit_rate"], 3)
            if isolated["hit_rate"] else None,
            "blocks_not_recomputed": shared["blocks_hit"] - isolated["blocks_hit"]}


def format_fleet_table(doc: dict) -> str:
    """The ``replay --workers N`` report: per worker, shared and isolated, then the gain."""
    shared, isolated, gain = doc["shared"], doc["isolated"], doc["gain"]
    tier = shared["shared_tier"]["tier"]
    lines = [
        f"trace        {shared['trace']}",
        f"requests     {shared['requests']:,}   workers {shared['workers']}   route "
        f"{shared['route']}   granularity {shared['granularity']}   block size "
        f"{shared['block_size']} tokens",
        "",
        f"{'worker':<8}{'requests':>10}{'blocks':>12}{'hit % shared':>14}{'from ' + tier:>10}"
        f"{'of them others':>16}{'hit % isolated':>16}",
    ]
    for s, i in zip(shared["per_worker"], isolated["per_worker"]):
        g4 = s["tiers"].get(tier, {}).get("blocks_hit", 0)
        lines.append(f"{s['worker']:<8}{s['requests']:>10,}{s['blocks']:>12,}"
                     f"{100 * s['hit_rate']:>13.2f}%{g4:>10,}{s['from_other_workers']:>16,}"
                     f"{100 * i['hit_rate']:>15.2f}%")
    lines.append(f"{'all':<8}{shared['requests']:>10,}{shared['blocks']:>12,}"
                 f"{100 * shared['hit_rate']:>13.2f}%{shared['shared_tier']['blocks_hit']:>10,}"
                 f"{shared['shared_tier']['from_other_workers']:>16,}"
                 f"{100 * isolated['hit_rate']:>15.2f}%")
    lines.append("")
    ratio = f" ({gain['ratio']:.2f}x)" if gain["ratio"] else ""
    lines.append(f"sharing {tier}  {gain['points']:+.2f} points of hit rate{ratio}: "
                 f"{gain['blocks_not_recomputed']:,} blocks not recomputed")
    if shared.get("mode") == "data":
        lines.append(f"real bytes   G4 in {shared['shared_tier']['store']}; "
                     f"{shared['bytes_moved']:,} bytes moved; "
                     f"{shared['mismatches'] + isolated['mismatches']} wrong blocks, "
                     f"{shared['load_failures'] + isolated['load_failures']} load failures")
    lines.append(f"wall time    {shared['wall_seconds']:.2f} s shared, "
                 f"{isolated['wall_seconds']:.2f} s isolated")
    return "\n".join(lines)


def write_fleet_plot(shared, isolated, path: str) -> None:
    """Cumulative hit rate along the trace of the fleet, shared and isolated, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for result, label in ((shared, "shared G4"), (isolated, "isolated workers")):
        xs = [n for n, _ in result.curve]
        ax.plot(xs, [100 * r["total"] for _, r in result.curve], label=f"{label}: all tiers",
                linewidth=2)
    xs = [n for n, _ in shared.curve]
    ax.plot(xs, [100 * r["from other workers"] for _, r in shared.curve],
            label="shared G4: blocks other workers put", linewidth=1)
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("cumulative hit rate, % of blocks")
    ax.set_title(f"kvstrata replay: {len(shared.workers)} workers, route {shared.route}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _save(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, written whole or not at all (a full filesystem leaves no
    empty or partial file behind), mode 0644 at most: others may read a plot (curves of hit
    rates, no prompt), no one else may change it (under umask 0 it was 0666)."""
    image = io.BytesIO()
    fig.savefig(image, format="png")
    write_atomically(path, image.getvalue(), mode=0o644)
