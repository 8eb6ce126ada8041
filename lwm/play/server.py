"""``lwm play``: the learned world on a local web page, played with the keyboard."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import json
import os
import secrets
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from lwm.play.player import Session, WORLD_MODES
from lwm.utils.errors import ConfigError, LwmError

STATIC = Path(__file__).with_name("static")
HEADER = struct.Struct("<BBHHI")  # kind (0 frame, 1 preview), preview index, width, height, seq
FRAME, PREVIEW = 0, 1
PREVIEW_DELAY = 0.06  # seconds without a request before the previews are computed
OPS = {"step": (), "undo": (), "reset": (), "start": ("file", "frame"), "world": ("index", "file", "frame")}  # ints
RECORDINGS = {"json": "application/json", "mp4": "video/mp4", "gif": "image/gif"}


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse an address other machines can reach unless ``allow_remote``."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    remote = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if remote and not allow_remote:
        raise ConfigError(f"--host {host}: {remote[0]} is not a loopback address; anyone who reaches it could play the "
                          "checkpoint (--allow-remote to serve it anyway)")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a port in use is one line."""
    try:
        sock = socket.create_server((host, port), family=socket.getaddrinfo(host, port)[0][0], backlog=64)
    except OSError as e:
        raise ConfigError(f"--port {port}: already in use on {host} (another lwm play?); --port N for another, "
                          f"--port 0 for any free one" if e.errno == errno.EADDRINUSE else
                          f"--host {host} --port {port}: cannot listen there ({os.strerror(e.errno)})") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK wait on a reply's 2nd message
    return sock


def frame_message(pixels: np.ndarray, kind: int = FRAME, index: int = 0, seq: int = 0) -> bytes:
    """A frame for the page: :data:`HEADER`, then ``uint8 [S, S, 3]`` as RGBA bytes (what a canvas takes)."""
    H, W, _ = pixels.shape
    return HEADER.pack(kind, index, W, H, seq) + np.pad(pixels, ((0, 0), (0, 0), (0, 1)), constant_values=255).tobytes()


def hello(session) -> dict:
    """What the page is built from: the keys, files, world choices and settings."""
    p, c = session.player, session.player.model.config
    return {"type": "hello", "sid": session.sid, "checkpoint": str(p.ckpt_path), "global_step": p.global_step,
            "codec": p.display.name, "codec_note": p.display.why, "window": p.window, "fps": p.fps,
            "hold_fps": p.hold_fps, "keys": [asdict(b) for b in [*p.number_keys, *p.arrow_keys, p.noop_key]],
            "number_keys": len(p.number_keys),
            "worlds": p.world_choices(), "files": [{"name": f.path.name, "frames": f.frames} for f in p.files],
            "shape": [c.in_channels, c.height, c.width]}


def refusal(session, message: dict) -> str | None:
    """Why the page's request cannot be carried out, in one line naming the field; None where it can."""
    op, p = message.get("op"), session.player
    if op not in OPS:
        return f"op: expected one of {', '.join(OPS)}, got {op!r}"
    for key in ("seq", *OPS[op]):
        value = message.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            return f"{key}: expected an integer >= 0, got {value!r}"
    file, frame, index, mode = message.get("file", 0), message.get("frame", 0), message.get("index", 0), \
        str(message.get("mode"))
    if op == "step":
        try:  # decode_indices checks the levels, the type and the range
            p.model.quantizers["Action_Encoder"].decode_indices(torch.tensor(message.get("action"))[None])
        except (TypeError, ValueError, RuntimeError) as e:  # (torch.tensor of text, None: TypeError, RuntimeError)
            return f"action {message.get('action')!r}: {e}"
    if op == "world" and (mode not in WORLD_MODES or mode == "dictionary" and index >= len(p.world_choices())):
        return (f"world: mode {mode!r}, index {index}: the page offers the modes {', '.join(WORLD_MODES)}, and "
                f"dictionary tuples 0..{len(p.world_choices()) - 1}")
    if (op == "start" or op == "world" and mode == "clip") and not (
            file < len(p.files) and frame < p.files[file].frames):
        has = f"; {p.files[file].path} frames 0..{p.files[file].frames - 1}" if file < len(p.files) else ""
        return f"file {file} frame {frame}: the page has files 0..{len(p.files) - 1}{has}"
    return None


def handle(session, message: dict) -> tuple[dict, bytes]:
    """Carry out one request of the page (under the session's lock): (the state, the frame message)."""
    if why := refusal(session, message):
        raise ConfigError(why)
    op, start, get = message["op"], time.perf_counter(), lambda key: message.get(key, 0)
    with session.lock:
        {"step": lambda: session.step(message["action"]), "undo": session.undo, "reset": session.reset,
         "start": lambda: session.start(get("file"), get("frame")),
         "world": lambda: session.set_world(str(message.get("mode")), get("index"), get("file"), get("frame"))}[op]()
        pixels, state = session.pixels(), session.state()
    state.update(type="state", seq=get("seq"), op=op, ms=1000 * (time.perf_counter() - start))
    return state, frame_message(pixels, FRAME, 0, get("seq"))


