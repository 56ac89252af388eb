"""A hook after each committed step, and the state it keeps (issue 33, item 7): an exponential
moving average of the weights, kept as timm's ``ModelEmaV3`` keeps one, in a real Jupyter kernel
with the magics. The run is resized mid-run, checkpointed, resumed in a second run that resizes
again, and must end with the model and EMA weights of a run without resizes (float64)."""
import pytest
import torch

from elastic_jupyter.engine.worker import SetupError, Worker
from kernels import BODY, Kernel, kill_leftovers
from worlds import cell_namespace, config

# the lifecycle test's float64 model, without its sleep, and an EMA of it
CELL = BODY.replace("    time.sleep(0.01)\n", "") + '''
import copy

class ModelEma(torch.nn.Module):
    """As timm's ModelEmaV3: a copy of the model, lerped towards it after each step, with a
    warm-up of the decay by the step count."""
    def __init__(self, model, decay=0.9):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
    @torch.no_grad()
    def update(self, model, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for ema, now in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema.lerp_(now, 1 - decay) if ema.is_floating_point() else ema.copy_(now)

ema = ModelEma(model)
extra_state = {"ema": ema}
def after_step(model, optimizer, step):
    ema.update(model, step)
'''

COMPARE = '''
import json as _json
def _deviation(a, b):
    return max(float(((a[k] - b[k]).abs() / b[k].abs().clamp(min=1e-300)).max()) for k in b)
print("@@" + _json.dumps({
    "model": _deviation(resumed.state_dict(), fixed.state_dict()),
    "ema": _deviation(resumed.state_dict("ema"), fixed.state_dict("ema")),
    "ema_moved": _deviation({k.removeprefix("module."): v
                             for k, v in fixed.state_dict("ema").items()}, fixed.state_dict()),
    "sizes": sorted({r["world_size"] for r in first.history + resumed.history}),
    "steps": [first.history[-1]["step"], resumed.history[-1]["step"]],
    "resumed_from": resumed.events[0].get("resumed_from")}))
'''


def test_an_ema_kept_by_after_step_survives_resizes_checkpoints_and_resume(tmp_path):
    kernel = Kernel(tmp_path)
    try:
        kernel.execute("%load_ext elastic_jupyter\n%elastic_pool start -n 2 --max 3 --gpus none")
        options = "--global-batch 64 --seed 3 --checkpoint-every 4 --wait --no-dashboard"
        kernel.execute(f"%%elastic_train fixed --name fixed --steps 12 {options}\n{CELL}")
        kernel.execute(f"%%elastic_train first --name ema --steps 8 --schedule 3:3 {options}\n"
                       f"{CELL}")
        kernel.execute(f"%%elastic_train resumed --name ema --steps 12 --resume --schedule 10:1 "
                       f"{options}\n{CELL}")
        (out,) = kernel.execute(COMPARE)
    finally:
        kernel.close()
        kill_leftovers(kernel.seen)
    assert out["sizes"] == [1, 2, 3] and out["steps"] == [8, 12] and out["resumed_from"], out
    assert out["ema_moved"] > 1e-3  # the average lags the weights: a real EMA was kept
    assert out["model"] < 1e-9 and out["ema"] < 1e-9, out


def test_extra_state_and_after_step_are_checked_at_setup():
    base = CELL.split("class ModelEma")[0]
    for extra, message in (("extra_state = [1]", "extra_state must be a dict"),
                           ("extra_state = {'ema': 3}", "has no state_dict"),
                           ("extra_state = {'model': model}", "cannot be named 'model'"),
                           ("after_step = 3", "after_step must be a function")):
        with pytest.raises(SetupError, match=message):
            Worker(cell_namespace(base + extra + "\n", 0), config(steps=2), "cpu")
    worker = Worker(cell_namespace(CELL, 0), config(steps=2), "cpu")
    state = worker.capture()
    assert set(state["extra"]) == {"ema"} and all(
        torch.equal(state["extra"]["ema"][k], v) for k, v in worker.extra_state["ema"]
        .state_dict().items())


def _newcomer_rank(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist
    from elastic_jupyter.engine.group.state_transfer import broadcast_state
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        worker = Worker(cell_namespace(CELL, rank), config(steps=6), "cpu")
        if rank == 0:  # the survivor trained 3 steps; the newcomer was just set up
            for _ in range(3):
                worker.train_step(0, 1)
        own = worker.capture(copy_tensors=False)
        state = broadcast_state(own if rank == 0 else None, rank, worker.device,
                                into=own if rank else None)
        if rank:
            worker.restore(state)
        torch.save({k: v.clone() for k, v in worker.extra_state["ema"].state_dict().items()},
                   f"{out}/ema{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_newcomer_receives_the_ema(tmp_path):
    from worlds import spawn
    spawn(_newcomer_rank, (str(tmp_path / "store"), str(tmp_path)), 2)
    survivor, newcomer = (torch.load(tmp_path / f"ema{r}.pt") for r in range(2))
    fresh = Worker(cell_namespace(CELL, 1), config(steps=6), "cpu").extra_state["ema"]
    assert not torch.equal(fresh.state_dict()["module.0.weight"], survivor["module.0.weight"])
    for k, v in survivor.items():
        assert torch.equal(newcomer[k], v), k
