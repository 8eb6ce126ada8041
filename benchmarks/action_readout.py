"""Can the action encoder read the true action at all? Train it on the labels alone, then read held-out clips.

    python benchmarks/action_readout.py --train DIR/manifest.json --test DIR_TEST/manifest.json [--steps 600]

The action encoder of ``configs/footage.yaml`` (its own tokenizer, each transition alone) with a linear head over
the true actions, trained by cross-entropy on every transition of the training recording (no prediction loss, no
quantizer), once pooling its tokens by mean (the default) and once by max (``action_max_pool``). Prints, per world
(game), the held-out accuracy beside the most frequent action's share: where a supervised encoder stays at chance,
no unsupervised objective can make its codes carry the action.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from lwm.inference.study import load_clips
from lwm.modules.config import WorldModelConfig
from lwm.modules.world_model import WorldModel

FOOTAGE = Path(__file__).resolve().parents[1] / "configs" / "footage.yaml"


def readout(train, test, max_pool: bool, steps: int, batch: int = 16, seed: int = 0) -> dict[int, tuple[float, float]]:
    """Per world: (held-out accuracy, the most frequent action's share) of the encoder trained on the labels."""
    torch.manual_seed(seed)
    net = yaml.safe_load(FOOTAGE.read_text())["model"]["net"]
    model = WorldModel(WorldModelConfig(**net, action_max_pool=max_pool))
    head = torch.nn.Linear(model.config.d_code_action, int(train.actions.max()) + 1)
    parts = [model.action_tokenizer, model.action_encoder, head]
    optimizer = torch.optim.AdamW([p for m in parts for p in m.parameters()], lr=1e-3)

    def logits(x):  # [B, T-1, K]: the action of each transition
        return head(model.action_encoder.embed(model.action_tokens(x)))

    for _ in range(steps):
        i = torch.randint(len(train.latents), (batch,))
        y = train.actions[i][:, :-1]
        loss = torch.nn.functional.cross_entropy(logits(train.latents[i]).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        pred = torch.cat([logits(test.latents[i : i + 32]).argmax(-1) for i in range(0, len(test.latents), 32)])
    y, out = test.actions[:, :-1], {}
    for w in test.worlds.unique().tolist():
        yy, pp = y[test.worlds == w].flatten(), pred[test.worlds == w].flatten()
        out[w] = ((pp == yy).float().mean().item(), torch.bincount(yy).max().item() / len(yy))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", required=True, help="the training recording's manifest.json (with actions)")
    p.add_argument("--test", required=True, help="the held-out recording's manifest.json")
    p.add_argument("--steps", type=int, default=600, help="training steps of each encoder (default 600)")
    p.add_argument("--window", type=int, default=8, help="frames per clip (default 8, footage.yaml's)")
    p.add_argument("--games", nargs="+", default=["pong", "breakout", "freeway", "boxing"],
                   help="the name of each world label, in order (default: benchmarks/learning.py's games)")
    args = p.parse_args(argv)
    train = load_clips(args.train, None, args.window)
    test = load_clips(args.test, None, args.window, per_file=16)
    rows = {pool: readout(train, test, pool == "max", args.steps) for pool in ("mean", "max")}
    print(f"\naction encoder trained on the true actions alone, {args.steps} steps; held-out accuracy (chance: the "
          "most frequent action)\n\n| game | mean pool | max pool | chance |\n|---|---|---|---|")
    for w in rows["mean"]:
        name = args.games[w] if w < len(args.games) else w
        print(f"| {name} | {rows['mean'][w][0]:.3f} | {rows['max'][w][0]:.3f} | {rows['mean'][w][1]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
