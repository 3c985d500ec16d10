"""Roofline fidelity: every published figure beside the model's, and a plot of the vidur points.

Prints the calibration table (the same anchors the test suite holds within 15%), recomputes the
vidur medians from the CSVs when the data folder is present (provenance check), and writes
out/bench/roofline_fidelity.json and out/bench/roofline_vidur.png.
"""

from __future__ import annotations

from common import console, out_dir, print_table, save_figure, write_json

from controlplane.roofline.calibration import (
    TOLERANCE,
    VIDUR_LINEAR_MS,
    anchors,
    linear_layer_ms,
    vidur_linear_medians,
)
from controlplane.settings import get_settings


def main() -> None:
    rows, records = [], []
    for a in anchors():
        role = "fitted" if a.fitted else ("held out" if a.held_out else "calibration")
        model = a.modelled()
        rows.append((a.setting, a.quantity, a.measured, model, f"{a.error():+.1%}", role))
        records.append(
            {
                "source": a.source,
                "setting": a.setting,
                "quantity": a.quantity,
                "unit": a.unit,
                "measured": a.measured,
                "model": model,
                "error": a.error(),
                "role": role,
            }
        )
    print_table(
        "roofline vs published measurements",
        ["setting", "quantity", "measured", "model", "error", "role"],
        rows,
    )
    calibrated = [r for r in records if r["role"] != "held out"]
    worst = max(abs(float(r["error"])) for r in calibrated)  # type: ignore[arg-type]
    console.print(f"worst calibration error {worst:.1%} (tolerance {TOLERANCE:.0%})")
    provenance: dict[str, object] = {"checked": False}
    compute_dir = get_settings().vidur_compute_dir
    if compute_dir.is_dir():
        recomputed = vidur_linear_medians(compute_dir)
        mismatches = [
            (k, t)
            for k, pts in VIDUR_LINEAR_MS.items()
            for t, v in pts.items()
            if abs(recomputed.get(k, {}).get(t, -1.0) - v) > 1e-9
        ]
        provenance = {"checked": True, "mismatches": [str(m) for m in mismatches]}
        console.print(f"vidur medians recomputed from {compute_dir}: {len(mismatches)} mismatches")
    _plot()
    write_json(
        "roofline_fidelity.json",
        {"anchors": records, "worst_calibration_error": worst, "vidur_provenance": provenance},
    )


def _plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for (gpu, model, tp), pts in VIDUR_LINEAR_MS.items():
        xs = sorted(pts)
        line = ax.plot(xs, [pts[x] for x in xs], "o", label=f"{gpu} {model} TP{tp} (vidur)")
        dense = [2**i for i in range(13)]
        ax.plot(
            dense,
            [linear_layer_ms(gpu, model, tp, x) for x in dense],
            "-",
            color=line[0].get_color(),
            alpha=0.6,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("linear layers, ms per layer")
    ax.set_title("smooth roofline (lines) vs vidur's measured medians (points)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    save_figure(fig, out_dir() / "roofline_vidur.png")


if __name__ == "__main__":
    main()
