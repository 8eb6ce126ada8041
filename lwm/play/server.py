"""``lwm play``: the learned world on a local web page, played with the keyboard."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import secrets
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from lwm.play.player import Session
from lwm.utils.errors import ConfigError, LwmError

STATIC = Path(__file__).with_name("static")
HEADER = struct.Struct("<BBHHI")  # kind (0 frame, 1 preview), preview index, width, height, seq
FRAME, PREVIEW = 0, 1
PREVIEW_DELAY = 0.06  # seconds without a request before the previews are computed
OPS = ("step", "undo", "reset", "start", "world")


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse an address other machines can reach unless ``allow_remote``."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        remote, why = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback), ""
    except socket.gaierror as e:
        remote, why = [], f"not an address of this machine ({e.strerror})"
    if why or (remote and not allow_remote):
        raise ConfigError(f"--host {host}: {why or f'{remote[0]} is not a loopback address'}" + (
            "" if why else "; anyone who reaches it could play the checkpoint (--allow-remote to serve it anyway)"))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a port in use is one line."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it: no Nagle delay of
    # a reply's second message behind the first's delayed ACK (40 ms each on Linux)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--port {port}: already in use on {host} (another lwm play?); --port N for another, --port 0 "
                          f"for any free one" if e.errno == errno.EADDRINUSE else
                          f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.listen(64)
    return sock


def frame_message(pixels: np.ndarray, kind: int = FRAME, index: int = 0, seq: int = 0) -> bytes:
    """A frame for the page: :data:`HEADER`, then ``uint8 [S, S, 3]`` as RGBA bytes (what a canvas takes)."""
    H, W, _ = pixels.shape
    rgba = np.concatenate([pixels, np.full((H, W, 1), 255, dtype=np.uint8)], axis=2)
    return HEADER.pack(kind, index, W, H, seq) + rgba.tobytes()


def hello(session) -> dict:
    """What the page is built from: the keys, files, world choices and settings."""
    p = session.player
    return {"type": "hello", "sid": session.sid, "checkpoint": str(p.ckpt_path), "global_step": p.global_step,
            "codec": p.display.name, "codec_note": p.display.why, "window": p.window, "fps": p.fps,
            "hold_fps": p.hold_fps, "keys": [b.to_json() for b in p.bindings],
            "number_keys": len(p.number_keys), "worlds": p.world_choices(),
            "files": [{"name": f.path.name, "frames": f.frames} for f in p.files],
            "shape": [p.model.config.in_channels, p.model.config.height, p.model.config.width]}


def handle(session, message: dict) -> tuple[dict, bytes]:
    """Carry out one request of the page (under the session's lock): (the state, the frame message)."""
    op = message.get("op")
    if op not in OPS:
        raise ConfigError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    start = time.perf_counter()
    with session.lock:
        if op == "step":
            session.step(message.get("action"))
        elif op == "undo":
            session.undo()
        elif op == "reset":
            session.reset()
        elif op == "start":
            session.start(_int(message, "file"), _int(message, "frame"))
        else:
            session.set_world(str(message.get("mode")), _int(message, "index"), _int(message, "file"),
                              _int(message, "frame"))
        pixels = session.pixels()
        state = session.state()
    seq = _int(message, "seq")
    state.update(type="state", seq=seq, op=op, ms=1000 * (time.perf_counter() - start))
    return state, frame_message(pixels, FRAME, 0, seq)


def _int(message: dict, key: str) -> int:
    value = message.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise ConfigError(f"{key}: expected an integer >= 0, got {value!r}")
    return value


def preview(session, key: int) -> bytes:
    """Number key ``key``'s next frame, as a message."""
    with session.lock:
        pixels = session.previews(slice(key, key + 1))[0]
    return frame_message(pixels, PREVIEW, key)


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
        if session is None:
            return JSONResponse({"error": f"no session {sid} (its page was closed)"}, status_code=404)
        if ext not in ("json", "mp4", "gif"):
            return JSONResponse({"error": f"{ext}: a recording is .mp4, .gif or .json"}, status_code=404)
        with session.lock:
            name = f"lwm-play_{session.path.stem}_{session.frame}+{session.rollout.steps}.{ext}"
        disposition = {"Content-Disposition": f'attachment; filename="{name}"'}
        if ext == "json":
            with session.lock:
                body = json.dumps(session.recording(), indent=1)
            return Response(body, media_type="application/json", headers=disposition)
        data = await asyncio.to_thread(_video, session, f".{ext}")
        return Response(data, media_type="video/mp4" if ext == "mp4" else "image/gif", headers=disposition)

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
        reader = asyncio.create_task(_read(ws, inbox, WebSocketDisconnect))
        how = "the page closed"
        try:
            await ws.send_json(hello(session))
            state, frame = await asyncio.to_thread(handle, session, {"op": "reset"})
            await ws.send_json(state)
            await ws.send_bytes(frame)
            await _serve(ws, session, inbox)
        except (WebSocketDisconnect, RuntimeError, OSError):  # the page went away mid-reply
            how = "the page went away mid-rollout"
        finally:
            reader.cancel()
            sessions.pop(sid, None)
            log(f"session {sid}: {how} after {session.rollout.steps} steps; freed ({len(sessions)} open)")

    routes = [Route("/", index), Route("/record/{sid}.{ext}", record), WebSocketRoute("/ws", play),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    app = Starlette(routes=routes)
    app.state.sessions = sessions
    return app


def _video(session, suffix: str) -> bytes:
    with session.lock:
        return session.video(suffix)


async def _read(ws, inbox: asyncio.Queue, disconnect: type) -> None:
    """The page's requests into ``inbox`` (None once it closes; a request that is not JSON: a string, its error)."""
    try:
        while True:
            text = await ws.receive_text()
            try:
                message = json.loads(text)
                await inbox.put(message if isinstance(message, dict) else f"not a JSON object: {text[:80]}")
            except ValueError:
                await inbox.put(f"not JSON: {text[:80]}")
    except (disconnect, RuntimeError, KeyError):
        await inbox.put(None)


async def _previews(ws, session, inbox: asyncio.Queue) -> bool:
    """Send the number keys' previews one by one, stopping at the page's next request (a key press waits for one
    preview at most)."""
    for key in range(len(session.player.number_keys)):
        if not inbox.empty():
            return True
        try:
            frame = await asyncio.to_thread(preview, session, key)
        except Exception as e:
            traceback.print_exc()
            await ws.send_json({"type": "error", "message": f"previews: {type(e).__name__}: {e}"})
            return False
        await ws.send_bytes(frame)
    return False


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
        except LwmError as e:  # a request the session refuses: said on the page
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

    def interrupt(signum, frame):  # uvicorn re-raises the SIGINT it stopped on; asyncio's own handler may drop it
        raise KeyboardInterrupt

    config = uvicorn.Config(app, log_level="warning", ws_max_size=1 << 20, lifespan="off")
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, previous)


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
