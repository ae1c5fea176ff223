"""The zoo's networks in compact torch code (bench_zoo.py's catalogue): torchvision's, timm's and
transformers' layouts written out here, because torchvision does not install beside the CPU torch
wheel this project uses (and neither do timm, which needs it) — the layouts, channel counts and
depths follow the published models; the weights are random.

Each `Net` says how to build the module, how to make a batch of inputs (named as they are
exported), the batch a user would pick on a GPU and the smaller one of the CPU's --quick profile."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import bench_models  # the rows shared with bench_models.py (ResNet-18, the SDF and SIREN MLPs, LeNet)


@dataclass(frozen=True)
class Net:
    """One zoo network. inputs(batch, quick) returns {name: tensor} with seeded values; quick is the
    CPU size profile (smaller images or sequences where the architecture allows)."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, bool], dict]
    batch: int
    quick_batch: int


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(hw: int, quick_hw: int | None = None, channels: int = 3):
    return lambda b, q: {"x": torch.randn(b, channels, quick_hw or hw if q else hw, quick_hw or hw if q else hw,
                                          generator=_gen())}


def tokens(vocab: int, seq: int, quick_seq: int):
    return lambda b, q: {"ids": torch.randint(0, vocab, (b, quick_seq if q else seq), generator=_gen())}


def floats(*shape: int, quick: tuple[int, ...] | None = None):
    return lambda b, q: {"x": torch.randn(b, *(quick or shape) if q else shape, generator=_gen())}


def randomize_norms(model: nn.Module, seed: int = 2) -> nn.Module:
    """Give every normalisation non-trivial statistics and affine parameters (a fresh BatchNorm is
    the identity in eval mode, which would let a wrong fold pass), and layer scales a size at which
    their branch matters."""
    g = _gen(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(m.running_var.shape, generator=g))
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)) and m.weight is not None:
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, LayerScale):
                m.gamma.copy_(0.2 + 0.3 * torch.rand(m.gamma.shape, generator=g))
    return model


# ---- convolutional networks ------------------------------------------------------------------------


def conv_bn(cin, cout, k, s=1, groups=1, act=nn.ReLU):
    layers = [nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, act()) if act else nn.Sequential(*layers)


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, 3, stride), conv_bn(mid, 4 * mid, 1, act=None))
        self.down = conv_bn(cin, 4 * mid, 1, stride, act=None) if stride != 1 or cin != 4 * mid else nn.Identity()

    def forward(self, x):
        return F.relu(self.body(x) + self.down(x))


