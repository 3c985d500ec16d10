"""`controlplane roofline`: what the step-time model says about a replica."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from controlplane.cli import app
from controlplane.cli.common import build_profile
from controlplane.roofline import GPUS, MODELS
from controlplane.roofline.calibration import anchors
from controlplane.roofline.capacity import (
    concurrency_ceilings,
    decode_seconds_per_token,
    prefill_seconds_per_token,
)
from controlplane.roofline.step import StepCostModel

roofline_app = typer.Typer(help="The roofline step-time model.", no_args_is_help=True)
app.add_typer(roofline_app, name="roofline")
out = Console(width=None if sys.stdout.isatty() else 200)


@roofline_app.command("show")
def show_cmd(
    gpu: Annotated[str, typer.Option(help="GPU key.")] = "h100",
    model: Annotated[str, typer.Option(help="Model key.")] = "llama-3.1-8b",
    tp: Annotated[int, typer.Option(min=1, help="Tensor parallel degree.")] = 1,
    context: Annotated[float, typer.Option(help="Mean context per sequence, tokens.")] = 2048.0,
) -> None:
    """Memory, KV capacity, per-token costs and the three concurrency ceilings."""
    prof = build_profile(gpu, model, tp)
    cost = StepCostModel.from_profile(prof)
    ceilings = concurrency_ceilings(prof, context)
    table = Table(title=prof.label, show_header=False)
    rows = [
        ("weights per GPU", f"{prof.weight_bytes_per_gpu / 2**30:.2f} GiB"),
        ("KV bytes per token", f"{prof.model.kv_bytes_per_token:,} B"),
        ("KV capacity", f"{prof.kv_capacity_tokens:,} tokens ({prof.num_gpu_blocks:,} blocks)"),
        ("block size / max_num_seqs", f"{prof.resolved_block_size} / {prof.resolved_max_num_seqs}"),
        ("max_num_batched_tokens", f"{prof.resolved_max_num_batched_tokens:,}"),
        ("compute ridge (FLOP/B)", f"{prof.gpu.ridge_flop_per_byte:.0f}"),
        ("decode step, batch 1", f"{cost.decode_step_time(1, context) * 1e3:.2f} ms"),
        ("prefill per token", f"{prefill_seconds_per_token(prof, context) * 1e6:.1f} us"),
        (
            "decode per token, batch 64",
            f"{decode_seconds_per_token(prof, 64, context) * 1e3:.2f} ms",
        ),
        ("ceiling: max_num_seqs", f"{ceilings.max_num_seqs.sequences:,.0f}"),
        ("ceiling: KV capacity", f"{ceilings.kv_capacity.sequences:,.1f}"),
        ("ceiling: compute ridge", f"{ceilings.compute_ridge.sequences:,.1f}"),
        ("binding ceiling", f"{ceilings.binding.kind.value}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    out.print(table)


@roofline_app.command("models")
def models_cmd() -> None:
    """Known GPUs and models."""
    out.print("GPUs: " + ", ".join(f"{k} ({v.name})" for k, v in GPUS.items()))
    out.print("models: " + ", ".join(f"{k} ({v.name})" for k, v in MODELS.items()))


@roofline_app.command("calibration")
def calibration_cmd() -> None:
    """Published measurements beside the model's figures."""
    table = Table(title="roofline calibration")
    for col in ("setting", "quantity", "measured", "model", "error", "role"):
        table.add_column(col)
    for a in anchors():
        role = "fitted" if a.fitted else ("held out" if a.held_out else "calibration")
        table.add_row(
            a.setting,
            f"{a.quantity} ({a.unit})",
            f"{a.measured:,.3f}",
            f"{a.modelled():,.3f}",
            f"{a.error():+.1%}",
            role,
        )
    out.print(table)
