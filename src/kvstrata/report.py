"""Human-readable output of a replay: the terminal table and the hit-rate plot."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .replay import ReplayResult


def format_table(doc: dict) -> str:
    """The replay report (``ReplayResult.as_dict()``) as a plain-text table."""
    lines = [
        f"trace        {doc['trace']}",
        f"requests     {doc['requests']:,}   granularity {doc['granularity']}"
        f"   block size {doc['block_size']} tokens",
        "",
        f"{'tier':<5}{'capacity':>10}{'eviction':>10}{'admission':>14}{'looked up':>12}"
        f"{'hit':>10}{'hit %':>8}{'tokens hit %':>14}{'evictions':>11}",
    ]
    for name, t in doc["tiers"].items():
        lines.append(
            f"{name:<5}{t['capacity']:>10,}{t['eviction']:>10}{t['admission']:>14}"
            f"{t['blocks_looked_up']:>12,}{t['blocks_hit']:>10,}{100 * t['hit_rate']:>7.2f}%"
            f"{100 * t['token_hit_rate']:>13.2f}%{t['evictions']:>11,}"
        )
    lines.append(
        f"{'all':<5}{'':>10}{'':>10}{'':>14}{doc['blocks']:>12,}{doc['blocks_hit']:>10,}"
        f"{100 * doc['hit_rate']:>7.2f}%{100 * doc['token_hit_rate']:>13.2f}%"
    )
    lines.append("")
    moves = ", ".join(f"{k} {v:,}" for k, v in doc["moves"].items()) or "none"
    lines.append(f"promotions   {doc['promotions']:,}   demotions {doc['demotions']:,}   ({moves})")
    lines.append(
        f"wall time    {doc['wall_seconds']:.2f} s   {doc['block_accesses_per_s']:,} block accesses/s"
    )
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
    fig.savefig(path)
    plt.close(fig)
