"""`lwm play` without a browser: a step is the frame `WorldModel.generate` makes with the same codes, bit for bit
(past the trained window too); undo restores the state before; a recording replays through `lwm generate
--action-indices/--world-indices` to the same frames; the WebSocket API answers with those frames, refuses bad
requests in one line and frees a session whose page closed; bad input to the command is one line."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import h5py
import imageio.v3 as iio
import numpy as np
import pytest
import torch

from lwm.cli.main import main
from lwm.play import rollout as rollout_module
from lwm.play.player import Session, load_player
from lwm.play.server import HEADER, PREVIEW, build_app, frame_message
from tests.lightning.helpers import REPO, run

pytest.importorskip("starlette", reason="lwm play needs the play extra (starlette, uvicorn): pip install 'lwm[play]'")


def tiny_run(tmp):
    """A 3-step tiny run on 6 episodes of the synthetic world (pixel codec, true actions): (checkpoint, its first
    data file, the manifest)."""
    from lwm.data.synth import make_dataset

    manifest = make_dataset(tmp / "data", episodes=6, frames=14, size=32)  # latents [16, 16, 16]
    assert run(manifest, tmp / "run", "--trainer.max_steps=3", "--data.val_size_percent=0",
               "--model.net.in_channels=16") == 0  # data.window 6: the predictor attends to 5 frames
    return tmp / "run/checkpoints/last.ckpt", tmp / "data/ep_0000.h5", manifest


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("play"))


@pytest.fixture(scope="module")
def player(trained):
    ckpt, _, manifest = trained
    return load_player(str(ckpt), [], str(manifest), None, None, False, hold_fps=30)


def _generate(player, session) -> torch.Tensor:
    """`WorldModel.generate` from the session's start frame with its codes: ``[steps, C, H, W]``."""
    model, r = player.model, session.rollout
    with torch.no_grad():
        actions = model.quantizers["Action_Encoder"].decode_indices(r.action_indices()[None])
        world = model.quantizers["World_Encoder"].decode_indices(r.world_indices[None])
        return model.generate(r.frames[0][None, None], actions, world, r.steps, window=player.window)[0]


def _play(session, keys) -> None:
    for b in keys:
        session.step(list(b.action))


def test_steps_are_generates_frames_bit_for_bit_past_the_window(player):
    session = Session(player, "s")
    keys = player.number_keys + player.arrow_keys
    _play(session, [keys[i % len(keys)] for i in range(13)])  # 13 steps slide a 5-frame window
    assert player.window == 5 and session.rollout.steps == 13
    assert torch.equal(session.rollout.latents()[1:], _generate(player, session))
    assert np.array_equal(session.pixels(), player.display.decoder.decode(_generate(player, session)[-1:].numpy())[0])


def test_the_world_is_the_start_clips_own_and_the_keys_come_from_the_data(player, trained):
    ckpt, data, _ = trained
    session = Session(player, "s")
    with h5py.File(data) as f:
        clip = torch.from_numpy(np.asarray(f["latents"][:6], dtype=np.float32))[None]
    assert session.rollout.world_indices.tolist() == player.model.encode_world(clip).indices[0].tolist()
    counts = player.dictionaries["Action_Encoder"].counts
    assert [b.keys for b in player.number_keys] == [(str(i + 1),) for i in range(min(9, len(counts)))]
    assert player.number_keys[0].share == pytest.approx(float(counts.max()) / float(counts.sum()))
    # the synthetic world names its actions: arrows are up, down, left, right; Space its "stay"
    assert [b.keys for b in player.arrow_keys] == [("ArrowUp", "w"), ("ArrowDown", "s"), ("ArrowLeft", "a"),
                                                   ("ArrowRight", "d")]
    assert [b.label.split(" ->")[0] for b in player.arrow_keys] == [
        "true action 1 (up)", "true action 2 (down)", "true action 3 (left)", "true action 4 (right)"]
    assert player.noop_key.keys == (" ",) and player.noop_key.label.startswith("true action 0 (stay)")


def test_true_action_keys_are_the_codes_that_most_often_go_with_them(player):
    from collections import Counter

    from lwm.play.controls import cooccurrence

    counts = cooccurrence(player.model, [f.path for f in player.files], player.trained, player.device)
    by_hand: dict[int, Counter] = {}
    for file in player.files:
        with h5py.File(file.path) as f:
            clip = torch.from_numpy(np.asarray(f["latents"], dtype=np.float32))[None]
            true = f["actions"][:-1].tolist()
        codes = player.model.encode_actions(clip, window=player.trained).indices[0].tolist()
        for a, c in zip(true, codes):
            by_hand.setdefault(a, Counter())[tuple(c)] += 1
    assert counts == by_hand
    up = by_hand[1].most_common(1)[0]
    assert player.arrow_keys[0].action == up[0] and player.arrow_keys[0].share == up[1] / sum(by_hand[1].values())


