"""`controlplane tenant key|prefix`: config-file material for tenants and shared prefixes.

`key` makes a fresh API key (256 random bits) and prints it once with its SHA-256 digest: the
key goes to the tenant, only the digest into the router's config (`tenants[].api_key_sha256`) or
a POST to /admin/tenants. `prefix` prints the `public_prefixes` entry of a prompt prefix given as
token ids, as text, or as a chat system message rendered with a local tokenizer's template.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from controlplane.cli import app
from controlplane.errors import ConfigError
from controlplane.tenancy.identity import TENANT_ID, new_key
from controlplane.tenancy.salts import prefix_digest

tenant_app = typer.Typer(help="Tenants: API keys and shared prefixes.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")


@tenant_app.command("key")
def key_cmd(
    tenant: Annotated[str, typer.Option("--id", help="Tenant id for the config snippet.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Generate an API key; print it (shown once) and the digest the router stores."""
    if tenant and not TENANT_ID.match(tenant):
        raise ConfigError("tenant ids are 1-64 characters of A-Z a-z 0-9 . _ : -")
    key, digest = new_key()
    if as_json:
        typer.echo(json.dumps({"tenant": tenant or None, "api_key": key, "sha256": digest}))
        return
    typer.echo(f"api key (give it to the tenant; it is not stored anywhere): {key}")
    typer.echo(f"sha256: {digest}")
    if tenant:
        snippet = {"tenants": [{"id": tenant, "api_key_sha256": [digest]}]}
        typer.echo(yaml.safe_dump(snippet, sort_keys=False).rstrip())


def _ids(token_ids: str, text: str, system: str, tokenizer: Path | None) -> list[int]:
    given = sum(bool(x) for x in (token_ids, text, system))
    if given != 1:
        raise ConfigError("give exactly one of --token-ids, --text, --system")
    if token_ids:
        raw = sys.stdin.read() if token_ids == "-" else token_ids
        try:
            parsed: Any = json.loads(raw) if raw.lstrip().startswith("[") else raw.split(",")
            ids = [int(t) for t in parsed]
        except (ValueError, TypeError):
            raise ConfigError("--token-ids expects 1,2,3 or a JSON list (- reads stdin)") from None
        if not ids or any(not 0 <= t < 2**32 for t in ids):
            raise ConfigError("token ids must be a non-empty list of u32 values")
        return ids
    if tokenizer is None:
        raise ConfigError("--text and --system need --tokenizer (a directory with tokenizer.json)")
    from controlplane.tokenization import LocalTokenizer

    tok = LocalTokenizer.from_path(tokenizer)
    if text:
        return tok.encode(text, add_special_tokens=True)
    rendered = tok.render_chat([{"role": "system", "content": system}], add_generation_prompt=False)
    return tok.encode(rendered, add_special_tokens=False)


@tenant_app.command("prefix")
def prefix_cmd(
    name: Annotated[str, typer.Argument(help="Name of the shared prefix (its salt).")],
    token_ids: Annotated[str, typer.Option(help="Ids: 1,2,3 or a JSON list (- = stdin).")] = "",
    text: Annotated[str, typer.Option(help="Prompt text (completions).")] = "",
    system: Annotated[str, typer.Option(help="A chat system message, rendered.")] = "",
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer directory.")] = None,
    tenants: Annotated[str, typer.Option(help="Comma-separated tenants; empty: all.")] = "",
) -> None:
    """Print the `public_prefixes` entry for a prefix every listed tenant may share."""
    if not TENANT_ID.match(name):
        raise ConfigError("prefix names are 1-64 characters of A-Z a-z 0-9 . _ : -")
    ids = _ids(token_ids, text, system, tokenizer)
    entry: dict[str, Any] = {
        "name": name,
        "tokens_sha256": prefix_digest(ids),
        "num_tokens": len(ids),
        "tenants": [t for t in tenants.split(",") if t],
    }
    typer.echo(yaml.safe_dump({"public_prefixes": [entry]}, sort_keys=False).rstrip())
