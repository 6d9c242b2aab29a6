"""`sluice batch`: submit a file for batch scoring, follow it with a progress bar, download the
output, cancel it. A client of the API (`launch/api_client.py`), like every operator command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from launch.api_client import ApiClient, KeyOption, UrlOption, api_client, api_errors

batch_app = typer.Typer(no_args_is_help=True, help="Batch scoring: submit a file, follow it, download the output.")
console = Console(soft_wrap=True)

FormatOption = Annotated[str | None, typer.Option("--format", help="jsonl, csv or parquet")]


class _RowRate(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} rows/s" if task.speed else "… rows/s", style="progress.data.speed")


def _summary(batch: dict[str, Any]) -> str:
    total = batch["total"] if batch["total"] is not None else "?"
    line = (f"batch {batch['id']} of {batch['model']} {batch['version']}: [bold]{batch['status']}[/], "
            f"{batch['done']} done, {batch['failed']} failed of {total}")
    if batch.get("error"):
        line += f"\n  {batch['error']}"
    return line


def _follow(client: ApiClient, batch_id: str) -> dict[str, Any]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), _RowRate(),
               TextColumn("ETA"), TimeRemainingColumn())
    batch: dict[str, Any] = {}
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch_id, total=None)
        for batch in client.follow_batch(batch_id):
            progress.update(task, total=batch["total"], completed=batch["done"] + batch["failed"],
                            description=f"{batch_id} {batch['status']}")
    return batch


@batch_app.command("submit")
def submit(
    source: Annotated[str, typer.Argument(help="A local JSONL, CSV or Parquet file (uploaded), or a file:// URI "
                                               "in your tenant's folder, SLUICE_BATCH_ROOT/tenants/<tenant>/")],
    model: Annotated[str, typer.Option(help="The model to score with")],
    version: Annotated[str | None, typer.Option(help="A version (default: routed like your jobs)")] = None,
    input_format: FormatOption = None,
    text_field: Annotated[str | None, typer.Option(help="The column that holds the text (default: text)")] = None,
    output_format: Annotated[str | None, typer.Option(help="The output's default format")] = None,
    follow: Annotated[bool, typer.Option("--follow", help="Show progress until the batch is final")] = False,
    url: UrlOption = None, key: KeyOption = None,
) -> None:
    """Create a batch; prints its id (and, with --follow, a progress bar: rows, rate, ETA)."""
    options: dict[str, Any] = {"version": version, "format": input_format, "text_field": text_field,
                               "output_format": output_format}
    with api_errors(console), api_client(url, key, timeout_s=600.0) as client:
        if source.startswith("file://"):
            batch = client.submit_batch(model, input_uri=source, **options)
        else:
            path = Path(source)
            if not path.is_file():
                raise typer.BadParameter(f"{source} is not a file", param_hint="SOURCE")
            batch = client.submit_batch(model, file=path, **options)
        console.print(f"batch {batch['id']} queued on {batch['model']} {batch['version']}")
        if follow:
            console.print(_summary(_follow(client, batch["id"])))


@batch_app.command("status")
def status(batch_id: str, as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
           url: UrlOption = None, key: KeyOption = None) -> None:
    """One batch's progress."""
    with api_errors(console), api_client(url, key) as client:
        batch = client.batch(batch_id)
    if as_json:
        console.print_json(data=batch)
    else:
        console.print(_summary(batch))


@batch_app.command("follow")
def follow_command(batch_id: str, url: UrlOption = None, key: KeyOption = None) -> None:
    """A progress bar until the batch is final."""
    with api_errors(console), api_client(url, key) as client:
        console.print(_summary(_follow(client, batch_id)))


@batch_app.command("list")
def list_command(limit: Annotated[int, typer.Option(min=1, max=500)] = 20,
                 schedule: Annotated[str | None, typer.Option(help="Runs of this schedule")] = None,
                 url: UrlOption = None, key: KeyOption = None) -> None:
    """Your batches, newest first."""
    with api_errors(console), api_client(url, key) as client:
        for batch in client.batches(limit=limit, schedule_id=schedule):
            console.print(f"{batch['created_at']}  {_summary(batch)}")


@batch_app.command("download")
def download(
    batch_id: str,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where (default: ID.FORMAT here)")] = None,
    output_format: FormatOption = None,
    url: UrlOption = None, key: KeyOption = None,
) -> None:
    """Write the batch's output (rows in input order) to a file."""
    with api_errors(console), api_client(url, key, timeout_s=600.0) as client:
        batch = client.batch(batch_id)
        fmt = output_format or batch["output"]["format"]
        target = client.download_batch(batch_id, output or Path(f"{batch_id}.{fmt}"), format=fmt)
    partial = "" if batch["finished_at"] else " (the batch is not final: the rows so far)"
    console.print(f"wrote {target}{partial}")


@batch_app.command("cancel")
def cancel(batch_id: str, url: UrlOption = None, key: KeyOption = None) -> None:
    """Cancel what has not started."""
    with api_errors(console), api_client(url, key) as client:
        console.print(_summary(client.cancel_batch(batch_id)))
