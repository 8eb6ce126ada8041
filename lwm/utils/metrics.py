"""Monitoring metrics: plain functions of tensors, returning tensors on their device (callers choose when to sync)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric


@torch.no_grad()
def attention_diagonality(attn: Tensor) -> Tensor:
    """``attn [B, heads, Q, T]`` (rows sum to 1; queries ``0..Q-1`` of ``T`` keys, ``Q <= T``) -> ``[B]``: the mean
    weight of each query on its own and the next frame."""
    main = attn.diagonal(dim1=-2, dim2=-1)  # [B, heads, Q]
    upper = attn.diagonal(offset=1, dim1=-2, dim2=-1)  # [B, heads, min(Q, T-1)]
    per_query = main.clone()
    per_query[..., : upper.shape[-1]] += upper
    return per_query.float().mean(dim=(1, 2))


@torch.no_grad()
def used_codes(indices: Tensor, codebook_sizes: Sequence[int]) -> list[Tensor]:
    """``indices [..., L]`` -> per level a ``[K_l]`` bool mask of the codes used at least once (no host sync)."""
    flat = indices.reshape(-1, len(codebook_sizes))
    return [torch.zeros(k, dtype=torch.bool, device=indices.device).index_fill_(0, flat[:, level], True)
            for level, k in enumerate(codebook_sizes)]


def codebook_usage(indices: Tensor, codebook_sizes: Sequence[int]) -> Tensor:
    """``indices [..., L]`` -> ``[L]``: codes of each level used at least once / codes in the level."""
    return torch.stack([mask.float().mean() for mask in used_codes(indices, codebook_sizes)])


@torch.no_grad()
def codebook_diversity(codes: Tensor) -> Tensor:
    """``codes [K, d]`` -> ``[3]``: (min, max, mean) MSE over the ``K (K - 1) / 2`` distinct pairs of codes."""
    K = codes.shape[0]
    if K < 2:
        return torch.full((3,), float("nan"), device=codes.device)
    c = codes.float()
    # exact differences: cdist's matmul form (its default above 25 rows) can put identical codes 0.01 apart
    mse = torch.cdist(c, c, compute_mode="donot_use_mm_for_euclid_dist").pow(2) / c.shape[1]  # [K, K]
    pairs = mse[tuple(torch.triu_indices(K, K, offset=1, device=codes.device))]  # [K (K - 1) / 2]
    return torch.stack([pairs.min(), pairs.max(), pairs.mean()])


def psnr(target: Tensor, prediction: Tensor) -> Tensor:
    """``[B, ...]`` -> ``[B]``: ``10 log10(1 / MSE)`` per sample (a peak of 1, latents in [-1, 1] as they are)."""
    return psnr_from_mse((prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1))


def psnr_from_mse(mse: Tensor) -> Tensor:
    """``10 log10(1 / MSE)``, elementwise, in fp32 (a peak of 1)."""
    return 10.0 * torch.log10(1.0 / mse.float())


def delta_psnr(target: Tensor, prediction: Tensor, prediction_random: Tensor) -> Tensor:
    """``[3]``: (dPSNR, PSNR_seq, PSNR_rand), batch means; ``dPSNR = mean_b(PSNR_seq - PSNR_rand)``."""
    seq, rand = psnr(target, prediction), psnr(target, prediction_random)
    return torch.stack([(seq - rand).mean(), seq.mean(), rand.mean()])


def random_indices(codebook_sizes: Sequence[int], lead: Sequence[int], generator: torch.Generator | None = None,
                   device: torch.device | str | None = None) -> Tensor:
    """Code indices ``[*lead, L]`` drawn uniformly per level (on the generator's device, else ``device``)."""
    device = generator.device if generator is not None else device
    return torch.stack(
        [torch.randint(0, k, tuple(lead), device=device, generator=generator) for k in codebook_sizes], dim=-1
    )


@torch.no_grad()
def random_codes(quantizer, lead: Sequence[int], generator: torch.Generator | None = None) -> Tensor:
    """Codes ``[*lead, dim]`` of indices drawn uniformly per level (the requirement's random actions/worlds)."""
    device = quantizer.codebook(0).device
    return quantizer.decode_indices(random_indices(quantizer.codebook_sizes, lead, generator, device).to(device))


@torch.no_grad()
def sensitivity(model, x: Tensor, t: int = 4, generator: torch.Generator | None = None,
                world_phase: str = "quantized") -> dict[str, Tensor]:
    """Action and world sensitivity of a clip batch ``x [B, T > t, C, H, W]`` at frame ``t``."""
    B = x.shape[0]
    actions, world = model.infer_codes(x, world_phase)  # [B, T-1, Da], [B, Dh]
    actions = actions[:, :t]  # a_0..a_{t-1}
    target = x[:, t]
    seq = model.generate(x[:, :1], actions, world, steps=t)[:, -1]  # the KV-cached rollout
    rand_actions = random_codes(model.quantizers["Action_Encoder"], (B, t), generator).to(actions.dtype)
    rand_world = (torch.zeros_like(world) if world_phase == "off"  # the predictor gets no world
                  else random_codes(model.quantizers["World_Encoder"], (B,), generator).to(world.dtype))
    action_rand = model.generate(x[:, :1], rand_actions, world, steps=t)[:, -1]
    world_rand = model.generate(x[:, :1], actions, rand_world, steps=t)[:, -1]
    return {
        "Action_Encoder": delta_psnr(target, seq, action_rand),
        "World_Encoder": delta_psnr(target, seq, world_rand),
    }


def code_ids(indices: Tensor, codebook_sizes: Sequence[int]) -> Tensor:
    """Code tuples ``[..., L]`` -> one integer id each ``[...]`` (mixed radix, level 0 most significant)."""
    ids = torch.zeros(indices.shape[:-1], dtype=torch.long, device=indices.device)
    for level, k in enumerate(codebook_sizes):
        ids = ids * k + indices[..., level].long()
    return ids


@torch.no_grad()
def nmi(predicted: Tensor, target: Tensor) -> Tensor:
    """Normalised mutual information between two integer labelings ``[N]``."""
    from torchmetrics.functional.clustering import normalized_mutual_info_score

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        return normalized_mutual_info_score(predicted.long().cpu(), target.long().cpu())


@torch.no_grad()
def nmi_chance(predicted: Tensor, target: Tensor, groups: Tensor | None = None, permutations: int = 20,
               seed: int = 0) -> tuple[float, float]:
    """The chance level of :func:`nmi` on finite samples: mean and 3 sd over ``permutations`` of ``target [N]``
    shuffled (within each of ``groups [N]``, where given: what the groups alone tell, e.g. each game's actions)."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.zeros_like(target) if groups is None else groups
    members = [(groups == k).nonzero()[:, 0] for k in groups.unique()]
    values = []
    for _ in range(permutations):
        shuffled = target.clone()
        for m in members:
            shuffled[m] = target[m[torch.randperm(len(m), generator=g)]]
        values.append(nmi(predicted, shuffled))
    values = torch.stack(values)
    return float(values.mean()), float(3 * values.std())


def probe_train_size(n: int, train_fraction: float = 0.5) -> int:
    """How many of ``n`` samples :func:`linear_probe_accuracy` trains on (the rest are held out)."""
    return max(1, min(n - 1, int(round(train_fraction * n))))


def linear_probe_accuracy(
    features: Tensor, labels: Tensor, train_fraction: float = 0.5, steps: int = 300, seed: int = 0
) -> tuple[float, float]:
    """Held-out accuracy and chance level of a linear classifier (multinomial logistic regression, full-batch Adam
    on standardised features) trained on a seeded ``train_fraction`` of ``features [N, d]`` -> ``labels [N]``."""
    n = features.shape[0]
    if n < 4:
        return float("nan"), float("nan")
    with torch.inference_mode(False):  # callers at validation run under inference mode
        x, y = features.detach().float().cpu().clone(), labels.detach().long().cpu().clone()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        cut = probe_train_size(n, train_fraction)
        train, test = order[:cut], order[cut:]
        x = (x - x[train].mean(0)) / x[train].std(0).clamp_min(1e-6)
        classes = int(y.max()) + 1
        with torch.enable_grad():
            torch.manual_seed(seed)
            probe = torch.nn.Linear(x.shape[1], classes)
            opt = torch.optim.Adam(probe.parameters(), lr=0.05)
            for _ in range(steps):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(probe(x[train]), y[train]).backward()
                opt.step()
        with torch.no_grad():
            accuracy = (probe(x[test]).argmax(-1) == y[test]).float().mean().item()
    majority = torch.bincount(y[train], minlength=classes).argmax()
    return accuracy, (y[test] == majority).float().mean().item()


def copy_last_loss(x: Tensor) -> Tensor:
    """The copy-last-frame baseline's one-step MSE on clips ``x [B, T, ...]``: frame ``i+1`` predicted as ``i``."""
    return (x[:, 1:].float() - x[:, :-1].float()).pow(2).mean()


class WeightedMean(Metric):
    """The weighted mean of every ``update(value, weight=1)``, summed over ranks at ``compute``."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: Tensor | float, weight: Tensor | float = 1.0) -> None:
        value = torch.as_tensor(value, device=self.device).float()
        weight = torch.as_tensor(weight, device=self.device).float().expand_as(value)
        self.total += (value * weight).sum()
        self.weight += weight.sum()

    def compute(self) -> Tensor:
        return self.total / self.weight
