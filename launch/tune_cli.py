"""`sluice tune status`: per version, what its batching was tuned on and what the nightly re-tune
proposes (scheduler/retune.py), through the API. A proposal is applied with
`PATCH /v1/models/{m}/versions/{v}` and `{"apply_proposal": true}`, or by the job itself where the
version says `auto_tune`."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console

from launch.api_client import KeyOption, UrlOption, api_client, api_errors
from sluice.versions import VersionState

console = Console(soft_wrap=True)
tune_app = typer.Typer(help="Batching tuned to a p99 budget on the served mix, re-planned nightly.")


@tune_app.command("status")
def status(url: UrlOption = None, key: KeyOption = None) -> None:
    """Each served version: its budget, when and on what mix it was tuned, the last proposal with
    its predicted gain, and how far the last 24 h's mix has drifted from the tuned one."""
    with api_errors(console), api_client(url, key) as client:
        for model in client.models():
            for listed in model["versions"]:
                if listed["state"] == VersionState.retired:
                    continue
                version = client.version(model["name"], listed["version"])
                for line in describe(model["name"], version):
                    console.print(line)


def describe(model: str, version: dict[str, Any]) -> list[str]:
    """The lines `status` prints for one version resource."""
    batching = version["batching"]
    budget = batching.get("p99_budget_ms")
    head = (f"{model} {version['version']}: batch {batching['max_batch_size']}, wait {batching['max_wait_ms']:g} ms; "
            + (f"p99 budget {budget:g} ms, auto_tune {'on' if batching.get('auto_tune') else 'off'}"
               if budget is not None else "no p99 budget (not re-tuned)"))
    lines = [head]
    tuned_on = batching.get("tuned_on")
    if batching.get("tuned_at") and tuned_on:
        lines.append(f"  tuned at {batching['tuned_at']} on {tuned_on.get('samples', 0)} inputs "
                     f"({_mix(tuned_on.get('mix', {}))})")
    else:
        lines.append("  never tuned from a proposal")
    proposal = batching.get("proposal")
    if proposal:
        gain = proposal.get("gain")
        lines.append(f"  proposal: batch {proposal['max_batch_size']}, wait {proposal['max_wait_ms']:g} ms, "
                     f"{proposal['throughput_rps']:.1f}/s at p99 {proposal['p99_ms']:.0f} ms; gain "
                     + ("n/a (the current setting never meets the budget)" if gain is None else f"{gain:+.1%}")
                     + f" on {proposal['on'].get('samples', 0)} inputs ({_mix(proposal['on'].get('mix', {}))})")
    elif budget is not None:
        lines.append("  no proposal yet")
    drift = batching.get("drift")
    if drift:
        lines.append("  drift from the tuned mix: " + ", ".join(f"{lane} {value:.2f}" for lane, value in
                                                               sorted(drift.items())))
    return lines


def _mix(counts: dict[str, int]) -> str:
    """The mix's buckets as shares: `<=16: 80%, <=512: 20%`."""
    total = sum(counts.values())
    if not total:
        return "no inputs"
    return ", ".join(f"{'>4096' if label == 'inf' else '<=' + label}: {count / total:.0%}"
                     for label, count in counts.items())
