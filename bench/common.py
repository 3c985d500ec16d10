"""Helpers shared by the benchmark scripts: output folder, JSON, rich tables, machine facts."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

console = Console(width=None if sys.stdout.isatty() else 160)


def out_dir(default: str = "out/bench") -> Path:
    path = Path(os.environ.get("CP_BENCH_OUT", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


NATIVE_HELP = "run on the simulator compiled with mypyc (built into out/bench/native when stale)"


def run_compiled(script: str) -> None:
    """Re-run `script` with this process's arguments, less --native, on the compiled simulator
    built into out/bench/native (controlplane.cli.common.rerun_compiled)."""
    from controlplane.cli.common import rerun_compiled

    rerun_compiled(out_dir() / "native", [script], console)


def machine() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(name: str, payload: dict[str, object]) -> Path:
    path = out_dir() / name
    path.write_text(json.dumps({**payload, "machine": machine()}, indent=2))
    console.print(f"wrote {path}")
    return path


def _deep_merge(base: dict[str, object], extra: dict[str, object]) -> dict[str, object]:
    out = dict(base)
    for key, value in extra.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            out[key] = _deep_merge(old, value)
        else:
            out[key] = value
    return out


def merge_json(name: str, extra: dict[str, object]) -> Path | None:
    """Merge `extra` into another bench's JSON under out_dir() (dicts merged key by key);
    nothing when that file does not exist (the other bench has not run)."""
    path = out_dir() / name
    if not path.exists():
        console.print(f"[dim]{path} not found: not merged[/dim]")
        return None
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(_deep_merge(doc, extra), indent=2))
    console.print(f"merged into {path}")
    return path


def phase_columns() -> tuple[ProgressColumn, ...]:
    """The columns of a bench's progress bar that counts phases."""
    return (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} phases"),
        TimeElapsedColumn(),
    )


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col != columns[0] else "left")
    for row in rows:
        table.add_row(*(f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)


def save_figure(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Lay the figure out, write it as a PNG at `path`, and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    console.print(f"wrote {path}")
    return path
