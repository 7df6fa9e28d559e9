"""MobileNetV2 (torchvision layout, width 1.0), seeded random init with calibrated BatchNorms."""

from __future__ import annotations

import torch
from torch import nn

from qcompile.zoo import ZooModel
from qcompile.zoo._common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    calibrate_batchnorm,
    image_spec,
    seeded,
)

# stage: (expand ratio, output channels, repeats, first stride)
STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Module:
    """Conv (no bias) -> BatchNorm -> ReLU6, 'same' padding."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """1x1 expand (ReLU6) -> 3x3 depthwise (ReLU6) -> 1x1 linear projection (+ identity)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        layers = [conv_bn_relu6(cin, mid, 1)] if expand != 1 else []
        layers += [
            conv_bn_relu6(mid, mid, 3, stride, groups=mid),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2(nn.Module):
    """Stem 3x3/2 (32) -> 17 inverted residuals -> 1x1 (1280) -> avgpool -> fc."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers, cin = [conv_bn_relu6(3, 32, 3, 2)], 32
        for expand, cout, repeats, stride in STAGES:
            for i in range(repeats):
                layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        layers.append(conv_bn_relu6(cin, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(1280, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def _init_weights(model: nn.Module) -> None:
    """torchvision's init: Kaiming-normal (fan_out) convs, N(0, 0.01) classifier, zero biases."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)


def build(seq_len: int | None = None) -> ZooModel:
    """MobileNetV2, random init, 1x3x224x224 -> 1000 logits."""
    with seeded():
        module = MobileNetV2()
        calibrate_batchnorm(module, (3, 224, 224))
    return ZooModel(
        name="mobilenet_v2",
        module=module,
        spec=image_spec(3, 224, IMAGENET_MEAN, IMAGENET_STD),
        task="classification",
        default_dataset="sample_photos",
        description="MobileNetV2 (ReLU6), seeded random init, calibrated BatchNorms",
    )