def resnet50():
    """torchvision resnet50: bottlenecks [3, 4, 6, 3]."""
    layers, cin = [conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)], 64
    for mid, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(Bottleneck(cin, mid, stride if i == 0 else 1))
            cin = 4 * mid
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def _div8(v):
    return max(8, int(v + 4) // 8 * 8)


class SE(nn.Module):
    def __init__(self, c, squeeze, act=nn.ReLU, gate=nn.Sigmoid):
        super().__init__()
        self.fc1, self.act, self.fc2, self.gate = nn.Conv2d(c, squeeze, 1), act(), nn.Conv2d(squeeze, c, 1), gate()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(nn.Module):
    """MobileNetV3's and EfficientNet's block: expand 1x1, depthwise kxk, squeeze-excite, project."""

    def __init__(self, cin, exp, cout, k, stride, se: int, act):
        super().__init__()
        layers = [conv_bn(cin, exp, 1, act=act)] if exp != cin else []
        layers.append(conv_bn(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SE(exp, se, act=nn.ReLU if act is nn.Hardswish else nn.SiLU,
                             gate=nn.Hardsigmoid if act is nn.Hardswish else nn.Sigmoid))
        layers.append(conv_bn(exp, cout, 1, act=None))
        self.body, self.skip = nn.Sequential(*layers), stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.skip else self.body(x)


def mobilenet_v3_small():
    """torchvision mobilenet_v3_small."""
    cfg = [(3, 16, 16, 1, "RE", 2), (3, 72, 24, 0, "RE", 2), (3, 88, 24, 0, "RE", 1), (5, 96, 40, 1, "HS", 2),
           (5, 240, 40, 1, "HS", 1), (5, 240, 40, 1, "HS", 1), (5, 120, 48, 1, "HS", 1), (5, 144, 48, 1, "HS", 1),
           (5, 288, 96, 1, "HS", 2), (5, 576, 96, 1, "HS", 1), (5, 576, 96, 1, "HS", 1)]
    layers, cin = [conv_bn(3, 16, 3, 2, act=nn.Hardswish)], 16
    for k, exp, cout, se, act, s in cfg:
        layers.append(InvertedResidual(cin, exp, cout, k, s, _div8(exp // 4) if se else 0,
                                       nn.Hardswish if act == "HS" else nn.ReLU))
        cin = cout
    layers += [conv_bn(96, 576, 1, act=nn.Hardswish), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, 1000)]
    return nn.Sequential(*layers)


def efficientnet_b0():
    """torchvision efficientnet_b0 (MBConv, SiLU, squeeze-excite of a quarter of the block's input)."""
    cfg = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
           (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]
    layers = [conv_bn(3, 32, 3, 2, act=nn.SiLU)]
    for e, k, s, cin, cout, n in cfg:
        for i in range(n):
            c = cin if i == 0 else cout
            layers.append(InvertedResidual(c, c * e, cout, k, s if i == 0 else 1, max(1, c // 4), nn.SiLU))
    layers += [conv_bn(320, 1280, 1, act=nn.SiLU), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
               nn.Linear(1280, 1000)]
    return nn.Sequential(*layers)


class LayerScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):
        return x * self.gamma


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's channels-first LayerNorm, as torchvision writes it (permute, LayerNorm, permute)."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.dw, self.norm = nn.Conv2d(d, d, 7, padding=3, groups=d), nn.LayerNorm(d, eps=1e-6)
        self.mlp, self.scale = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)), LayerScale(d)

    def forward(self, x):
        y = self.scale(self.mlp(self.norm(self.dw(x).permute(0, 2, 3, 1))))
        return x + y.permute(0, 3, 1, 2)


def convnext_tiny():
    """torchvision convnext_tiny: depths [3, 3, 9, 3], widths 96..768."""
    dims, layers = (96, 192, 384, 768), [nn.Conv2d(3, 96, 4, 4), LayerNorm2d(96, eps=1e-6)]
    for i, (d, n) in enumerate(zip(dims, (3, 3, 9, 3))):
        if i:
            layers += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], d, 2, 2)]
        layers += [ConvNeXtBlock(d) for _ in range(n)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), LayerNorm2d(768, eps=1e-6), nn.Flatten(),
                         nn.Linear(768, 1000))


class RegNetBlock(nn.Module):
    def __init__(self, cin, cout, stride, group_width=8):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, cout, 1), conv_bn(cout, cout, 3, stride, groups=cout // group_width),
                                  SE(cout, int(round(0.25 * cin))), conv_bn(cout, cout, 1, act=None))
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        return F.relu(self.body(x) + self.down(x))


def regnet_y_400mf():
    """torchvision regnet_y_400mf: depths [1, 3, 6, 6], widths [48, 104, 208, 440], groups of 8, SE."""
    layers, cin = [conv_bn(3, 32, 3, 2)], 32
    for w, n in ((48, 1), (104, 3), (208, 6), (440, 6)):
        for i in range(n):
            layers.append(RegNetBlock(cin, w, 2 if i == 0 else 1))
            cin = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(440, 1000))


class DenseLayer(nn.Module):
    def __init__(self, cin, growth=32, bn_size=4):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, bn_size * growth, 1, bias=False),
                                  nn.BatchNorm2d(bn_size * growth), nn.ReLU(),
                                  nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False))

    def forward(self, features: list):
        return self.body(torch.cat(features, 1))


class DenseBlock(nn.Module):
    def __init__(self, cin, n):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + 32 * i) for i in range(n))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


