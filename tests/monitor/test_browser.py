"""The dashboard page and the report as a person sees them: a live run's rlhfflow page and
a finished run's report opened in headless Chromium (the system's ``chromium``, driven by
Playwright), checking that the plots are drawn, not just that the HTML is there.

``RLHFFLOW_SCREENSHOTS=docs/images pytest tests/monitor/test_browser.py`` also refreshes the
screenshots in docs/images.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhfflow.monitor.report import write_report
from tests.conftest import REPO, small_pipeline

pytestmark = pytest.mark.slow

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p), None)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium, or a skip saying what is missing."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed "
                                   "(pip install 'rlhfflow[test]')")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox cannot start
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox"])
        yield chromium
        chromium.close()


def coloured_pixels(png: bytes) -> int:
    """Pixels of a screenshot that are clearly coloured (plotted lines, bars), not the
    white, black and grey of an empty frame, its axes, grid and text."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for r, g, b in image.getdata() if max(r, g, b) - min(r, g, b) > 60)


def _save(png: bytes, name: str, tmp_path: Path) -> None:
    (tmp_path / name).write_bytes(png)
    target = os.environ.get("RLHFFLOW_SCREENSHOTS")
    if target:  # for docs/images: 256 colours keep the files small
        import io

        from PIL import Image

        Path(target).mkdir(parents=True, exist_ok=True)
        image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256)
        image.save(Path(target) / name, optimize=True)


def _read_until(process: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    """Read the run's output lines until one matches ``pattern``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} in the run's output:\n"
                         + "".join(seen))


def test_live_run_page_and_report_draw_their_plots(browser, tmp_path):
    path = small_pipeline(tmp_path, "grpo", iterations=60, batch_size=4,
                          overrides={"cluster.workers": 2})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", str(path)],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env=env, cwd=tmp_path)
    try:
        url = _read_until(process, r"rlhfflow page: (\S+)", 180)[1]
        _read_until(process, r"\s3/60\s", 240)  # a few iterations on the page
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(url)
        # the header names the iteration once the page has drawn the published ones
        page.get_by_text(re.compile(r"iteration \d+ of 60")).wait_for(timeout=30_000)
        time.sleep(1.5)  # the canvases paint after the data arrives
        # Bokeh paints each plot on a stack of canvases (one per layer): one box per plot
        canvases = page.locator("canvas")
        found = {tuple(round(v) for v in box.values()) for box in
                 (canvases.nth(i).bounding_box() for i in range(canvases.count()))
                 if box and box["width"] > 200 and box["height"] > 100}
        # the page redraws as iterations arrive: a layer caught mid-relayout may sit a few
        # pixels off its plot's others; boxes whose top-left corners are that close are
        # one plot
        boxes: list[tuple[int, ...]] = []
        for box in sorted(found):
            if not any(abs(box[0] - b[0]) < 30 and abs(box[1] - b[1]) < 30 for b in boxes):
                boxes.append(box)
        keys = ("x", "y", "width", "height")
        # the plots run below the viewport: clip the full page (at scroll 0 the boxes'
        # viewport coordinates are the page's)
        drawn = [coloured_pixels(page.screenshot(full_page=True,
                                                 clip=dict(zip(keys, box, strict=True))))
                 for box in sorted(boxes, key=lambda b: (b[1], b[0]))]
        # reward, KL, length, staleness, stage time, busy, and each figure the stages
        # declare that has a value in this run (generate's tokens/s and rows migrated;
        # not its speculative-decoding figures, which a run that does not draft leaves
        # empty): each has its coloured lines
        assert len(drawn) == 8 and all(n > 100 for n in drawn), drawn
        _save(page.screenshot(full_page=True), "dashboard.png", tmp_path)
        page.close()
    finally:
        process.send_signal(signal.SIGINT)  # finish the iteration in flight, then stop
        try:
            process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()

    report = write_report(tmp_path / "out", tmp_path / "report.html", iterations=[2])
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(report.as_uri())
    images = page.locator("img")
    assert images.count() == 4  # curves, stage time, busy fractions, one timeline
    for i in range(images.count()):
        width = images.nth(i).evaluate("img => img.complete ? img.naturalWidth : 0")
        assert width > 300
        assert coloured_pixels(images.nth(i).screenshot()) > 100
    assert page.locator("table.samples pre").count() > 0
    page.evaluate("window.scrollTo(0, 0)")  # the element screenshots scrolled it
    _save(page.screenshot(), "report.png", tmp_path)  # its first screen
    page.close()
