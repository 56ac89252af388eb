"""A model wrapped with torch.compile trains across resizes without being compiled again: the
engines keep the compiled model between generations (the cell runs once per engine)."""
from elastic_jupyter import RunConfig, TrainingRun

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
                       pass_cost=0.0, checkpoint_every=0)
    run = TrainingRun(idle_pool, config, source=CELL, engines=2, schedule=[(8, 1), (16, 2)],
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    assert [(e["step"], e["to"]) for e in run.events if e["kind"] == "resize"] == [(8, 1),
                                                                                (16, 2)]
    assert run.history[-1]["loss"] < run.history[0]["loss"]
    assert set(run.state_dict()) == {"_orig_mod.0.weight", "_orig_mod.0.bias",
                                     "_orig_mod.2.weight", "_orig_mod.2.bias"}
