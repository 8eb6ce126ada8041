"""`lwm play` measured in a real browser: key press to frame on screen, and frames per second while a key is held.

    .venv/bin/python benchmarks/play.py --ckpt_path runs/demo/run [--manifest M | --data FILE.h5] [--presses 100]
                                        [--hold 5] [--screenshot docs/play.png] [--json OUT]

Starts the real command (``lwm play --port 0``) and Debian's headless chromium (Playwright, no browser download).
The page itself times each key press: from the keydown event's time stamp to the first animation frame after the
frame is drawn (``window.lwm.stats``, what the page's HUD shows). Presses are single key strokes cycling over the
number keys, 200 ms apart (the server computes the keys' previews between them, as it does for a person); then a key
is held for ``--hold`` seconds at the page's pace (``--hold-fps``, 30 by default) and again unpaced (as fast as the
model makes frames). Prints a table (medians and 95th percentiles) with the date, the machine and its load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GAP_S = 0.2  # between single key presses


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``lwm play`` on a free port: (the process, the URL it printed)."""
    data = ["--manifest", args.manifest] if args.manifest else [a for d in args.data for a in ("--data", d)]
    command = [sys.executable, "-m", "lwm.cli", "play", "--ckpt_path", args.ckpt_path, *data, "--port", "0",
               "--hold-fps", str(args.hold_fps)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if not line.startswith("lwm play: http"):
        proc.kill()
        sys.exit(f"lwm play did not start: {line or 'no output'}")
    return proc, line.split()[2]


def presses(page, n: int) -> list[float]:
    """Latencies (ms) of ``n`` single key presses over the number keys."""
    keys = [k["keys"][0] for k in page.evaluate("lwm.hello.keys")[: page.evaluate("lwm.hello.number_keys")]]
    before = page.evaluate("lwm.stats.latencies.length")
    for i in range(n):
        page.keyboard.press(keys[i % len(keys)])
        page.wait_for_function(f"lwm.stats.latencies.length >= {before + i + 1}")
        time.sleep(GAP_S)
    return page.evaluate(f"lwm.stats.latencies.slice({before})")


def hold(page, key: str, seconds: float, hold_fps: float) -> tuple[float, list[float]]:
    """Hold ``key`` for ``seconds`` at ``hold_fps`` (0: unpaced): (frames shown per second, the model's ms per step)."""
    page.evaluate(f"lwm.hello.hold_fps = {hold_fps}")
    before = page.evaluate("lwm.stats.shown.length")
    page.keyboard.down(key)
    page.wait_for_function(f"lwm.stats.shown.length > {before + 1}")  # past the key's repeat delay: held
    start = page.evaluate("performance.now()")
    model_ms = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        model_ms.append(page.evaluate("lwm.state.ms"))
        time.sleep(0.1)
    end = page.evaluate("performance.now()")
    shown = page.evaluate(f"lwm.stats.shown.filter((t) => t >= {start} && t <= {end}).length")
    page.keyboard.up(key)
    return shown / ((end - start) / 1000), model_ms


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    return f"{os.cpu_count()}-core {model}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_path", default="runs/demo/run", help="a run or checkpoint (default: `make demo`'s)")
    p.add_argument("--manifest")
    p.add_argument("--data", action="append", default=[])
    p.add_argument("--presses", type=int, default=100)
    p.add_argument("--hold", type=float, default=5.0, help="seconds each key is held")
    p.add_argument("--hold-fps", type=float, default=30.0, help="the page's pace while a key is held")
    p.add_argument("--screenshot", help="a PNG of the page after the presses")
    p.add_argument("--json", help="write the numbers here too")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or "/usr/bin/chromium"
    load = os.getloadavg()
    proc, url = start_server(args)
    try:
        with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(profile, executable_path=executable, headless=True,
                                                            args=CHROMIUM_FLAGS, viewport={"width": 1200, "height": 720})
            page = context.new_page()
            page.goto(url)
            page.wait_for_function("window.lwm.stats.frames >= 1")
            latencies = presses(page, args.presses)
            if args.screenshot:  # from the start frame again, three steps in (the previews drawn)
                page.keyboard.press("r")
                page.wait_for_function("lwm.state.step === 0")
                for key in ("1", "2", "1"):
                    page.keyboard.press(key)
                    time.sleep(GAP_S)
                page.wait_for_function("lwm.state.step === 3")
                time.sleep(1.0)
                page.screenshot(path=args.screenshot)
            key = "ArrowUp" if page.evaluate("lwm.hello.keys.length") > page.evaluate("lwm.hello.number_keys") + 1 \
                else "1"
            paced, paced_ms = hold(page, key, args.hold, args.hold_fps)
            time.sleep(0.3)
            unpaced, unpaced_ms = hold(page, key, args.hold, 0)
            context.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lat = np.array(latencies)
    result = {
        "date": datetime.date.today().isoformat(), "machine": machine(), "load_before": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()], "checkpoint": args.ckpt_path,
        "presses": len(lat), "latency_median_ms": float(np.median(lat)), "latency_p95_ms": float(np.percentile(lat, 95)),
        "hold_fps": args.hold_fps, "held_fps_paced": paced, "held_fps_unpaced": unpaced,
        "model_ms_median": float(np.median(paced_ms + unpaced_ms)),
    }
    print(f"lwm play in {Path(executable).name} (headless), {result['date']}, {result['machine']}, load average "
          f"{load[0]:.1f} before / {result['load_after'][0]:.1f} after; checkpoint {args.ckpt_path}\n")
    print("| measure | value | target |\n|---|---|---|")
    print(f"| key press -> frame on screen, median ({len(lat)} presses) | {result['latency_median_ms']:.1f} ms | <= 50 ms |")
    print(f"| key press -> frame on screen, p95 | {result['latency_p95_ms']:.1f} ms | <= 100 ms |")
    print(f"| frames/s while a key is held (--hold-fps {args.hold_fps:g}) | {paced:.1f} | >= 25 |")
    print(f"| frames/s while a key is held (unpaced, --hold-fps 0) | {unpaced:.1f} | |")
    print(f"| the server's time per step (model + decode), median | {result['model_ms_median']:.1f} ms | |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