def test_undo_restores_the_state_before(player, monkeypatch):
    monkeypatch.setattr(rollout_module, "RECENT", 2)  # undo past the kept caches: re-fed from a keyframe
    monkeypatch.setattr(rollout_module, "KEYFRAME_EVERY", 4)
    keys = player.number_keys
    session = Session(player, "s")
    _play(session, [keys[0]] * 3)
    before = session.rollout.latents().clone()
    _play(session, [keys[1]] * 7)
    assert not torch.equal(session.rollout.latents()[:4], session.rollout.latents()[:4] * 0)
    for _ in range(7):
        assert session.undo()
    assert torch.equal(session.rollout.latents(), before) and session.state()["step"] == 3
    _play(session, [keys[-1]] * 6)  # stepping on after undo: as if the undone steps never were
    fresh = Session(player, "t")
    _play(fresh, [keys[0]] * 3 + [keys[-1]] * 6)
    assert torch.equal(session.rollout.latents(), fresh.rollout.latents())
    assert torch.equal(session.rollout.latents()[1:], _generate(player, session))
    while session.undo():
        pass
    assert session.rollout.steps == 0 and not session.undo()


def test_a_recording_replays_through_lwm_generate_to_the_same_frames(player, trained, tmp_path):
    ckpt, data, _ = trained
    session = Session(player, "s")
    session.set_world("dictionary", index=0)  # a world other than the clip's, given back as --world-indices
    session.start(0, 3)
    keys = player.number_keys + player.arrow_keys
    _play(session, [keys[(3 * i) % len(keys)] for i in range(9)])
    recording = session.recording()
    assert recording["action_indices"] == session.rollout.action_indices().tolist()
    assert recording["world_indices"] == player.world_choices()[0]["indices"]
    argv = shlex.split(recording["command"])
    assert argv[:2] == ["lwm", "generate"]
    assert main([*argv[1:], "--out", str(tmp_path / "replay.gif")]) == 0
    with h5py.File(tmp_path / "replay.gif.h5") as f:
        replayed = torch.from_numpy(f["latents"][0])  # [1 + steps, C, H, W]
    assert torch.equal(replayed, session.rollout.latents())


def test_changing_the_world_or_the_start_restarts_the_rollout(player):
    session = Session(player, "s")
    _play(session, player.number_keys[:2])
    session.set_world("clip", file=0, frame=4)
    assert session.rollout.steps == 0 and session.world_mode == "clip"
    assert session.rollout.world_indices.tolist() == player.infer_world(0, 4).tolist()
    session.start(0, 2)  # a picked world stays
    assert session.rollout.world_indices.tolist() == player.infer_world(0, 4).tolist()
    with h5py.File(player.files[0].path) as f:
        assert np.array_equal(session.rollout.frames[0].numpy(), np.asarray(f["latents"][2], dtype=np.float32))
    session.set_world("own")
    assert session.rollout.world_indices.tolist() == player.infer_world(0, 2).tolist()


# ---------------------------------------------------------------------------------------------- the WebSocket API
def _next(ws):
    """The next message that is not a preview (sent whenever the server is idle): a dict (JSON) or bytes."""
    while True:
        message = ws.receive()
        if message.get("text") is not None:
            return json.loads(message["text"])
        if message["bytes"][0] != PREVIEW:
            return message["bytes"]


def _reply(ws):
    state, frame = _next(ws), _next(ws)
    assert state["type"] == "state" and isinstance(frame, bytes), state
    return state, frame


