"""A model wrapped with torch.compile trains across resizes without being compiled again: the
engines keep the compiled model between generations (the cell runs once per engine)."""
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.run.results import plain_keys

CELL = '''
import torch
import torch._dynamo
from sklearn.datasets import load_digits
torch._dynamo.config.error_on_recompile = True  # a second compilation fails the step
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:960], dtype=torch.float32) / 16,
                                         torch.tensor(y[:960]))
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, 10)), backend="eager")
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''


def test_a_compiled_model_trains_across_resizes_without_recompiling(idle_pool, tmp_path):
    # every micro-batch has 4 samples (12 a step, even at every size of the pool's 1..4; no
    # measuring passes of other sizes; 960 samples: no short last step): one graph per
    # engine, compiled at its first step
    config = RunConfig(name="compiled", global_batch=48, micro_batch=4, steps=24,
                       checkpoint_every=0)
    run = TrainingRun(idle_pool, config, source=CELL, engines=2, schedule=[(8, 1), (16, 2)],
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    assert [(e["step"], e["to"]) for e in run.events if e["kind"] == "resize"] == [(8, 1),
                                                                                (16, 2)]
    assert run.history[-1]["loss"] < run.history[0]["loss"]
    # the plain model's keys (no "_orig_mod."): a plain model and a compiled one both load them
    weights = run.state_dict()
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(torch.load(run.export(str(tmp_path / "model.pt")), weights_only=True)) == \
        set(weights)
    def plain():
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 10))
    assert torch.equal(run.load_into(plain())[2].bias, weights["2.bias"])
    compiled = run.load_into(torch.compile(plain(), backend="eager"))
    assert torch.equal(compiled.state_dict()["_orig_mod.2.bias"], weights["2.bias"])


def test_plain_keys_leave_out_every_compiled_wrapper():
    """A compiled submodule's wrapper too; a plain model's keys are kept as they are."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.compile(torch.nn.Linear(2, 2), backend="eager")
            self.head = torch.nn.Linear(2, 1)
    model = torch.compile(Net(), backend="eager")
    assert "_orig_mod.enc._orig_mod.weight" in model.state_dict()
    assert sorted(plain_keys(model.state_dict())) == ["enc.bias", "enc.weight", "head.bias",
                                                      "head.weight"]
    assert list(plain_keys({"0.weight": 1})) == ["0.weight"]