def densenet121():
    """torchvision densenet121: growth 32, blocks (6, 12, 24, 16), each layer over the concatenation."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    c = 64
    for i, n in enumerate((6, 12, 24, 16)):
        layers.append(DenseBlock(c, n))
        c += 32 * n
        if i < 3:
            layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2, 2)]
            c //= 2
    return nn.Sequential(*layers, nn.BatchNorm2d(c), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(c, 1000))


class Fire(nn.Module):
    def __init__(self, cin, squeeze, expand):
        super().__init__()
        self.s, self.e1, self.e3 = nn.Conv2d(cin, squeeze, 1), nn.Conv2d(squeeze, expand, 1), nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.s(x))
        return torch.cat([F.relu(self.e1(x)), F.relu(self.e3(x))], 1)


def squeezenet1_1():
    """torchvision squeezenet1_1 (ceil-mode max pools)."""
    pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
    return nn.Sequential(nn.Conv2d(3, 64, 3, 2), nn.ReLU(), pool(), Fire(64, 16, 64), Fire(128, 16, 64), pool(),
                         Fire(128, 32, 128), Fire(256, 32, 128), pool(), Fire(256, 48, 192), Fire(384, 48, 192),
                         Fire(384, 64, 256), Fire(512, 64, 256), nn.Dropout(0.5), nn.Conv2d(512, 1000, 1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


class ShuffleBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        half = cout // 2
        self.stride = stride
        if stride > 1:
            self.left = nn.Sequential(conv_bn(cin, cin, 3, stride, groups=cin, act=None), conv_bn(cin, half, 1))
        self.right = nn.Sequential(conv_bn(cin if stride > 1 else half, half, 1),
                                   conv_bn(half, half, 3, stride, groups=half, act=None), conv_bn(half, half, 1))

    def forward(self, x):
        if self.stride == 1:
            a, b = x.chunk(2, dim=1)
            y = torch.cat([a, self.right(b)], 1)
        else:
            y = torch.cat([self.left(x), self.right(x)], 1)
        n, c, h, w = y.shape  # channel shuffle, as torchvision writes it
        return y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


def shufflenet_v2():
    """torchvision shufflenet_v2_x1_0: stages [4, 8, 4], widths 116, 232, 464, head 1024."""
    layers, cin = [conv_bn(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1)], 24
    for cout, n in ((116, 4), (232, 8), (464, 4)):
        layers += [ShuffleBlock(cin, cout, 2)] + [ShuffleBlock(cout, cout, 1) for _ in range(n - 1)]
        cin = cout
    return nn.Sequential(*layers, conv_bn(464, 1024, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1024, 1000))


class UNet(nn.Module):
    """A small U-Net: double 3x3 convs (BN, ReLU) at 16..128 channels, max-pool down, ConvTranspose
    up, skip concatenations, a 1x1 head."""

    def __init__(self, widths=(16, 32, 64, 128), classes=2):
        super().__init__()
        def double(cin, cout):
            return nn.Sequential(conv_bn(cin, cout, 3), conv_bn(cout, cout, 3))
        self.down = nn.ModuleList(double(cin, cout) for cin, cout in zip((3,) + widths[:-1], widths))
        self.up = nn.ModuleList(nn.ConvTranspose2d(c, c // 2, 2, 2) for c in widths[:0:-1])
        self.dec = nn.ModuleList(double(c, c // 2) for c in widths[:0:-1])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, dec, skip in zip(self.up, self.dec, skips[-2::-1]):
            x = dec(torch.cat([up(x), skip], 1))
        return self.head(x)


def cifar_cnn():
    """The issue-27 row: two 3x3 convs (16, 32 channels) with pools, a linear layer."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2048, 10))


