"""The course opened the way learners open it: JupyterLab in a browser, Run All, look at the result.

A JupyterLab server runs on a copy of the repository; headless Chromium (Debian's ``chromium``,
driven by playwright) opens lesson 00, the first a learner opens, and lesson 02, the shortest with
the block-pool view, runs every cell from the Run menu and saves. The saved notebooks must hold no
error output (checked at every save, since Run All stops at one), the pool view must have rendered
in the page, and a screenshot of each is kept in ``kvlib-output/screenshots``. What the lessons
compute is nbval's part (every lesson runs there); this test is about the browser.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = ROOT / "kvlib-output" / "screenshots"
LESSONS = ["00_setup_and_tour.ipynb", "02_block_allocator_and_block_tables.ipynb"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: `apt-get install chromium` (.ci/run does)")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (it is in the dev extra)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of the course, on a free loopback port; yields its base URL."""
    root = tmp_path_factory.mktemp("course")
    for folder in ("kvlib", "notebooks"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # Fresh settings that render every cell, not only those in view, so all can be read; a fresh
    # workspace, so no tab of an earlier run reopens.
    settings = tmp_path_factory.mktemp("settings")
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    port, token = free_port(), "kvlib-test"
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
         "--LabApp.expose_app_in_browser=True"],  # window.jupyterapp, for wait_for_kernel
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(settings / "ws")})
    base = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("JupyterLab did not start within a minute")
    yield base, token, root
    server.terminate()
    server.wait(timeout=30)


def fail_on_dialog(page, when: str) -> None:
    """Fail on any dialog: with the kernel connected before Run All (``wait_for_kernel``) none is expected."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        page.screenshot(path=str(SCREENSHOTS / "dialog.png"))
        pytest.fail(f"{when}: JupyterLab showed a dialog: {dialog.first.inner_text()[:500]}")


def wait_for_kernel(page) -> None:
    """Wait until the notebook's kernel is connected and idle, read from JupyterLab's own session. The status
    bar's "Idle" can show before the connection is up, and Run All then finds no kernel and asks "Select
    Kernel" (on a busy machine, every time)."""
    page.wait_for_function("""() => {
        const kernel = window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel;
        return kernel?.connectionStatus === 'connected' && kernel.status === 'idle';
    }""", timeout=120_000)


def run_all(page) -> None:
    """Run All from the menu, again if no cell started within 20 s (a request lost on its way to the kernel
    leaves every prompt at "[ ]" for good)."""
    for _ in range(5):
        fail_on_dialog(page, "before Run All")
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator("li[data-command='runmenu:run-all']").click()
        for _ in range(20):
            time.sleep(1)
            if any(text.strip() != "[ ]:" for text in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()):
                return
    pytest.fail("Run All started no cell in five tries")


def run_all_and_save(page, base: str, token: str, root: Path, name: str) -> None:
    """Open, Run All from the menu, then save every few seconds until every code cell has run without an error."""
    workspace = f"lesson{name[:2]}"  # a workspace of its own: this notebook's tab is the only one
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/notebooks/{name}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    wait_for_kernel(page)
    run_all(page)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(5)
        fail_on_dialog(page, name)
        page.keyboard.press("Control+s")
        time.sleep(1)
        try:
            saved = json.loads((root / "notebooks" / name).read_text())
        except json.JSONDecodeError:  # read while JupyterLab was writing it
            continue
        code = [c for c in saved["cells"] if c["cell_type"] == "code"]
        errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{name}: {[(e['ename'], e['evalue']) for e in errors]}"  # Run All stops at an error
        if all(c.get("execution_count") for c in code):
            return
    ran = sum(bool(c.get("execution_count")) for c in code)
    pytest.fail(f"{name} did not finish running within 10 minutes: {ran} of {len(code)} code cells ran")


def test_lessons_run_in_jupyterlab_without_errors_and_show_the_pool_view(lab):
    base, token, root = lab
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for name in LESSONS:
            run_all_and_save(page, base, token, root, name)
            if name.startswith("02"):
                view = page.locator(".animation img").first
                view.scroll_into_view_if_needed()
                assert view.is_visible(), "the block-pool view did not render"
                view.screenshot(path=str(SCREENSHOTS / "pool_view_in_jupyterlab.png"))
            page.screenshot(path=str(SCREENSHOTS / f"jupyterlab_{name.split('_')[0]}.png"))
        browser.close()
    assert (SCREENSHOTS / "pool_view_in_jupyterlab.png").stat().st_size > 5_000
