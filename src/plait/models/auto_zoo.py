"""Models that are not Megatron-shaped, for the auto-parallel planner's measured comparison
(``plait bench auto``): each factory returns ``(module, example_inputs)``, the module
called on the inputs returns the scalar training loss (its loss inside, as the
planner's graph wants), dim 0 of every input is the batch. Plain torch modules only,
seeded (``seed`` fixes weights and data alike), any floating dtype (float32 for
timing, float64 for parity).

- ``wide_mlp``: a wide-then-narrow MLP stack, 64 -> 4096 -> 256 -> 4096 -> 10 by default,
  cross-entropy. Its parameters (2.4 M, 9.6 MB in float32) dwarf the narrow
  activations, so data parallelism's gradient all-reduce is costly while a
  column-then-row split of each wide pair moves only the narrow (batch, 256)
  activation: the layout an intra-op search should find.
- ``moe``: a mixture-of-experts layer: a gate linear, a softmax, a top-k mask (the
  k-th largest gate probability as a threshold: static shapes, no data-dependent
  dispatch, so torch.export traces it) and E expert MLPs computed densely over every
  token as batched products over stacked expert weights ``w_in`` (E, H, F) and
  ``w_out`` (E, F, H), combined by the masked gate; a residual and MSE. Sharding
  dim 0 of the stacked weights is expert parallelism.
- ``mixer``: an MLP-Mixer (Tolstikhin et al. 2021) on (batch, 3, 32, 32) images:
  patches by reshape/permute (no convolution), a patch embedding, blocks of
  LayerNorm + token-mixing MLP (over the patches, through a transpose) and LayerNorm
  + channel-mixing MLP, mean pooling, a classifier, cross-entropy. No batch norm
  (under batch sharding it would not be exact).

FLOPs of one forward, b the batch (a training step is about three times it):

    wide_mlp  2·b·Σ d_i·d_{i+1}
    moe       2·b·s·(H·E + 2·E·H·F)                  (every expert on every token)
    mixer     2·b·(P·p²c·C + L·(2·C·P·D_t + 2·P·C·D_c) + C·classes)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZOO", "WideMLP", "MoE", "Mixer", "wide_mlp", "moe", "mixer", "build", "TINY"]

# Every model also offers ``pipeline_layers()``: the modules its forward runs one after
# another on one tensor (the loss left out), what plait's knob search
# (plait.plan.search over plait.plan.trace.describe_layers) splits into pipeline stages.


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class WideMLP(nn.Module):
    """Linear layers with ReLU between them over ``dims``; forward(x, target) ->
    cross-entropy of the last layer's logits against the class ``target``."""

    def __init__(self, dims: tuple[int, ...]):
        super().__init__()
        if len(dims) < 2 or any(int(size) < 1 for size in dims):
            raise ValueError(f"wide_mlp dims={dims!r} must be >= 2 widths >= 1, e.g. (64, 4096, 256, 4096, 10)")
        self.layers = nn.ModuleList(nn.Linear(fan_in, fan_out) for fan_in, fan_out in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # x: (b, dims[0]), target: (b,)
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = F.relu(x)
        return F.cross_entropy(x, target)

    def pipeline_layers(self) -> list[nn.Module]:
        """Each linear, a ReLU after every one but the last."""
        layers: list[nn.Module] = []
        for index, layer in enumerate(self.layers):
            layers += [layer] if index == len(self.layers) - 1 else [layer, nn.ReLU()]
        return layers


class _Body(nn.Module):
    """A model's forward without its loss, as one layer (a model that does not split)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.mixture(x)


class MoE(nn.Module):
    """A mixture-of-experts layer, dense: every expert runs on every token, the gate's
    top-k probabilities (others masked to 0) weight their outputs.

    x (b, s, H) -> gate probabilities g = softmax(x W_g^T) (b, s, E), masked to the
    entries >= the k-th largest (k = E: soft, all experts);
    h_e = relu(x W_in[e] + b_in[e]) (b, s, F); y = x + Σ_e g_e · (h_e W_out[e]) (b, s, H);
    loss = MSE(y, target). The experts' products are one batched matmul each over
    the stacked weights (E, ...), the tokens broadcast over the experts."""

    def __init__(self, hidden: int, experts: int, ffn: int, top_k: int):
        super().__init__()
        if min(hidden, experts, ffn) < 1 or not 1 <= top_k <= experts:
            raise ValueError(f"moe hidden={hidden}, experts={experts}, ffn={ffn} must be >= 1 and top_k={top_k} "
                             f"in 1..experts")
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.b_in = nn.Parameter(torch.zeros(experts, 1, ffn))
        self.w_out = nn.Parameter(torch.empty(experts, ffn, hidden))
        # each expert as nn.Linear would initialise it: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        nn.init.uniform_(self.w_in, -hidden ** -0.5, hidden ** -0.5)
        nn.init.uniform_(self.w_out, -ffn ** -0.5, ffn ** -0.5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # x, target: (b, s, H)
        return F.mse_loss(self.mixture(x), target)

    def pipeline_layers(self) -> list[nn.Module]:
        """The whole layer as one (one gate over every expert: no stage boundary inside)."""
        return [_Body(self)]

    def mixture(self, x: torch.Tensor) -> torch.Tensor:
        """x + Σ_e g_e · expert_e(x): (b, s, H) -> (b, s, H)."""
        batch, seq, hidden = x.shape
        experts = self.w_in.shape[0]
        probabilities = torch.softmax(self.gate(x), dim=-1)  # (b, s, E)
        if self.top_k < experts:
            threshold = probabilities.topk(self.top_k, dim=-1).values[..., -1:]  # (b, s, 1)
            probabilities = probabilities * (probabilities >= threshold).to(probabilities.dtype)
        tokens = x.reshape(1, batch * seq, hidden).expand(experts, batch * seq, hidden)  # (E, n, H)
        inner = torch.relu(torch.bmm(tokens, self.w_in) + self.b_in)  # (E, n, F)
        expert_out = torch.bmm(inner, self.w_out)  # (E, n, H)
        weights = probabilities.reshape(batch * seq, experts).transpose(0, 1).unsqueeze(-1)  # (E, n, 1)
        combined = (expert_out * weights).sum(dim=0).reshape(batch, seq, hidden)
        return x + combined


class MixerBlock(nn.Module):
    """x + token_mlp(LN(x)^T)^T, then + channel_mlp(LN(.)): x (b, P, C)."""

    def __init__(self, patches: int, channels: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm_tokens = nn.LayerNorm(channels)
        self.token_in = nn.Linear(patches, token_hidden)
        self.token_out = nn.Linear(token_hidden, patches)
        self.norm_channels = nn.LayerNorm(channels)
        self.channel_in = nn.Linear(channels, channel_hidden)
        self.channel_out = nn.Linear(channel_hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.norm_tokens(x).transpose(1, 2)  # (b, C, P)
        x = x + self.token_out(F.gelu(self.token_in(mixed))).transpose(1, 2)
        return x + self.channel_out(F.gelu(self.channel_in(self.norm_channels(x))))


class PatchEmbed(nn.Module):
    """(b, c, g·p, g·p) images -> (b, g², c·p²) patches -> (b, g², C)."""

    def __init__(self, patch: int, grid: int, in_channels: int, channels: int):
        super().__init__()
        self.patch, self.grid = patch, grid
        self.embed = nn.Linear(patch * patch * in_channels, channels)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch, in_channels = images.shape[0], images.shape[1]
        grid, patch = self.grid, self.patch
        # (b, c, g, p, g, p) -> (b, g, g, c, p, p) -> (b, P, c·p²)
        patches = images.reshape(batch, in_channels, grid, patch, grid, patch).permute(0, 2, 4, 1, 3, 5)
        return self.embed(patches.reshape(batch, grid * grid, in_channels * patch * patch))


class MixerHead(nn.Module):
    """LN, mean over the patches, the classifier: (b, P, C) -> (b, classes)."""

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x).mean(dim=1))


class Mixer(nn.Module):
    """MLP-Mixer: (b, c, H, W) images -> (b, P, p²c) patches -> embedding C -> blocks ->
    LN -> mean over patches -> classes; forward(images, target) -> cross-entropy."""

    def __init__(self, image: int, patch: int, in_channels: int, channels: int, token_hidden: int,
                 channel_hidden: int, blocks: int, classes: int):
        super().__init__()
        if image % patch or min(image, patch, in_channels, channels, token_hidden, channel_hidden, classes) < 1 \
                or blocks < 0:
            raise ValueError(f"mixer image={image} must be a multiple of patch={patch}, every size >= 1 "
                             f"(blocks={blocks} >= 0)")
        grid = image // patch
        self.stem = PatchEmbed(patch, grid, in_channels, channels)
        self.blocks = nn.ModuleList(MixerBlock(grid * grid, channels, token_hidden, channel_hidden)
                                    for _ in range(blocks))
        self.head = MixerHead(channels, classes)

    def forward(self, images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), target)

    def pipeline_layers(self) -> list[nn.Module]:
        """The patch embedding, each block, the head."""
        return [self.stem, *self.blocks, self.head]


def wide_mlp(*, batch: int = 256, dims: tuple[int, ...] = (64, 4096, 256, 4096, 10), seed: int = 0,
             dtype: torch.dtype = torch.float32):
    """(WideMLP(dims), (x (batch, dims[0]), target (batch,) classes < dims[-1]))."""
    torch.manual_seed(seed)
    model = WideMLP(tuple(dims)).to(dtype)
    generator = _generator(seed + 1)
    x = torch.randn(batch, dims[0], generator=generator, dtype=dtype)
    target = torch.randint(0, dims[-1], (batch,), generator=generator)
    return model, (x, target)


def moe(*, batch: int = 32, seq: int = 16, hidden: int = 256, experts: int = 4, ffn: int = 512, top_k: int = 2,
        seed: int = 0, dtype: torch.dtype = torch.float32):
    """(MoE, (x (batch, seq, hidden), target (batch, seq, hidden)))."""
    torch.manual_seed(seed)
    model = MoE(hidden, experts, ffn, top_k).to(dtype)
    generator = _generator(seed + 1)
    x = torch.randn(batch, seq, hidden, generator=generator, dtype=dtype)
    target = torch.randn(batch, seq, hidden, generator=generator, dtype=dtype)
    return model, (x, target)


def mixer(*, batch: int = 32, image: int = 32, patch: int = 4, channels: int = 128, token_hidden: int = 256,
          channel_hidden: int = 512, blocks: int = 2, classes: int = 10, seed: int = 0,
          dtype: torch.dtype = torch.float32):
    """(Mixer, (images (batch, 3, image, image), target (batch,)))."""
    torch.manual_seed(seed)
    model = Mixer(image, patch, 3, channels, token_hidden, channel_hidden, blocks, classes).to(dtype)
    generator = _generator(seed + 1)
    images = torch.randn(batch, 3, image, image, generator=generator, dtype=dtype)
    target = torch.randint(0, classes, (batch,), generator=generator)
    return model, (images, target)


# name -> factory; the benchmark's models
ZOO = {"wide_mlp": wide_mlp, "moe": moe, "mixer": mixer}
# name -> the sizes of a toy of it (tests, a quick try): seconds to trace, plan and run
TINY = {"wide_mlp": {"batch": 8, "dims": (8, 32, 8, 32, 4)},
        "moe": {"batch": 4, "seq": 2, "hidden": 8, "experts": 4, "ffn": 16, "top_k": 2},
        "mixer": {"batch": 4, "image": 8, "patch": 4, "channels": 8, "token_hidden": 8, "channel_hidden": 16,
                  "blocks": 1, "classes": 4}}


def build(name: str, **sizes):
    """``ZOO[name](**sizes)``, the name checked."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(ZOO)}")
    return ZOO[name](**sizes)