@pytest.mark.slow
def test_the_api_answers_each_request_with_its_frame(player):
    from starlette.testclient import TestClient

    app = build_app(player, log=lambda line: None)
    with TestClient(app) as client, client.websocket_connect("/ws") as ws:
        hello = ws.receive_json()
        assert hello["type"] == "hello" and hello["shape"] == [16, 16, 16] and hello["codec"] == "pixel"
        assert [k["keys"] for k in hello["keys"]][-1] == [" "]
        state, first = _reply(ws)
        assert state["step"] == 0 and HEADER.unpack(first[:HEADER.size]) == (0, 0, 32, 32, 0)
        session = app.state.sessions[hello["sid"]]
        frames = [first]
        for seq, key in enumerate(hello["keys"][:5], start=1):
            ws.send_text(json.dumps({"op": "step", "action": key["action"], "seq": seq}))
            state, frame = _reply(ws)
            assert state["seq"] == seq and state["step"] == seq and state["last_action"] == key["action"]
            expected = player.display.decoder.decode(_generate(player, session)[-1:].numpy())[0]
            assert frame == frame_message(expected, seq=seq)  # the page's pixels are generate's frame decoded
            frames.append(frame)
        ws.send_text(json.dumps({"op": "undo", "seq": 9}))
        state, frame = _reply(ws)
        assert state["step"] == 4 and frame[HEADER.size:] == frames[4][HEADER.size:]
        for message, error in [({"op": "jump"}, "op: expected one of step, undo, reset, start, world, got 'jump'"),
                               ({"op": "step", "action": [99, 0]}, "action [99, 0]: indices: level 0 takes codes 0..3"),
                               ({"op": "step", "action": "up"}, "action 'up': "),
                               ({"op": "start", "file": 0, "frame": 99}, "file 0 frame 99: the page has files 0..5; "),
                               ({"op": "start", "file": 7}, "file 7 frame 0: the page has files 0..5"),
                               ({"op": "world", "mode": "other"}, "world: mode 'other'")]:
            ws.send_text(json.dumps(message))
            reply = _next(ws)
            assert reply["type"] == "error" and error in reply["message"], reply
        ws.send_text("{not json")
        assert _next(ws)["message"].startswith("not JSON")
        ws.send_text(json.dumps({"op": "step", "action": hello["keys"][0]["action"], "seq": 10}))
        assert _reply(ws)[0]["step"] == 5  # refusals leave the session as it was
        previews = [ws.receive_bytes() for _ in range(hello["number_keys"])]  # idle: the next frame under each key
        assert [HEADER.unpack(p[:HEADER.size])[:2] for p in previews] == [(1, i) for i in range(hello["number_keys"])]
        with torch.no_grad():
            expected = session.rollout.previews(torch.tensor([k["action"] for k in hello["keys"][:hello["number_keys"]]]))
        assert previews[2][HEADER.size:] == frame_message(player.display.decoder.decode(expected[2:3].numpy())[0])[HEADER.size:]

        recording = client.get(f"/record/{hello['sid']}.json")
        assert recording.headers["content-disposition"] == 'attachment; filename="lwm-play_ep_0000_0+5.json"'
        assert recording.json()["action_indices"] == session.rollout.action_indices().tolist()
        video = client.get(f"/record/{hello['sid']}.gif")
        frames = iio.imread(video.content, index=None, extension=".gif")
        assert frames.shape == (6, 256, 256, 3)  # the start frame and 5 steps, enlarged 8x
        last = player.display.decoder.decode(session.rollout.latents()[-1:].numpy())[0]
        assert np.abs(frames[-1][::8, ::8].astype(int) - last).mean() < 8  # (GIF's 256-colour palette)
        assert client.get(f"/record/{hello['sid']}.mp4").content[4:8] == b"ftyp"
    assert client.get("/record/nope.json").status_code == 404


def test_a_page_closed_mid_rollout_frees_its_session_and_the_server_goes_on(player):
    from starlette.testclient import TestClient

    lines = []
    app = build_app(player, log=lines.append)
    with TestClient(app) as client:
        with client.websocket_connect("/ws") as ws:
            hello = ws.receive_json()
            _reply(ws)
            for seq in range(1, 4):  # requests the server is still answering when the page goes
                ws.send_text(json.dumps({"op": "step", "action": hello["keys"][0]["action"], "seq": seq}))
        deadline = time.monotonic() + 10
        while app.state.sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.state.sessions == {}
        assert any(line.startswith(f"session {hello['sid']}: the page") and "freed (0 open)" in line for line in lines)
        assert client.get(f"/record/{hello['sid']}.json").status_code == 404
        with client.websocket_connect("/ws") as ws:  # a new page plays on
            assert ws.receive_json()["type"] == "hello"
            assert _reply(ws)[0]["step"] == 0


