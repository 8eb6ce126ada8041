"""What a trained world model learned, on held-out clips: prediction against copy-last-frame, action and world
sensitivity with in-distribution controls, the world-code leak check, and the codes against the true labels."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import Tensor

from lwm.data.h5 import find_latents_key, parse_world_label
from lwm.data.manifest import Manifest
from lwm.inference.dictionary import CodeDictionary
from lwm.utils.metrics import (code_ids, linear_probe_accuracy, nmi, nmi_chance, probe_train_size, psnr_from_mse,
                               random_codes)

LABELLED = (50, 200, 1000)  # labelled transitions per game for the code -> action mapping


@dataclass
class Clips:
    """Held-out windows: ``latents [N, T, C, H, W]``, true ``actions [N, T]`` (after frame t; -1: none), ``worlds
    [N]`` (world labels, -1: none) and ``files [N]`` (which file each window comes from)."""

    latents: Tensor
    actions: Tensor
    worlds: Tensor
    files: Tensor

    def __len__(self) -> int:
        return self.latents.shape[0]


def load_clips(manifest_path: str | Path, split: str | None, window: int, per_file: int | None = None) -> Clips:
    """The non-overlapping ``window``-frame windows from frame 0 of a manifest's ``split`` files (None: every file),
    at most ``per_file`` of each file, evenly spread."""
    manifest = Manifest.load(manifest_path)
    clips = []  # (latents, actions, world label, file) of each window
    for i, entry in enumerate(manifest.entries if split is None else manifest.split(split)):
        path = manifest.resolve(entry)
        with h5py.File(path, "r") as f:
            x = f[find_latents_key(f, path)]
            starts = list(range(0, x.shape[0] - window + 1, window))
            if per_file is not None and len(starts) > per_file:
                starts = [starts[j] for j in np.linspace(0, len(starts) - 1, per_file).round().astype(int)]
            a = f["actions"][:] if "actions" in f else np.full(x.shape[0], -1)
            label = parse_world_label(f.attrs["world_label"], path) if "world_label" in f.attrs else -1
            clips += [(np.asarray(x[s : s + window], dtype=np.float32), a[s : s + window], label, i) for s in starts]
    if not clips:
        raise ValueError(f"{manifest_path}: no {split} file holds a window of {window} frames")
    latents, actions, worlds, files = zip(*clips)
    return Clips(torch.from_numpy(np.stack(latents)), torch.from_numpy(np.stack(actions).astype(np.int64)),
                 torch.tensor(worlds), torch.tensor(files))


def probe_margin(chance: float, samples: int) -> float:
    """Three standard deviations of a chance-level classifier's accuracy on ``samples`` held-out samples."""
    return 3.0 * math.sqrt(max(chance * (1.0 - chance), 1e-12) / max(samples, 1))


def other_clip(clips: Clips, same_world: bool, generator: torch.Generator) -> Tensor:
    """``[N]``: per clip the index of one from another file (of its world, if ``same_world``), else another window."""
    n = len(clips)
    pick = torch.arange(n)
    order = torch.randperm(n, generator=generator)
    for i in range(n):
        world = (clips.worlds[order] == clips.worlds[i]) if same_world else True
        ok = (clips.files[order] != clips.files[i]) & world
        if not ok.any():
            ok = (order != i) & world
        if ok.any():
            pick[i] = order[ok.nonzero()[0, 0]]
        order = order.roll(1)  # another draw for the next clip
    return pick


