"""Screenshots of what an operator sees of a tuning job in the Ray dashboard: the Jobs page
(each job named ``dptune job N · model on dataset · accounting …``) and the job's page with
its log (Tune's trial table, then the closing table of trials, the charge and the released
trial).

    python bench/dashboard_screenshot.py --job 1                   # docs/dashboard-*.png
    python bench/dashboard_screenshot.py --dashboard http://ray-head:8265 --job 7 --out /tmp

It logs in as a browser does — ``POST /api/authenticate`` with the Ray token, which sets the
dashboard's session cookie — and drives headless Chromium with Playwright. Neither is a
dependency of dptune or of its tests: ``pip install playwright`` and a Chromium
(``apt-get install chromium`` on Debian; Playwright's own download is not needed). The token
is ``RAY_AUTH_TOKEN``, else the file ``--token-file`` (the local head's:
``<DPTUNE_STATE_DIR>/ray-auth-token``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

from service.settings import RAY_TOKEN_FILE, Settings

#: Chromium without a sandbox (root in a container), a GPU, or any call home
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def ray_token(token_file: Path) -> str:
    return os.environ.get("RAY_AUTH_TOKEN") or token_file.read_text().strip()


def submission_of(dashboard: str, token: str, job: int) -> tuple[str, str]:
    """The Ray submission id and name of dptune job ``job`` (from its Ray job's metadata)."""
    response = httpx.get(f"{dashboard}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    response.raise_for_status()
    for info in response.json():
        metadata = info.get("metadata") or {}
        if metadata.get("dptune_job") == str(job):
            return info["submission_id"], metadata["job_name"]
    raise SystemExit(f"the Ray cluster at {dashboard} has no Ray job of dptune job {job}")


def jobs_page(page: Page, dashboard: str, name: str, path: Path) -> None:
    """The Jobs page, down to the end of its job list."""
    page.goto(f"{dashboard}/#/jobs")
    page.get_by_text(name).first.wait_for()
    bottom = page.locator("table").first.bounding_box()
    assert bottom is not None
    size = page.viewport_size
    assert size is not None
    height = min(size["height"], bottom["y"] + bottom["height"] + 24)
    page.screenshot(path=path, clip={"x": 0, "y": 0, "width": size["width"], "height": height})


def log_page(page: Page, dashboard: str, submission: str, path: Path) -> None:
    """The job's page at its log: the viewer made tall (its expand button, beside the Driver
    tab) and scrolled to the end — Tune's last table, then the job's closing summary."""
    page.goto(f"{dashboard}/#/jobs/{submission}")
    page.get_by_text("Running entrypoint").first.wait_for()
    tabs = page.locator(".MuiTabs-root").first
    tabs.locator("xpath=../..").locator(":scope > button").click()
    viewer = page.locator(".hljs-light").first  # the log's virtualized list
    viewer.evaluate("list => { list.scrollTop = list.scrollHeight; }")
    page.get_by_text("released:").first.wait_for()
    viewer.scroll_into_view_if_needed()
    page.screenshot(path=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=int, required=True, help="the dptune job id")
    parser.add_argument("--dashboard", default="http://127.0.0.1:8265")
    parser.add_argument("--token-file", type=Path, default=Settings().state_path / RAY_TOKEN_FILE)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--size", default="1600x1000", help="the window, WIDTHxHEIGHT")
    args = parser.parse_args()
    dashboard = args.dashboard.rstrip("/")
    token = ray_token(args.token_file)
    submission, name = submission_of(dashboard, token, args.job)
    width, height = (int(n) for n in args.size.split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as profile,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=args.chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": width, "height": height},
        )
        login = browser.request.post(
            f"{dashboard}/api/authenticate", headers={"Authorization": f"Bearer {token}"}
        )
        if not login.ok:
            raise SystemExit(f"the dashboard refused the token: HTTP {login.status}")
        page = browser.new_page()
        jobs_page(page, dashboard, name, args.out / "dashboard-jobs.png")
        log_page(page, dashboard, submission, args.out / "dashboard-job-log.png")
        browser.close()
    print(f"wrote {args.out / 'dashboard-jobs.png'} and {args.out / 'dashboard-job-log.png'}")


if __name__ == "__main__":
    main()
