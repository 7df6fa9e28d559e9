"""ResNet-18 and ResNet-50 (torchvision layout), seeded random init with calibrated BatchNorms."""

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


def relu(x: torch.Tensor) -> torch.Tensor:
    """One call per use: X86InductorQuantizer rejects one nn.ReLU module called twice in a
    block (its source partition then has two outputs), so no ReLU module is shared."""
    return nn.functional.relu(x)


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """3x3 -> 3x3 with identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _downsample(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = relu(self.bn1(self.conv1(x)))
        return relu(self.bn2(self.conv2(y)) + identity)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride here, as in torchvision v1.5) -> 1x1 expand x4, plus shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = _downsample(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = relu(self.bn1(self.conv1(x)))
        y = relu(self.bn2(self.conv2(y)))
        return relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    """Stem 7x7/2 + maxpool, four stages (64..512 wide), global average pool, fc."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], depths: tuple[int, ...], num_classes: int = 1000
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for i, depth in enumerate(depths):
            width = 64 * 2**i
            blocks = []
            for j in range(depth):
                blocks.append(block(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _init_weights(model: nn.Module) -> None:
    """torchvision's init: Kaiming-normal (fan_out) convs; BatchNorm scale 1, shift 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _build(
    name: str, block: type[BasicBlock | Bottleneck], depths: tuple[int, ...], description: str
) -> ZooModel:
    with seeded():
        module = ResNet(block, depths)
        calibrate_batchnorm(module, (3, 224, 224))
    return ZooModel(
        name=name,
        module=module,
        spec=image_spec(3, 224, IMAGENET_MEAN, IMAGENET_STD),
        task="classification",
        default_dataset="sample_photos",
        description=description,
    )


def build_resnet18(seq_len: int | None = None) -> ZooModel:
    """ResNet-18 (BasicBlock, 2-2-2-2), random init, 1x3x224x224 -> 1000 logits."""
    return _build(
        "resnet18",
        BasicBlock,
        (2, 2, 2, 2),
        "ResNet-18, seeded random init, BatchNorm statistics from random inputs",
    )


def build_resnet50(seq_len: int | None = None) -> ZooModel:
    """ResNet-50 (Bottleneck, 3-4-6-3), random init, 1x3x224x224 -> 1000 logits."""
    return _build(
        "resnet50",
        Bottleneck,
        (3, 4, 6, 3),
        "ResNet-50, seeded random init, BatchNorm statistics from random inputs",
    )
