"""A small CNN for scikit-learn's 8x8 digits, trained in-project in seconds and cached.

Training is deterministic (fixed seed, fixed data order) and runs on the shared ``digits`` train
split, so the ``digits`` reader's evaluation split is held-out data for this model. The trained
state_dict is cached under ``$QCOMPILE_CACHE_DIR`` keyed by a hash of the hyper-parameters and of
this file's model and training code: changing either retrains.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from qcompile.zoo import ZooModel
from qcompile.zoo._common import cache_dir, image_spec, seeded

log = logging.getLogger(__name__)

HYPER = {"seed": 0, "epochs": 40, "batch_size": 128, "lr": 1e-2, "weight_decay": 1e-4}


class DigitsCNN(nn.Module):
    """conv3x3(16) -> conv3x3(32) -> maxpool2 -> conv3x3(64) -> global avgpool -> fc(10)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def train(hyper: dict[str, float] = HYPER) -> dict[str, torch.Tensor]:
    """Train a fresh :class:`DigitsCNN` on the digits train split; returns its state_dict."""
    from calibration.digits import digits_split

    images, labels = (torch.from_numpy(a) for a in digits_split("train"))
    with seeded(int(hyper["seed"])):
        model = DigitsCNN()
        opt = torch.optim.Adam(
            model.parameters(), lr=hyper["lr"], weight_decay=hyper["weight_decay"]
        )
        steps = int(hyper["epochs"]) * -(-len(labels) // int(hyper["batch_size"]))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=hyper["lr"], total_steps=steps)
        model.train()
        for _ in range(int(hyper["epochs"])):
            for idx in torch.randperm(len(labels)).split(int(hyper["batch_size"])):
                loss = nn.functional.cross_entropy(model(images[idx]), labels[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return model.eval().state_dict()


def accuracy(module: nn.Module, split: str = "test") -> float:
    """Top-1 accuracy of ``module`` on a digits split (default: held-out test)."""
    from calibration.digits import digits_split

    images, labels = (torch.from_numpy(a) for a in digits_split(split))
    with torch.no_grad():
        return (module(images).argmax(1) == labels).float().mean().item()


# Read once at import: the cache key names the code that trained the weights in the cache.
_CODE = inspect.getsource(DigitsCNN) + inspect.getsource(train)


def cache_path() -> Path:
    """Cache file of the trained weights for this code and these hyper-parameters."""
    key = hashlib.sha256((json.dumps(HYPER, sort_keys=True) + _CODE).encode()).hexdigest()
    return cache_dir() / f"digits_cnn-{key[:16]}.pt"


def _load_cached(path: Path, module: nn.Module) -> bool:
    if not path.exists():
        return False
    try:
        module.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:  # any unreadable cache file just means: retrain
        log.warning("digits_cnn: ignoring unreadable cache %s (%s); retraining", path, exc)
        return False
    return True


def _save_atomically(path: Path, state: dict[str, torch.Tensor]) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache file is an ordinary file
        os.replace(tmp, path)  # readers see the old file or the whole new one, never half
    except OSError as exc:
        log.warning("digits_cnn: could not cache weights at %s (%s)", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def build(seq_len: int | None = None) -> ZooModel:
    """The trained digits CNN (cached after the first build): 1x1x8x8 in [0, 1] -> 10 logits."""
    module = DigitsCNN()
    path = cache_path()
    if not _load_cached(path, module):
        state = train()
        module.load_state_dict(state)
        _save_atomically(path, state)
    return ZooModel(
        name="digits_cnn",
        module=module.eval(),
        spec=image_spec(1, 8, (0.0,), (1.0,)),
        task="classification",
        default_dataset="digits",
        description="small CNN trained in-project on sklearn digits (8x8)",
    )