def build_app(player, log=None):
    """The Starlette app of ``player``: the page, its WebSocket and the recordings."""
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route, WebSocketRoute
    from starlette.staticfiles import StaticFiles
    from starlette.websockets import WebSocketDisconnect
    log = log or (lambda line: print(f"lwm play: {line}", file=sys.stderr, flush=True))
    sessions: dict[str, Session] = {}

    async def index(request):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def record(request):
        sid, ext = request.path_params["sid"], request.path_params["ext"]
        session = sessions.get(sid)
        if session is None or ext not in RECORDINGS:
            return JSONResponse({"error": f"no session {sid} (its page was closed)" if session is None else
                                 f"{ext}: a recording is .mp4, .gif or .json"}, status_code=404)

        def body() -> tuple[str, bytes | str]:
            with session.lock:
                return (f"lwm-play_{session.path.stem}_{session.frame}+{session.rollout.steps}.{ext}",
                        json.dumps(session.recording(), indent=1) if ext == "json" else session.video(f".{ext}"))

        name, content = await asyncio.to_thread(body)
        return Response(content, media_type=RECORDINGS[ext],
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    async def play(ws):
        await ws.accept()
        sid = secrets.token_hex(6)
        try:
            session = await asyncio.to_thread(Session, player, sid)
        except LwmError as e:
            await ws.send_json({"type": "error", "message": str(e)})
            await ws.close()
            return
        sessions[sid] = session
        log(f"session {sid} opened ({len(sessions)} open)")
        inbox: asyncio.Queue = asyncio.Queue()
        inbox.put_nowait({"op": "reset"})  # the first frame, answered as a request
        reader = asyncio.create_task(_read(ws, inbox))
        how = "the page closed"
        try:
            await ws.send_json(hello(session))
            await _serve(ws, session, inbox)
        except (WebSocketDisconnect, RuntimeError, OSError):  # the page went away mid-reply
            how = "the page went away mid-rollout"
        finally:
            reader.cancel()
            sessions.pop(sid, None)
            log(f"session {sid}: {how} after {session.rollout.steps} steps; freed ({len(sessions)} open)")

    app = Starlette(routes=[Route("/", index), Route("/record/{sid}.{ext}", record), WebSocketRoute("/ws", play),
                            Mount("/static", StaticFiles(directory=STATIC), name="static")])
    app.state.sessions = sessions
    return app


async def _read(ws, inbox: asyncio.Queue) -> None:
    """The page's requests into ``inbox`` (a string: why one is not a JSON object; None once the page closes)."""
    with contextlib.suppress(RuntimeError, KeyError):  # (a binary message: KeyError)
        async for text in ws.iter_text():  # (until the page closes)
            try:
                message = json.loads(text)
                inbox.put_nowait(message if isinstance(message, dict) else f"not a JSON object: {text[:80]}")
            except ValueError:
                inbox.put_nowait(f"not JSON: {text[:80]}")
    inbox.put_nowait(None)


async def _previews(ws, session, inbox: asyncio.Queue) -> bool:
    """Send the number keys' next frames one by one until the page's next request (True: cut short by it)."""
    for key in range(len(session.player.number_keys)):
        if not inbox.empty():
            return True
        try:
            pixels = await asyncio.to_thread(_preview, session, key)
        except Exception as e:
            traceback.print_exc()
            await ws.send_json({"type": "error", "message": f"previews: {type(e).__name__}: {e}"})
            return False
        await ws.send_bytes(frame_message(pixels, PREVIEW, key))
    return False


def _preview(session, key: int) -> np.ndarray:
    with session.lock:
        return session.previews(slice(key, key + 1))[0]


async def _serve(ws, session, inbox: asyncio.Queue) -> None:
    """Answer the page's requests in order; when idle, send the previews once."""
    due = True  # previews not yet sent for this state
    while True:
        try:
            message = await (asyncio.wait_for(inbox.get(), PREVIEW_DELAY) if due else inbox.get())
        except asyncio.TimeoutError:
            due = await _previews(ws, session, inbox)
            continue
        if message is None:
            return
        if isinstance(message, str):  # not a JSON object
            await ws.send_json({"type": "error", "message": message, "seq": None})
            continue
        try:
            state, frame = await asyncio.to_thread(handle, session, message)
        except LwmError as e:  # a request refused: said on the page
            await ws.send_json({"type": "error", "message": str(e), "seq": message.get("seq")})
            continue
        except Exception as e:  # a failure of ours
            traceback.print_exc()
            await ws.send_json({"type": "error", "message": f"internal error: {type(e).__name__}: {e}"})
            continue
        await ws.send_json(state)
        await ws.send_bytes(frame)
        due = True


def serve(app, sock: socket.socket) -> None:
    """Run ``app`` on the listening ``sock`` until Ctrl-C."""
    import uvicorn
    # uvicorn re-raises the SIGINT it stopped on; asyncio.run swaps Python's default handler for its own, which may
    # drop it, so a copy of the default one (it raises KeyboardInterrupt)
    previous = signal.signal(signal.SIGINT, functools.partial(signal.default_int_handler))
    try:
        config = uvicorn.Config(app, log_level="warning", ws_max_size=1 << 20, lifespan="off")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, previous)


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