# ---- transformers ----------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention through F.scaled_dot_product_attention (timm's and nanoGPT's way)."""

    def __init__(self, d, heads, causal=False):
        super().__init__()
        self.qkv, self.proj, self.heads, self.causal = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, causal

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block (ViT, DeiT, GPT-2)."""

    def __init__(self, d, heads, causal=False, mlp=4):
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(d), Attention(d, heads, causal), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp * d), nn.GELU(), nn.Linear(mlp * d, d))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    """timm vit_*_patch16_224 (class token) and deit_*_distilled_patch16_224 (class and distillation
    tokens, the two heads averaged)."""

    def __init__(self, d, depth, heads, distilled=False, classes=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 16, 16)
        self.tokens = nn.Parameter(0.02 * torch.randn(1, 2 if distilled else 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(1, 196 + self.tokens.shape[1], d))
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)
        self.head_dist = nn.Linear(d, classes) if distilled else None

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.tokens.expand(x.shape[0], -1, -1), x], 1) + self.pos
        x = self.norm(self.blocks(x))
        if self.head_dist is None:
            return self.head(x[:, 0])
        return (self.head(x[:, 0]) + self.head_dist(x[:, 1])) / 2


class Mixer(nn.Module):
    """timm mixer_s16_224: 8 blocks, d 512, token MLP 256, channel MLP 2048."""

    def __init__(self, d=512, depth=8, tokens=196, token_mlp=256, channel_mlp=2048):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 16, 16)
        self.blocks = nn.ModuleList(nn.ModuleList([
            nn.LayerNorm(d), nn.Sequential(nn.Linear(tokens, token_mlp), nn.GELU(), nn.Linear(token_mlp, tokens)),
            nn.LayerNorm(d), nn.Sequential(nn.Linear(d, channel_mlp), nn.GELU(), nn.Linear(channel_mlp, d))])
            for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 1000)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        for n1, tok, n2, ch in self.blocks:
            x = x + tok(n1(x).transpose(1, 2)).transpose(1, 2)
            x = x + ch(n2(x))
        return self.head(self.norm(x).mean(1))


class Bert(nn.Module):
    """BERT-style encoder: token and position embeddings, LayerNorm, nn.TransformerEncoder (post-norm,
    GELU), the last hidden states."""

    def __init__(self, vocab=30522, d=768, depth=12, heads=12, max_len=512):
        super().__init__()
        self.tok, self.pos, self.norm = nn.Embedding(vocab, d), nn.Embedding(max_len, d), nn.LayerNorm(d, eps=1e-12)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, activation="gelu", batch_first=True, dropout=0.1)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.encoder(self.norm(x))


class GPT(nn.Module):
    """GPT-2-style decoder (nanoGPT's layout): causal pre-norm blocks, the logits of the last position
    over the vocabulary (the LM head tied to the token embedding), as a prefill step computes."""

    def __init__(self, vocab=50257, d=768, depth=12, heads=12, max_len=1024):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.Sequential(*(Block(d, heads, causal=True) for _ in range(depth)))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.norm(self.blocks(x))[:, -1] @ self.tok.weight.t()


def transformer_d64():
    """The issue-27 row: nn.TransformerEncoder d64, 4 heads, feed-forward 128, 2 layers."""
    return bench_models.transformer()


# ---- sequences, audio, points, fields ----------------------------------------------------------------


class RNN(nn.Module):
    def __init__(self, cell, cin=64, hidden=128, layers=1, bidirectional=False, vocab=None, classes=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, cin) if vocab else None
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(cin, hidden, layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), classes) if classes else None

    def forward(self, x):
        y = self.rnn(self.emb(x) if self.emb is not None else x)[0]
        return self.head(y) if self.head is not None else y


class AudioEncoder(nn.Module):
    """wav2vec 2.0's convolutional feature encoder (7 1-D convs of 512 channels, strides 5,2,2,2,2,2,2,
    GroupNorm after the first, GELU) and its feature projection (LayerNorm, 512 -> 768)."""

    def __init__(self, c=512):
        super().__init__()
        spec = [(10, 5)] + [(3, 2)] * 4 + [(2, 2)] * 2
        layers, cin = [], 1
        for i, (k, s) in enumerate(spec):
            layers += [nn.Conv1d(cin, c, k, s, bias=False)] + ([nn.GroupNorm(c, c)] if i == 0 else []) + [nn.GELU()]
            cin = c
        self.conv, self.norm, self.proj = nn.Sequential(*layers), nn.LayerNorm(c), nn.Linear(c, 768)

    def forward(self, wave):
        return self.proj(self.norm(self.conv(wave.unsqueeze(1)).transpose(1, 2)))


class PointNet(nn.Module):
    """PointNet classification: the input transform net (3x3), shared MLPs as 1x1 Conv1d with BN,
    max over points, fc 512-256-40."""

    def __init__(self, classes=40):
        super().__init__()
        def shared(*cs):
            return nn.Sequential(*(m for a, b in zip(cs, cs[1:]) for m in (nn.Conv1d(a, b, 1), nn.BatchNorm1d(b), nn.ReLU())))
        def fc(*cs):
            return nn.Sequential(*(m for a, b in zip(cs, cs[1:]) for m in (nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU())))
        self.t_feat, self.t_fc, self.t_out = shared(3, 64, 128, 1024), fc(1024, 512, 256), nn.Linear(256, 9)
        self.feat, self.fc, self.out = shared(3, 64, 128, 1024), fc(1024, 512, 256), nn.Linear(256, classes)
        self.register_buffer("eye", torch.eye(3))

    def forward(self, pts):  # [B, 3, N]
        t = self.t_out(self.t_fc(self.t_feat(pts).amax(2))).view(-1, 3, 3) + self.eye
        x = torch.bmm(t, pts)
        return self.out(self.fc(self.feat(x).amax(2)))


class NeRF(nn.Module):
    """The NeRF MLP: positional encoding (10 frequencies for the point, 4 for the direction), 8 x 256
    ReLU with the input concatenated again at the fifth layer, density and colour heads."""

    def __init__(self, w=256):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(63 if i == 0 else w + (63 if i == 5 else 0), w) for i in range(8))
        self.sigma, self.feat = nn.Linear(w, 1), nn.Linear(w, w)
        self.rgb = nn.Sequential(nn.Linear(w + 27, w // 2), nn.ReLU(), nn.Linear(w // 2, 3), nn.Sigmoid())

    @staticmethod
    def encode(x, n):
        f = x[..., None] * (2.0 ** torch.arange(n, dtype=x.dtype, device=x.device))  # [N, 3, n]
        return torch.cat([x, f.sin().flatten(1), f.cos().flatten(1)], 1)

    def forward(self, x):  # [N, 6]: the point and the view direction
        p, d = self.encode(x[:, :3], 10), self.encode(x[:, 3:], 4)
        h = p
        for i, layer in enumerate(self.layers):
            h = F.relu(layer(torch.cat([h, p], 1) if i == 5 else h))
        return torch.cat([self.rgb(torch.cat([self.feat(h), d], 1)), F.relu(self.sigma(h))], 1)


def _softplus():
    return nn.Softplus()


# ---- the catalogue ------------------------------------------------------------------------------------

ZOO: list[Net] = [
    Net("resnet-18", "cnn", bench_models.resnet18, images(224, 112), 8, 1),
    Net("resnet-50", "cnn", resnet50, images(224, 112), 16, 1),
    Net("mobilenet-v3-small", "cnn", mobilenet_v3_small, images(224, 112), 64, 1),
    Net("efficientnet-b0", "cnn", efficientnet_b0, images(224, 112), 32, 1),
    Net("convnext-tiny", "cnn", convnext_tiny, images(224, 112), 16, 1),
    Net("regnet-y-400mf", "cnn", regnet_y_400mf, images(224, 112), 32, 1),
    Net("densenet-121", "cnn", densenet121, images(224, 112), 16, 1),
    Net("squeezenet-1.1", "cnn", squeezenet1_1, images(224, 112), 64, 1),
    Net("shufflenet-v2", "cnn", shufflenet_v2, images(224, 112), 64, 1),
    Net("unet-small", "cnn", UNet, images(256, 128), 8, 1),
    Net("cifar-cnn", "cnn", cifar_cnn, images(32), 4096, 64),
    Net("vit-tiny/16", "transformer", lambda: ViT(192, 12, 3), images(224), 64, 1),
    Net("deit-small/16 distilled", "transformer", lambda: ViT(384, 12, 6, distilled=True), images(224), 32, 1),
    Net("mixer-s/16", "transformer", Mixer, images(224), 32, 1),
    Net("bert-base", "transformer", Bert, tokens(30522, 128, 32), 8, 1),
    Net("gpt-2 small", "transformer", GPT, tokens(50257, 256, 32), 8, 1),
    Net("transformer d64 seq 16", "transformer", transformer_d64, floats(16, 64), 1024, 64),
    Net("gru 64-128 seq 32", "rnn", lambda: RNN("gru"), floats(32, 64), 1024, 16),
    Net("lstm 64-128 seq 32", "rnn", lambda: RNN("lstm"), floats(32, 64), 1024, 16),
    Net("bilstm tagger 2x256", "rnn", lambda: RNN("lstm", 128, 256, 2, True, vocab=10000, classes=20),
        tokens(10000, 64, 32), 64, 4),
    Net("wav2vec2 conv encoder", "audio", AudioEncoder, floats(16000, quick=(4000,)), 8, 1),
    Net("pointnet", "points", PointNet, floats(3, 1024), 32, 4),
    Net("nerf mlp 8x256", "field", NeRF, floats(6), 65536, 4096),
    Net("sdf 3-64x4-1 softplus", "field", lambda: bench_models.act_mlp(3, 64, 4, 1, _softplus), floats(3), 1 << 20, 1 << 14),
    Net("siren 2-256x3-3", "field", lambda: bench_models.act_mlp(2, 256, 3, 3, bench_models._sine, siren=True),
        floats(2), 1 << 18, 1 << 12),
    Net("lenet-5", "cnn", bench_models.lenet5, images(32), 8192, 256),
]
assert len({n.name for n in ZOO}) == len(ZOO)
