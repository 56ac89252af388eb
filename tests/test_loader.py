"""The input pipeline (engine.data.map_pipeline): DataLoader processes fetch each rank's passes
ahead, with the cell's collate_fn and worker_init_fn, and a sample's random transform is the same at
any world size and any number of loader processes."""
import os

import torch
from worlds import cell_namespace, config, train

from elastic_jupyter.engine.worker import Worker

NOISY_CELL = '''
import random
import numpy as np
import torch
class Noisy(torch.utils.data.Dataset):
    """A random transform: each fetch adds fresh noise from torch's generator, numpy's global
    one and Python's random (as torchvision's and albumentations' transforms draw)."""
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(96, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(96, 1, generator=g, dtype=torch.float64)
    def __len__(self):
        return 96
    def __getitem__(self, i):
        noise = 0.1 * torch.randn(4, dtype=torch.float64)
        noise += 0.1 * torch.from_numpy(np.random.standard_normal(4)) * random.random()
        return self.x[i] + noise, self.y[i]
dataset = Noisy()
model = torch.nn.Linear(4, 1).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
'''


def test_random_transforms_give_the_same_samples_at_any_world_size_and_worker_count(tmp_path):
    cfg = config(pool_max_size=3, pass_cost=0.0)  # the same micro-batches at sizes 1..3
    alone = train(NOISY_CELL, dict(cfg, loader_processes=0), 1, 8, tmp_path)[0]
    for world_size, workers in ((2, 2), (3, 1)):
        ranks = train(NOISY_CELL, dict(cfg, loader_processes=workers), world_size, 8, tmp_path)
        for rank in ranks:
            for name, value in alone.params.items():
                assert torch.allclose(rank.params[name], value, rtol=1e-12, atol=0), \
                    (world_size, workers, name)
    fresh = Worker(cell_namespace(NOISY_CELL, 3), dict(cfg, steps=8, seed=4), "cpu")
    for _ in range(8):
        fresh.train_step(0, 1)
    assert not torch.equal(fresh.model.weight.detach(), alone.params["weight"])  # seed matters


PROCESS_CELL = '''
import os
import torch
import torch.utils.data
initialised = []
def worker_init_fn(worker_id):
    initialised.append(worker_id)
class WhereFetched(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.tensor([float(i), float(os.getpid()), float(len(initialised))])
dataset = WhereFetched()
def collate_fn(samples):
    return {"rows": torch.stack(samples), "collated_in": float(os.getpid())}
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
seen = []
def loss_fn(model, batch):
    seen.append(batch)
    return model(batch["rows"][:, :1]).pow(2).mean()
'''


def test_loader_processes_run_the_cells_collate_fn_and_worker_init_fn():
    ns = cell_namespace(PROCESS_CELL, 3)
    worker = Worker(ns, config(steps=4, global_batch=16, loader_processes=2, pass_cost=0.0), "cpu")
    for _ in range(4):
        worker.train_step(0, 1)
    rows = torch.cat([b["rows"] for b in ns["seen"]])
    fetched_in = {int(p) for p in rows[:, 1].tolist()}
    assert os.getpid() not in fetched_in and len(fetched_in) == 2  # both loader processes
    assert set(rows[:, 2].tolist()) == {1.0}  # each ran worker_init_fn once, before fetching
    assert {int(b["collated_in"]) for b in ns["seen"]} == fetched_in
    assert sorted(int(i) for i in rows[:, 0].tolist()) == list(range(64))  # one epoch, once
    worker.end_generation()
