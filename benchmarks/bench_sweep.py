"""Several runs of `pdserve bench` side by side (a rate list or a sweep): one summary row per run,
a table, and one plot of throughput/goodput and latency percentiles against the request rate."""
from __future__ import annotations

from pathlib import Path
from typing import Any

# Latency series of the plot and the table: (result key, label).
LATENCIES = (("p50_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("p50_itl_ms", "ITL p50"),
             ("p99_itl_ms", "ITL p99"), ("p50_pd_handoff_ms", "hand-off p50"), ("p99_pd_handoff_ms", "hand-off p99"))
ROW_KEYS = ("request_rate", "arrival", "run_kind", "completed", "failed", "duration", "request_throughput",
            "output_throughput", "request_goodput", "slo_attainment", "mean_ttft_ms", "median_ttft_ms",
            "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p50_itl_ms", "p90_itl_ms",
            "p99_itl_ms", "mean_e2el_ms", "p50_e2el_ms", "p99_e2el_ms", "pd_handoff_count", "mean_pd_handoff_ms",
            "p50_pd_handoff_ms", "p90_pd_handoff_ms", "p99_pd_handoff_ms")


def sweep_rows(runs: list[dict]) -> list[dict[str, Any]]:
    """One row per run: its rate, throughput, goodput, attainment and latency percentiles (keys a
    run lacks, e.g. a percentile not asked for or no hand-off outside PD, are None); the hand-off
    percentiles /metrics' buckets give are under server_p*_pd_handoff_ms."""
    rows = []
    for r in runs:
        row = {k: r.get(k) for k in ROW_KEYS}
        for name in ("ttft", "itl", "e2el", "pd_handoff"):  # the median is p50 when --percentiles lacks 50
            if row[f"p50_{name}_ms"] is None:
                row[f"p50_{name}_ms"] = r.get(f"median_{name}_ms")
        server = r.get("server_side") or {}
        for p in ("50", "90", "99"):
            row[f"server_p{p}_pd_handoff_ms"] = server.get(f"p{p}_handoff_ms")
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def format_sweep_table(rows: list[dict]) -> str:
    cols = [("run_kind", "run"), ("request_rate", "rate"), ("request_throughput", "req/s"),
            ("request_goodput", "goodput"), ("slo_attainment", "SLO att."), ("output_throughput", "tok/s"),
            *LATENCIES, ("failed", "failed")]
    lines = ["{s:{c}^50}".format(s=" Rate sweep ", c="="), "  ".join(f"{label:>12}" for _, label in cols)]
    lines += ["  ".join(f"{_cell(row.get(key)):>12}" for key, _ in cols) for row in rows]
    return "\n".join(lines)


def save_sweep_plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """Left: request throughput and goodput; right: latency percentiles (log scale); both against
    the configured request rate (a probe sends all at once, so its x is the rate it achieved)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    def rate(r: dict) -> float:
        return r["request_throughput"] if r["request_rate"] == "inf" else r["request_rate"]

    rows = sorted(rows, key=rate)
    xs = [rate(r) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(xs, [r["request_throughput"] for r in rows], "o-", label="throughput (req/s)")
    if any(r["request_goodput"] is not None for r in rows):
        left.plot(xs, [r["request_goodput"] or 0.0 for r in rows], "s-", label="goodput (req/s)")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("req/s")
    left.legend()
    left.grid(alpha=0.3)
    for key, label in LATENCIES:
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            right.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], "o-",
                       label=label)
    right.set_yscale("log")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("ms")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(title or "pdserve bench: rate sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
