"""Process-wide settings (pydantic-settings, `CP_` prefix, `__` for nesting).

Only what the simulator and the CLI need so far; the live router adds its sections here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


def _default_data_dir() -> Path:
    return (REPO_ROOT.parent / "shared" / "data").resolve()


class Settings(BaseSettings):
    """Settings read from `CP_*` environment variables and an optional `.env` file."""

    model_config = SettingsConfigDict(
        env_prefix="CP_", env_nested_delimiter="__", env_file=".env", extra="ignore"
    )

    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description=(
            "Folder holding the real traces and profiles (traces/mooncake, "
            "traces/azure_llm_2023, profiling/vidur). Optional: bundled fixtures are used "
            "when a file is missing."
        ),
    )
    out_dir: Path = Field(
        default=Path("out"), description="Where reports, plots and benchmark JSON are written."
    )

    @property
    def mooncake_trace(self) -> Path:
        return self.data_dir / "traces" / "mooncake" / "synthetic_trace.jsonl"

    @property
    def azure_code_trace(self) -> Path:
        return self.data_dir / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"

    @property
    def vidur_compute_dir(self) -> Path:
        return self.data_dir / "profiling" / "vidur" / "compute"


def get_settings() -> Settings:
    return Settings()
