"""The ecosystem's models on default settings (issue 33): a ResNet-18 as torchvision defines it,
with BatchNorm, random augmentation in the dataset and two loader processes, trains on the default
cut (one micro-batch per slot of the pool's --max: 8 samples) as a plain PyTorch loop does; two
runs of one cell are bitwise equal, and a resized run equals a fixed one.

torchvision's PyPI wheel does not import beside the CPU torch here, so the model is written below
as torchvision's ``resnet18`` builds it (BasicBlock, [2, 2, 2, 2], Kaiming init).
"""
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.data.batching import epoch_permutation

CELL = '''
import torch
from torch import nn
from sklearn.datasets import load_digits


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(64, layers[0])
        self.layer2 = self._layer(128, layers[1], 2)
        self.layer3 = self._layer(256, layers[2], 2)
        self.layer4 = self._layer(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Digits(torch.utils.data.Dataset):
    """scikit-learn's digits as 3 x 32 x 32 images, randomly shifted and flipped per sample
    (torch's generator: seeded per sample by the loader, as torch's DataLoader seeds it)."""

    def __init__(self, dtype):
        X, y = load_digits(return_X_y=True)
        images = torch.tensor(X, dtype=dtype).reshape(-1, 1, 8, 8) / 16
        self.images = nn.functional.interpolate(images, size=28).expand(-1, 3, -1, -1)
        self.labels = torch.tensor(y)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        padded = nn.functional.pad(self.images[i], (2, 2, 2, 2))
        dx, dy = torch.randint(0, 5, (2,)).tolist()
        image = padded[:, dy:dy + 28, dx:dx + 28]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return nn.functional.pad(image, (2, 2, 2, 2)), self.labels[i]


torch.manual_seed(0)
dataset = Digits(DTYPE)
model = ResNet(num_classes=10).to(DTYPE)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
'''
BATCH, MICRO = 32, 8  # the default cut on the test pool (--max 4): 32 / 4


def cell(dtype: str) -> str:
    return CELL.replace("DTYPE", f"torch.{dtype}")


def _run(pool, tmp_path, name, source, steps, engines=2, schedule=()):
    config = RunConfig(name=name, global_batch=BATCH, steps=steps, loader_processes=2,
                       checkpoint_every=0, seed=0)
    run = TrainingRun(pool, config, source=source, engines=engines, schedule=list(schedule),
                      workspace=str(tmp_path / name)).start()
    assert run.wait(timeout=600) == "finished", run.error
    return run


def plain_pytorch_losses(source: str, steps: int) -> list[float]:
    """The same cell in a plain single-process loop: each global batch of 32 (the run's samples,
    in the run's order) accumulated over micro-batches of 8, one optimizer step each."""
    ns = {}
    exec(source, ns)
    model, optimizer, data, loss_fn = ns["model"], ns["optimizer"], ns["dataset"], ns["loss_fn"]
    n, losses, epoch, position = len(data), [], 0, 0
    for _ in range(steps):
        batch = epoch_permutation(0, epoch, n)[position:position + BATCH]
        optimizer.zero_grad()
        total = 0.0
        for micro in batch.split(MICRO):
            x, y = torch.utils.data.default_collate([data[int(i)] for i in micro])
            loss = loss_fn(model, (x, y)) * len(micro) / len(batch)
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
        position += len(batch)
        epoch, position = (epoch + 1, 0) if position >= n else (epoch, position)
    return losses


def test_resnet18_trains_on_the_default_cut_as_a_plain_loop_does(idle_pool, tmp_path):
    steps = 120
    run = _run(idle_pool, tmp_path, "resnet", cell("float32"), steps)
    cut, = [e for e in run.events if e["kind"] == "micro_batches"]
    assert cut["micro_batches"] == BATCH // MICRO and cut["floor"] == 8, cut
    assert "floor 8: BatchNorm" in cut["message"]
    losses = [r["loss"] for r in run.history]
    torch.manual_seed(0)
    plain = plain_pytorch_losses(cell("float32"), steps)
    first, last, plain_last = (sum(x[-20:] if i else x[:20]) / 20
                               for i, x in ((0, losses), (1, losses), (1, plain)))
    print(f"ResNet-18, digits 32x32, B=32 on the default cut: first 20 steps {first:.3f}, "
          f"last 20 {last:.3f}; plain PyTorch loop last 20 {plain_last:.3f}")
    assert abs(last - plain_last) <= max(0.1 * plain_last, 0.05)
    assert last < first / 2


def test_one_cell_gives_one_result_and_a_resize_changes_nothing(idle_pool, tmp_path):
    """float64, 10 steps: two runs of the cell end bitwise equal; 2 -> 3 -> 1 equals 2."""
    source = cell("float64")
    runs = [_run(idle_pool, tmp_path, f"same{i}", source, 10) for i in range(2)]
    resized = _run(idle_pool, tmp_path, "resized", source, 10, schedule=[(3, 3), (6, 1)])
    assert [r["world_size"] for r in resized.history] == [2] * 3 + [3] * 3 + [1] * 4
    first, second, moved = (r.state_dict() for r in (*runs, resized))
    for k, v in first.items():
        assert torch.equal(second[k], v), k
        if v.is_floating_point():
            torch.testing.assert_close(moved[k], v, rtol=1e-9, atol=1e-12, msg=k)
        else:
            assert torch.equal(moved[k], v), k


# a small BatchNorm CNN on 101 of digits' samples: 3 steps of 32, then a short step of 5; its
# loss_fn mixes pairs of samples as timm's Mixup does, which asserts an even batch
MIXUP_CELL = '''
import numpy as np
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:101], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16,
                                         torch.tensor(y[:101]))
model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                            torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    x, y = batch
    assert len(x) % 2 == 0, "Batch size should be even when using this"
    lam = float(np.random.beta(1.0, 1.0))
    mixed = lam * x + (1 - lam) * x.flip(0)
    out = model(mixed)
    ce = torch.nn.functional.cross_entropy
    return lam * ce(out, y) + (1 - lam) * ce(out, y.flip(0))
'''


def test_a_short_last_step_is_one_micro_batch_and_a_failing_pass_says_its_size(idle_pool,
                                                                                  tmp_path):
    """Was: refused at setup (the step of 5 cut into 4 micro-batches, BatchNorm on 1 sample);
    and Mixup's assertion never said the micro-batch held 3 samples. Now the 5 samples are one
    micro-batch, the assertion's error says so and what to change, and --drop-last trains."""
    def run(drop_last):
        config = RunConfig(name=f"mixup-{drop_last}", global_batch=32, steps=4,
                           checkpoint_every=0, drop_last=drop_last)
        run = TrainingRun(idle_pool, config, source=MIXUP_CELL, engines=2,
                          workspace=str(tmp_path)).start()
        return run, run.wait(timeout=120)

    failed, state = run(False)
    assert state == "failed" and failed.step == 3, failed.error
    assert "Batch size should be even" in failed.error
    assert "this pass ran a micro-batch of 5 samples at step 4, a step of 5" in failed.error
    assert "--drop-last for an epoch's short last step" in failed.error
    finished, state = run(True)
    assert state == "finished", finished.error
    assert [r["epoch"] for r in finished.history] == [0, 0, 0, 1]  # the 5 left out
