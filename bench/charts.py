"""The soak's picture (``--soak-png``): throughput and p99 per interval, per database,
and the ratio to the bare proxy beside each interval (``--soak-check``); matplotlib is
optional and imported only here."""

from __future__ import annotations

from typing import Any

from bench.options import Options


def draw_soak(curves: dict[str, list[dict[str, Any]]], opts: Options, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "soak: no picture (--soak-png needs matplotlib: pip install matplotlib)"
    checked = any("rps_ratio" in i for intervals in curves.values() for i in intervals)
    figure, axes = plt.subplots(
        3 if checked else 2, 1, sharex=True, figsize=(8, 9 if checked else 6)
    )
    top, bottom = axes[0], axes[-1]
    for backend, intervals in curves.items():
        minutes = [i["start_seconds"] / 60 for i in intervals]
        top.plot(minutes, [i["rps"] for i in intervals], marker="o", label=backend)
        axes[1].plot(minutes, [i["p99_ms"] for i in intervals], marker="o", label=backend)
        if checked and "rps_ratio" in intervals[0]:
            bottom.plot(minutes, [i["rps_ratio"] for i in intervals], marker="o", label=backend)
    top.set_ylabel("fenced writes / s")
    axes[1].set_ylabel("p99 (ms)")
    if checked:
        bottom.set_ylabel("writes ÷ bare proxy (same minute)")
    bottom.set_xlabel("minutes into the soak")
    for axis in axes:
        axis.set_ylim(bottom=0)
    top.legend()
    top.set_title(f"Fencegate soak: {opts.concurrency} connections, {opts.jobs} leases")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return f"soak: picture in {path}"
