"""``lwm play``: the learned world on a local web page, one KV-cached frame per key press."""

from __future__ import annotations

from lwm.play.player import load_player
from lwm.play.server import bind, build_app, check_host, serve, url
from lwm.utils.args import ArgumentParser, bounded, MAX_FPS


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="lwm play", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_path", required=True, help="a checkpoint of `lwm fit`, or a run's folder (its latest)")
    files = p.add_mutually_exclusive_group()
    files.add_argument("--data", action="append", default=[], help="an h5 file to start from (repeat for more; "
                       "default: the --manifest's files, else the manifest the checkpoint trained on)")
    files.add_argument("--manifest", help="a manifest whose files the page starts from")
    p.add_argument("--codes", help="code dictionary (default: codes.pt beside the checkpoint)")
    p.add_argument("--vae", help="the VAE's local diffusers weights, to decode files encoded with a VAE")
    p.add_argument("--vae-tiling", action="store_true", help="the VAE decodes in overlapping spatial tiles")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (loopback only, unless --allow-remote)")
    p.add_argument("--allow-remote", action="store_true",
                   help="serve on a --host other machines can reach (anyone there can play the checkpoint)")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="port (0: any free one)")
    p.add_argument("--hold-fps", type=bounded(float, 0, MAX_FPS), default=30.0,
                   help="frames per second while a key is held (0: as fast as the model makes them)")
    args = p.parse_args(argv)
    import starlette, uvicorn  # noqa: F401, E401  (the play extra, pip install 'lwm[play]': before the model loads)
    check_host(args.host, args.allow_remote)
    sock = bind(args.host, args.port)  # a port in use: said before the model loads
    try:
        player = load_player(args.ckpt_path, args.data, args.manifest, args.codes, args.vae, args.vae_tiling,
                             args.hold_fps)
        app = build_app(player)
        keys = ", ".join(b.label for b in player.arrow_keys) or "none (the data has no true actions)"
        shown = f"frames shown as {player.display.name}" + (f" ({player.display.why})" if player.display.why else "")
        print(f"lwm play: {url(sock)}  (checkpoint {player.ckpt_path}, step {player.global_step}; "
              f"{len(player.files)} files; {shown}; arrow keys: {keys}; Ctrl-C stops)", flush=True)
        serve(app, sock)
    finally:
        sock.close()
    return 0