@torch.no_grad()
def evaluate(model, clips: Clips, t: int = 4, dictionary: CodeDictionary | None = None, batch_size: int = 64,
             seed: int = 0, world_phase: str = "quantized", world_factors: dict[str, Tensor] | None = None) -> dict:
    """Every number of the learning study for ``model`` (a ``WorldModel`` in eval mode) on ``clips`` of > t frames."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    q_action, q_world = model.quantizers["Action_Encoder"], model.quantizers["World_Encoder"]
    n, T = clips.latents.shape[:2]
    codes = []  # per batch: the action indices, the world indices and vectors
    for s in range(0, n, batch_size):
        x = clips.latents[s : s + batch_size].to(device)
        a, w = model.encode_actions(x), model.encode_world(x)
        codes.append((a.indices.cpu(), w.indices.cpu(), model.world_input(w, world_phase).cpu()))
    action_idx, world_idx, world_vec = (torch.cat(c) for c in zip(*codes))
    if dictionary is None:
        dictionary = CodeDictionary(tuple(q_action.codebook_sizes))
        dictionary.update(action_idx)
    others = {"other_clip": other_clip(clips, False, g), "same_world": other_clip(clips, True, g)}
    draws = torch.Generator().manual_seed(seed + 1)  # the random and dictionary codes (on the CPU)
    mse: dict[str, Tensor] = {}  # per codes fed, [N, t]: each clip's MSE at frames 1..t generated from frame 0
    for s in range(0, n, batch_size):
        idx = torch.arange(s, min(s + batch_size, n))
        B, x = len(idx), clips.latents[idx].to(device)
        actions = q_action.decode_indices(action_idx[idx].to(device))  # [B, T-1, Da]
        world = world_vec[idx].to(device)
        random_actions = random_codes(q_action, (B, t), draws).to(device)
        dictionary_actions = q_action.decode_indices(dictionary.sample((B, t), generator=draws).to(device))
        random_world = random_codes(q_world, (B,), draws).to(device)
        if world_phase == "off":
            random_world.zero_()
        inputs = {"inferred": (actions, world), "random": (random_actions, world),
                  "dictionary": (dictionary_actions, world),
                  "other_clip": (q_action.decode_indices(action_idx[others["other_clip"][idx]].to(device)), world),
                  "world_random": (actions, random_world),
                  "same_world": (actions, world_vec[others["same_world"][idx]].to(device))}
        for name, (a, w) in inputs.items():
            error = model.generate(x[:, :1], a[:, :t], w, steps=t).float() - x[:, 1 : t + 1].float()
            mse.setdefault(name, torch.zeros(n, t))[idx] = error.pow(2).flatten(2).mean(-1).cpu()

    copy = (clips.latents[:, 1 : t + 1].float() - clips.latents[:, :1].float()).pow(2).flatten(2).mean(-1)  # [N, t]
    seq = psnr_from_mse(mse["inferred"][:, -1])

    def gap(control: str, m: Tensor | slice = slice(None)) -> float:  # PSNR lost at frame t under the control
        return float((seq[m] - psnr_from_mse(mse[control][m, -1])).mean())

    true_actions = clips.actions[:, : T - 1]
    result = {
        "clips": n, "files": int(clips.files.unique().numel()), "t": t,
        "psnr": psnr_from_mse(mse["inferred"].mean(0)).tolist(), "copy_psnr": psnr_from_mse(copy.mean(0)).tolist(),
        "action_dpsnr": {k: gap(k) for k in ("random", "dictionary", "other_clip")},
        "world_dpsnr": {"random": gap("world_random"), "same_world": gap("same_world")},
        "action_usage": _usage(action_idx, q_action.codebook_sizes),
        "world_usage": _usage(world_idx, q_world.codebook_sizes), "per_world": {},
    }
    for label in clips.worlds.unique().tolist():
        m = clips.worlds == label
        result["per_world"][int(label)] = {
            "clips": int(m.sum()), "psnr": psnr_from_mse(mse["inferred"][m].mean(0)).tolist(),
            "copy_psnr": psnr_from_mse(copy[m].mean(0)).tolist(), "action_dpsnr_dictionary": gap("dictionary", m),
            "action_dpsnr_other_clip": gap("other_clip", m), "world_gap_same_world": gap("same_world", m),
            "action": _against_labels(action_idx[m], true_actions[m], q_action),  # games have actions of their own
        }
    # the actions' chance level keeps what the world alone tells of them (each game has its own action set)
    result["action"] = _against_labels(action_idx, true_actions, q_action,
                                       groups=clips.worlds[:, None].expand_as(true_actions))
    result["world"] = _against_labels(world_idx, clips.worlds, q_world)
    result["world_factors"] = {name: _against_labels(world_idx, labels, q_world)
                               for name, labels in (world_factors or {}).items()}
    return result


def code_to_action_accuracy(train_ids: Tensor, train_y: Tensor, test_ids: Tensor, test_y: Tensor) -> tuple[float, float]:
    """Held-out accuracy of the mapping each code -> its most frequent true action on the labelled ``train_*`` (a code
    not among them: their most frequent action), and the chance level: that most frequent action everywhere."""
    majority = int(train_y.mode().values)
    mapping = {int(c): int(train_y[train_ids == c].mode().values) for c in train_ids.unique()}
    predicted = torch.tensor([mapping.get(int(c), majority) for c in test_ids])
    return float((predicted == test_y).float().mean()), float((test_y == majority).float().mean())


@torch.no_grad()
def label_efficiency(model, labelled: Clips, clips: Clips, sizes: tuple[int, ...] = LABELLED, seed: int = 0,
                     batch_size: int = 64) -> dict[int, dict[int, dict]]:
    """Per world (game) and number ``n`` of labelled transitions: the accuracy on every transition of ``clips`` of
    the code -> action mapping fitted on ``n`` random transitions of ``labelled``, against chance."""
    device, q = next(model.parameters()).device, model.quantizers["Action_Encoder"]
    T = clips.latents.shape[1]

    def codes(c: Clips) -> Tensor:  # [N, T-1] code ids
        return code_ids(torch.cat([model.encode_actions(c.latents[s : s + batch_size].to(device)).indices.cpu()
                                   for s in range(0, len(c), batch_size)]), q.codebook_sizes)

    def of_world(c: Clips, ids: Tensor, world: int) -> tuple[Tensor, Tensor]:  # its labelled (code ids, actions)
        ids, y = ids[c.worlds == world].flatten(), c.actions[c.worlds == world, : T - 1].flatten()
        return ids[y >= 0], y[y >= 0]

    g = torch.Generator().manual_seed(seed)
    train_ids, test_ids = codes(labelled), codes(clips)
    out: dict[int, dict[int, dict]] = {}
    for world in clips.worlds.unique().tolist():
        (tr_ids, tr_y), (te_ids, te_y) = of_world(labelled, train_ids, world), of_world(clips, test_ids, world)
        out[int(world)] = {}
        for n in sizes:
            if len(tr_y) < n or not len(te_y):
                continue
            pick = torch.randperm(len(tr_y), generator=g)[:n]
            accuracy, chance = code_to_action_accuracy(tr_ids[pick], tr_y[pick], te_ids, te_y)
            out[int(world)][n] = {"accuracy": accuracy, "chance": chance, "margin": probe_margin(chance, len(te_y))}
    return out


def _usage(indices: Tensor, sizes) -> dict:
    """Codes used per level (of each level's size) and distinct tuples used, on the clips."""
    flat = indices.reshape(-1, len(sizes))
    return {"levels": [int(flat[:, l].unique().numel()) for l in range(len(sizes))], "sizes": list(sizes),
            "tuples": int(torch.unique(flat, dim=0).shape[0])}


def _against_labels(indices: Tensor, labels: Tensor, quantizer, groups: Tensor | None = None) -> dict | None:
    """NMI of the code tuples with the labels and a held-out linear probe from the code vectors, each with its
    chance level and 3 sd (NMI's: the labels shuffled within ``groups``, where given)."""
    keep = labels >= 0
    if keep.sum() < 4:
        return None
    codes, y = indices[keep], labels[keep]
    features = quantizer.decode_indices(codes.to(quantizer.codebook(0).device)).cpu()
    accuracy, chance = linear_probe_accuracy(features, y)
    ids = code_ids(codes, quantizer.codebook_sizes)
    nmi_mean, nmi_margin = nmi_chance(ids, y, None if groups is None else groups[keep])
    return {"nmi": float(nmi(ids, y)), "nmi_chance": nmi_mean, "nmi_margin": nmi_margin, "probe": accuracy,
            "chance": chance, "margin": probe_margin(chance, len(y) - probe_train_size(len(y))),
            "samples": int(len(y))}
