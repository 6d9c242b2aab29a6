"""How the operator commands reach the API: `SLUICE_URL` and `SLUICE_API_KEY`, defaulting to the
local `sluice up` and its admin key (`SLUICE_BOOTSTRAP_ADMIN_KEY`, else the one it wrote in
`SLUICE_HOME`, else the demo key there)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import httpx
import typer
from rich.console import Console

from sluice.client import ClientError, SluiceClient
from sluice.settings import Settings

UrlOption = Annotated[str | None, typer.Option(
    "--url", envvar="SLUICE_URL",
    help="The API (default: http://SLUICE_API_HOST:SLUICE_API_PORT, the local one)")]
KeyOption = Annotated[str | None, typer.Option(
    "--key", envvar="SLUICE_API_KEY",
    help="An API key (default: SLUICE_BOOTSTRAP_ADMIN_KEY, else the admin, else the demo key in SLUICE_HOME)")]


def api_client(url: str | None, key: str | None, *, timeout_s: float = 30.0) -> SluiceClient:
    settings = Settings()
    if key is None and settings.bootstrap_admin_key is not None:
        key = settings.bootstrap_admin_key.get_secret_value()
    if key is None:
        stored = [path for path in (settings.home / "admin.key", settings.home / "demo.key") if path.exists()]
        if not stored:
            raise typer.BadParameter(f"no key in {settings.home}: pass --key or set SLUICE_API_KEY", param_hint="--key")
        key = stored[0].read_text().strip()
    return SluiceClient(base_url=url or f"http://{settings.api_host}:{settings.api_port}", api_key=key,
                        timeout_s=timeout_s)


@contextmanager
def api_errors(console: Console) -> Iterator[None]:
    """An API error or an unreachable API ends the command with its message and exit status 1."""
    try:
        yield
    except (ClientError, httpx.HTTPError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from exc