# ---------------------------------------------------------------------------------------------- bad input
def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_a_checkpoint_without_a_code_dictionary_says_how_to_make_one(trained, tmp_path, capsys):
    ckpt, data, _ = trained
    lone = tmp_path / "lone.ckpt"
    lone.write_bytes(ckpt.read_bytes())
    assert main(["play", "--ckpt_path", str(lone), "--data", str(data), "--port", "0"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"error: {tmp_path}/lone.codes.pt: code dictionary not found")
    assert f"`lwm codes --ckpt_path {lone}`" in errors[0]


def test_a_file_of_another_latent_shape_is_one_line(trained, tmp_path, capsys):
    from tests.lightning.helpers import make_dataset

    ckpt, _, _ = trained
    manifest = make_dataset(tmp_path / "other", files=2)  # [4, 16, 16] latents
    assert main(["play", "--ckpt_path", str(ckpt), "--data", str(tmp_path / "other/ep00.h5"), "--port", "0"]) == 2
    assert _errors(capsys) == [f"error: {tmp_path}/other/ep00.h5: dataset 'latents' has channels 4, expected 16 "
                               f"(shape (14, 4, 16, 16))"]
    assert main(["play", "--ckpt_path", str(ckpt), "--manifest", str(manifest), "--port", "0"]) == 2
    assert _errors(capsys) == [f"error: {manifest}: latents [4, 16, 16], but the checkpoint's model takes [16, 16, 16]"]


def test_a_port_in_use_and_a_remote_host_are_one_line(trained, capsys, monkeypatch):
    ckpt, data, _ = trained
    import lwm.play.player as player_module

    monkeypatch.setattr(player_module, "load_player", lambda *a: pytest.fail("the model loaded before the refusal"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["play", "--ckpt_path", str(ckpt), "--data", str(data), "--port", str(port)]) == 2
    assert _errors(capsys) == [f"error: --port {port}: already in use on 127.0.0.1 (another lwm play?); --port N for "
                               f"another, --port 0 for any free one"]
    assert main(["play", "--ckpt_path", str(ckpt), "--host", "0.0.0.0"]) == 2
    assert _errors(capsys) == ["error: --host 0.0.0.0: 0.0.0.0 is not a loopback address; anyone who reaches it could "
                               "play the checkpoint (--allow-remote to serve it anyway)"]
    assert main(["play", "--ckpt_path", str(ckpt), "--data", str(data), "--manifest", "m.json"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "--manifest" in errors[0] and "--data" in errors[0], errors


@pytest.mark.slow
def test_the_command_prints_the_url_and_serves_the_page_until_ctrl_c(trained):
    ckpt, _, manifest = trained
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lwm.cli", "play", "--ckpt_path", str(ckpt.parent.parent),
                             "--manifest", str(manifest), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("lwm play: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[2]
        assert "arrow keys: true action 1 (up) -> code" in line
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "<title>lwm play</title>" in page
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT  # (lwm's exit status for Ctrl-C)
    assert "Traceback" not in proc.stderr.read()


@pytest.mark.slow
def test_a_vae_file_plays_through_the_vae(trained, tmp_path):
    """With --vae, each page frame is the last video frame of its latent decoded after the latents before it (at most
    3); the recorded video is the whole rollout decoded after the file's latents before the start frame."""
    diffusers = pytest.importorskip("diffusers")
    from lwm.data.vae import VAECodec
    from tests.data.test_vae import TINY

    ckpt, _, _ = trained
    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(**TINY["wan"]).save_pretrained(tmp_path / "wan")
    codec = VAECodec.load("wan", tmp_path / "wan", size=128)  # [16, 16, 16] latents, the tiny model's
    latents = np.tanh(0.3 * np.random.default_rng(0).normal(size=(10, 16, 16, 16))).astype(np.float32)
    with h5py.File(tmp_path / "clip.h5", "w") as f:
        f["latents"] = latents
        f.attrs["codec"] = codec.attr
    player = load_player(str(ckpt), [str(tmp_path / "clip.h5")], None, None, str(tmp_path / "wan"), False, 30)
    assert player.display.is_vae and player.display.name == "wan"
    session = Session(player, "s")
    session.start(0, 1)
    _play(session, player.number_keys[:1] * 2)  # (the tiny VAE takes seconds a decode on 2 cores)
    played = session.rollout.latents().numpy()  # [3, 16, 16, 16]
    assert np.array_equal(session.pixels(), codec.decode(played[-1:], before=played[:2])[-1])
    video = player.display.video(session.rollout.latents(), player.before(0, 1))
    assert np.array_equal(video, codec.decode(played, before=latents[:1])) and video.shape == (12, 128, 128, 3)
