"""`lwm play`'s page in a real headless browser: Debian's chromium (`make test` installs it as root) driven by
Playwright with no browser download. Load the page, press keys, see the frame change to the server's frame and the
counter advance, hold a key, undo, download the recording, close the tab mid-rollout."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_play import tiny_run

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

pytest.importorskip("starlette", reason="lwm play needs the play extra (starlette, uvicorn): pip install 'lwm[play]'")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CANVAS = """() => { const c = document.getElementById('frame');
                    return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }"""


def chromium() -> str:
    """Debian's chromium, or a skip that says why there is none."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.skip("no chromium: Debian's package, which `make test` installs where it runs as root with apt-get "
                    "(apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="Playwright (the dev extra) drives the browser")
    return path


class Server:
    """`lwm play`'s app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        from lwm.play.server import bind, url

        self.sock = bind("127.0.0.1", 0)
        self.url = url(self.sock)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def browser(playwright, tmp: Path, executable: str):
    """A headless chromium context with a fresh profile that accepts downloads."""
    return playwright.chromium.launch_persistent_context(
        str(tmp / "profile"), executable_path=executable, headless=True, args=CHROMIUM_FLAGS, accept_downloads=True)


def wait_on(page, condition: str, lines: list[str]) -> None:
    """``page.wait_for_function(condition)``; on a timeout, what the page and the server said."""
    from playwright.sync_api import TimeoutError

    try:
        page.wait_for_function(condition)
    except TimeoutError:
        said = page.evaluate("[document.getElementById('message').textContent, JSON.stringify(lwm.state), "
                             "lwm.stats.frames]")
        raise AssertionError(f"{condition}: not within 30 s; page message, state, frames: {said}; server: "
                             f"{lines}") from None


def wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_page_plays_records_and_frees_a_closed_tab(tmp_path):
    executable = chromium()
    from playwright.sync_api import sync_playwright

    from lwm.play.player import load_player
    from lwm.play.server import build_app

    ckpt, _, manifest = tiny_run(tmp_path)
    player = load_player(str(ckpt), [], str(manifest), None, None, False, hold_fps=0)
    lines: list[str] = []
    app = build_app(player, log=lines.append)
    with Server(app) as server, sync_playwright() as p:
        context = browser(p, tmp_path, executable)
        page = context.pages[0]  # the context's own tab: the only one, so the key presses go to it
        page.on("pageerror", lambda error: lines.append(f"page error: {error}"))
        page.goto(server.url)
        wait_on(page, "window.lwm.stats.frames >= 1", lines)
        sid = page.evaluate("lwm.hello.sid")
        session = app.state.sessions[sid]
        start = page.evaluate(CANVAS)
        assert page.inner_text("#keys").count("%") == len(player.number_keys)
        assert "true action 1 (up) -> code" in page.inner_text("#truekeys")

        page.keyboard.down("1")  # a tap of 50 ms is one step (unpaced, a held key would step every few ms)
        time.sleep(0.05)
        page.keyboard.up("1")
        wait_on(page, "lwm.stats.frames >= 2 && lwm.state.step === 1", lines)
        time.sleep(0.3)  # past the repeat delay
        assert page.evaluate("lwm.state.step") == 1 and page.inner_text("#counter") == "step 1"
        shown = np.array(page.evaluate(CANVAS), dtype=np.uint8).reshape(32, 32, 4)
        assert shown.tolist() != start
        assert np.array_equal(shown[..., :3], session.pixels())  # the server's frame, pixel for pixel
        assert session.rollout.actions[0].tolist() == list(player.number_keys[0].action)

        page.keyboard.down("ArrowUp")  # held: one step after another
        wait_on(page, "lwm.state.step >= 8", lines)
        page.keyboard.up("ArrowUp")
        time.sleep(0.3)
        steps = page.evaluate("lwm.state.step")
        assert page.evaluate("lwm.state.step") == steps == session.rollout.steps  # released: no more steps
        assert [a.tolist() for a in session.rollout.actions[1:]] == [list(player.arrow_keys[0].action)] * (steps - 1)
        page.keyboard.press("Backspace")
        wait_on(page, f"lwm.state.step === {steps - 1}", lines)
        wait_on(page, "lwm.stats.latencies.length >= 3", lines)
        assert all(0 < ms < 5000 for ms in page.evaluate("lwm.stats.latencies"))

        with page.expect_download() as download:
            page.click("#rec-json")
        recording = json.loads(Path(download.value.path()).read_text())
        assert recording["steps"] == steps - 1
        assert recording["action_indices"] == session.rollout.action_indices().tolist()
        with page.expect_download() as download:
            page.click("#rec-mp4")
        assert download.value.suggested_filename == f"lwm-play_ep_0000_0+{steps - 1}.mp4"
        assert Path(download.value.path()).read_bytes()[4:8] == b"ftyp"
        page.screenshot(path=str(tmp_path / "page.png"))

        page.keyboard.down("2")  # the tab closes mid-rollout: the server frees the session and goes on
        wait_on(page, f"lwm.state.step > {steps + 1}", lines)
        page.close()
        wait_for(lambda: not app.state.sessions)
        assert any(line.startswith(f"session {sid}: the page") and "freed (0 open)" in line for line in lines)
        again = context.new_page()
        again.goto(server.url)
        again.wait_for_function("window.lwm.stats.frames >= 1 && lwm.state.step === 0")
        assert len(app.state.sessions) == 1
        context.close()
