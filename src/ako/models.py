"""Model registry: small classifiers for 28x28 (Fashion-MNIST, MNIST) and 8x8 (digits) images.

Every model maps a batch `x` of shape (B, C, H, W), float32, to logits of shape (B, classes).
The input shape and the class count come from the data set, so one name works for every data set.
Normalisation layers are GroupNorm, not BatchNorm: a model's whole state is then its parameters,
which is what the strategies exchange (BatchNorm's running statistics would stay per replica).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MODELS: dict[str, Callable[[tuple[int, int, int], int], nn.Module]] = {}


def register(name: str):
    """Decorator: add `factory(input_shape, num_classes) -> nn.Module` to MODELS under `name`."""

    def add(factory):
        MODELS[name] = factory
        return factory

    return add


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options) -> nn.Module:
    """Build the registered model `name` for inputs of shape (C, H, W) (the gpt: (context,) token
    ids) and `num_classes` classes (the gpt: the vocabulary's size); `options` are the gpt's sizes
    (`GPT_OPTIONS`).

    Raises ValueError (one line, naming the choices) for an unknown name.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    return MODELS[name](tuple(input_shape), num_classes, **options)


def model_options(name: str, settings) -> dict:
    """The keyword arguments of model `name` from `settings` (a TrainConfig, or a dict of its
    fields): the gpt's sizes; none for the image models."""
    get = settings.get if isinstance(settings, dict) else lambda k, d=None: getattr(settings, k, d)
    return {k: get(k) for k in GPT_OPTIONS if get(k) is not None} if name == "gpt" else {}


def _flat_size(features: nn.Module, input_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).shape[1]


class _ChannelsLastMax(torch.autograd.Function):
    """2-D max pooling (kernel = stride = k, no padding) of x (B, C, H, W), computed in the
    channels-last layout, whose CPU kernel is vectorised over channels (about 5x faster than the
    NCHW one, which took a third of the cnn's forward and backward); the backward is the NCHW
    kernel's, with the same indices, itself differentiable (double backward). Bit for bit
    nn.MaxPool2d (ties and NaN included: tests/test_training.py)."""

    @staticmethod
    def forward(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, indices = torch.ops.aten.max_pool2d_with_indices(x.contiguous(memory_format=torch.channels_last), [k, k], [k, k])
        layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() else torch.contiguous_format
        return out.contiguous(memory_format=layout), indices.contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, k = inputs
        ctx.save_for_backward(x, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.k = k

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _indices_grad):
        x, indices = ctx.saved_tensors
        k = [ctx.k, ctx.k]
        return torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, k, k, [0, 0], [1, 1], False, indices), None


# torch.func's transforms (vmap, grad, jacrev) cannot query a channels-last layout
_transforming = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d(k), with `_ChannelsLastMax` on the CPU; the same results, faster. Under
    TorchScript, torch.func's transforms and forward-mode AD it is nn.MaxPool2d."""

    def __init__(self, k: int):
        super().__init__(k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.max_pool2d(x, self.kernel_size, self.stride)
        return self._eager(x)

    @torch.jit.unused
    def _eager(self, x):
        if x.device.type != "cpu" or x.dim() != 4 or _transforming() or torch.autograd.forward_ad._current_level >= 0:
            return F.max_pool2d(x, self.kernel_size, self.stride)
        return _ChannelsLastMax.apply(x, self.kernel_size)[0]


@register("mlp")
def mlp(input_shape: tuple[int, int, int], num_classes: int, hidden: int = 256) -> nn.Module:
    """Two hidden layers of `hidden` units with ReLU (235,146 parameters at 1x28x28 with 10 classes)."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Linear(hidden // 2, num_classes),
    )


@register("cnn")
def cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Two 3x3 conv layers (16, 32 channels, each + ReLU + 2x2 max-pool) and two fully connected
    layers (128 hidden units): 206,922 parameters at 1x28x28 with 10 classes."""
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 3, padding=1),
        nn.ReLU(),
        MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        MaxPool2d(2),
        nn.Flatten(),
    )
    return nn.Sequential(
        features,
        nn.Linear(_flat_size(features, input_shape), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


class _Block(nn.Module):
    """Basic residual block: two 3x3 convs with GroupNorm; 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.GroupNorm(8, cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.GroupNorm(8, cout),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


@register("resnet")
def resnet(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """A small ResNet (ResNet-8 shape): a 16-channel stem, three residual stages of 16, 32 and 64
    channels (the last two at stride 2), global average pooling, one linear layer: 77,754
    parameters for 10 classes."""
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False),
        nn.GroupNorm(8, 16),
        nn.ReLU(),
        _Block(16, 16, 1),
        _Block(16, 32, 2),
        _Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


class _Attention(nn.Module):
    """Causal multi-head self-attention through `scaled_dot_product_attention` (its fused
    kernels): x (B, T, width) -> (B, T, width)."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        # No bias: softmax ignores a key bias (it adds the same to every score of a query), so
        # its true gradient is 0 and AdamW would turn rounding noise into full-size steps.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class _Layer(nn.Module):
    """A pre-LayerNorm transformer block: x + attention(norm(x)), then + MLP(norm(x)) with a 4x
    hidden layer and GELU."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = _Attention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2's shape, as nanoGPT has it): token and
    learned position embeddings, `layers` pre-LayerNorm blocks of causal self-attention and a
    4x MLP, a final LayerNorm, and an output layer.

    Maps token ids (B, T), int64 with T <= context, to next-token logits (B, T, vocab_size).
    At the defaults and fortunes' 113 characters: 837,120 parameters (3.3 MB in fp32).

    Raises ValueError when width is not a multiple of heads.
    """

    def __init__(self, vocab_size: int, context: int = 128, layers: int = 4, heads: int = 4, width: int = 128,
                 dropout: float = 0.0):  # fmt: skip
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.context = context
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Layer(width, heads, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        # Untied, with torch's own initialisation: on fortunes at this size, GPT-2's (normal 0.02,
        # tied) reached 3.09 nats after 100 steps of 16, this 2.58 (docs/training.md).
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's context of {self.context}")
        x = self.drop(self.tokens(idx) + self.positions(torch.arange(t, device=idx.device)))
        return self.head(self.norm(self.blocks(x)))


GPT_OPTIONS = ("layers", "heads", "width", "dropout")  # TrainConfig fields the gpt model takes (and context)


@register("gpt")
def gpt(input_shape: tuple[int, ...], num_classes: int, layers: int = 4, heads: int = 4, width: int = 128,
        dropout: float = 0.0) -> nn.Module:  # fmt: skip
    """`GPT` for sequences of input_shape = (context,) token ids over a vocabulary of
    `num_classes` tokens (a text data set's)."""
    if len(input_shape) != 1:
        raise ValueError(f"gpt takes sequences of token ids, not inputs of shape {tuple(input_shape)}: train it on text "
                         "(--dataset fortunes or text:PATH)")  # fmt: skip
    return GPT(num_classes, input_shape[0], layers, heads, width, dropout)
