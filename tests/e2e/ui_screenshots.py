"""Headless Chromium opens the demo's Prefect UI, finds the sweep and saves screenshots in docs/.

Run by `make e2e` after `make demo` (a local server with a finished quickstart
sweep) and `flows/pretrain_finetune.py` (the checkpoint lineage: the pretrain's
checkpoint materialized as an asset, referenced by each fine-tune). Uses Debian's
chromium through Playwright's `executable_path`, so no browser is downloaded.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, sync_playwright
from prefect import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter
from prefect.client.schemas.sorting import FlowRunSort

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGE_TIMEOUT_MS = 60_000


async def _latest_sweep() -> tuple[Any, list[Any], list[Any]]:
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["quickstart-sweep"])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
        if not runs:
            sys.exit("No quickstart-sweep flow run found: run `make demo` first.")
        flow_run = runs[0]
        task_runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]})
        )
        artifacts = await client.read_artifacts(
            flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]})
        )
        return flow_run, task_runs, artifacts


async def _latest_lineage_event() -> Any:
    """The newest materialization of a checkpoint asset (flows/pretrain_finetune.py's pretrain)."""
    async with get_client() as client:
        response = await client._client.post(
            "/events/filter",
            json={
                "filter": {"event": {"name": ["prefect.asset.materialization.succeeded"]}},
                "limit": 50,
            },
        )
        response.raise_for_status()
        events = [
            e
            for e in response.json().get("events", [])
            if "/pretrain-" in e["resource"]["prefect.resource.id"]
        ]
    if not events:
        sys.exit("No checkpoint asset event found: run flows/pretrain_finetune.py first.")
    return events[0]


def _shoot(page: Page, url: str, expect: str, name: str) -> Path:
    page.goto(url, wait_until="networkidle", timeout=PAGE_TIMEOUT_MS)
    page.get_by_text(expect, exact=False).first.wait_for(timeout=PAGE_TIMEOUT_MS)
    target = DOCS / name
    page.screenshot(path=str(target), full_page=True)
    print(f"saved {target.relative_to(ROOT)} ({url})")
    return target


def main() -> None:
    ui = os.environ.get("PREFECT_UI_URL") or os.environ["PREFECT_API_URL"].removesuffix("/api")
    flow_run, task_runs, artifacts = asyncio.run(_latest_sweep())
    train_run = next(t for t in task_runs if t.name.startswith("train"))
    metrics = next(a for a in artifacts if a.key == "quickstart-sweep-metrics")
    lineage = asyncio.run(_latest_lineage_event())
    DOCS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        _shoot(page, f"{ui}/runs/flow-run/{flow_run.id}", flow_run.name, "ui-flow-run.png")
        _shoot(
            page,
            f"{ui}/runs/task-run/{train_run.id}?tab=Artifacts",
            "Where this task run's pod runs",
            "ui-task-run-artifacts.png",
        )
        _shoot(page, f"{ui}/artifacts/artifact/{metrics.id}", "final_loss", "ui-sweep-metrics.png")
        _shoot(
            page,
            f"{ui}/events/event/{lineage['occurred'][:10]}/{lineage['id']}",
            "materialization",
            "ui-checkpoint-lineage.png",
        )
        browser.close()


if __name__ == "__main__":
    main()
