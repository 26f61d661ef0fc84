"""Figures for `roofline bench serve --plot out.png`: latency distributions and throughput over time."""

from __future__ import annotations

from typing import Any, Sequence


def _hist(ax: Any, values_ms: Sequence[float], title: str) -> None:
    import numpy as np

    if len(values_ms) == 0:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        v = np.asarray(values_ms, dtype=float)
        ax.hist(v, bins=min(50, max(5, len(v) // 4)), color="#4878a8", alpha=0.85)
        for q, style in ((50, "--"), (99, ":")):
            x = float(np.percentile(v, q))
            ax.axvline(x, color="#c44e52", linestyle=style, label=f"p{q} {x:.1f} ms")
        ax.legend(fontsize=8)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")


def time_series(results: Sequence[Any], duration: float, bins: int = 60) -> dict[str, list[float]]:
    """Output tokens/s and in-flight requests over the run, in `bins` equal time bins."""
    import numpy as np

    duration = max(duration, 1e-6)
    edges = np.linspace(0.0, duration, bins + 1)
    width = edges[1] - edges[0]
    tokens = np.zeros(bins)
    inflight = np.zeros(bins)
    for r in results:
        if not r.success:
            continue
        times = r.chunk_times
        if times:
            per_chunk = r.output_len / len(times)
            idx = np.clip(np.searchsorted(edges, times, side="right") - 1, 0, bins - 1)
            np.add.at(tokens, idx, per_chunk)
        start, end = r.start_time, r.start_time + r.latency
        overlap = np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], start), 0, None)
        inflight += overlap / width
    return {"t": list((edges[:-1] + width / 2).tolist()), "tokens_per_s": list((tokens / width).tolist()),
            "in_flight": list(inflight.tolist())}


def plot_benchmark(path: str, results: Sequence[Any], duration: float, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    itl = [x * 1000 for r in ok for x in r.itls]
    e2e = [r.latency * 1000 for r in ok]

    fig = plt.figure(figsize=(12, 10), constrained_layout=True)
    grid = fig.add_gridspec(3, 2)
    _hist(fig.add_subplot(grid[0, 0]), ttft, "time to first token")
    _hist(fig.add_subplot(grid[0, 1]), tpot, "time per output token (excl. first)")
    _hist(fig.add_subplot(grid[1, 0]), itl, "inter-token latency")
    _hist(fig.add_subplot(grid[1, 1]), e2e, "end-to-end latency")
    ax = fig.add_subplot(grid[2, :])
    ts = time_series(results, duration)
    ax.plot(ts["t"], ts["tokens_per_s"], color="#4878a8", label="output tokens/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(ts["t"], ts["in_flight"], color="#dd8452", linestyle="--", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="upper right", fontsize=8)
    ax.set_title("throughput over time")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
