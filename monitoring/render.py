"""The fleet dashboard's key panels as a PNG, from the Prometheus HTTP API (no Grafana needed)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from edgestream.monitoring.dashboards import Panel, expand, fleet, panels_of
from edgestream.monitoring.prometheus import PrometheusAPI

#: The fleet panels drawn, in reading order (2 x 2).
KEY_PANELS = ("Records in per device", "Buffer fill", "Buffer drops by reason", "Dead letters by reason")


def _legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out if template and template != "__auto" else ",".join(f"{k}={v}" for k, v in labels.items())


def render_fleet(
    api: PrometheusAPI, out: Path, *, start: float | None = None, end: float | None = None,
    step_s: float = 1.0, rate_interval: str = "15s",
) -> dict[str, int]:
    """Draw ``KEY_PANELS`` of the fleet dashboard over [start, end] into ``out``.

    Returns the number of series drawn per panel (0 means the panel had no data).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = end if end is not None else time.time()
    start = start if start is not None else end - 15 * 60
    panels: list[Panel] = panels_of(fleet(), KEY_PANELS)
    results = [[(q, api.query_range(expand(q.expr, rate_interval), start, end, step_s)) for q in p.queries]
               for p in panels]
    # time axis from the first sample of any series: the run, not the empty time before it
    firsts = [float(s["values"][0][0]) for per_panel in results for _, res in per_panel for s in res
              if s["values"]]
    origin = min(firsts) if firsts else start
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    drawn: dict[str, int] = {}
    for ax, panel, per_panel in zip(axes.flat, panels, results, strict=True):
        count = 0
        for query, result in per_panel:
            for series in result:
                xs = [float(t) - origin for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.2, label=_legend(query.legend, series["metric"]))
                count += 1
        drawn[panel.title] = count
        unit = {"rps": "per second", "percentunit": "fraction of capacity", "short": "count"}.get(
            panel.unit, panel.unit)
        ax.set_title(panel.title, fontsize=11)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if count:
            ax.legend(fontsize=7, loc="upper left", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the first sample")
    when = datetime.fromtimestamp(origin, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")
    fig.suptitle(f"edgestream / fleet overview (from Prometheus, {when}, rate window {rate_interval})")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn
