"""Every tensor layout a model's state holds, through a real run on the session pool: the
state broadcast at the start and at a grow, a checkpoint and a resume (issue 33, item 1)."""
import torch

from elastic_jupyter import RunConfig, TrainingRun

# the issue's cell (pytorch/examples' PositionalEncoding builds its table as `table` is built
# here), with a tied embedding and output layer and views sharing a storage beside it
CELL = '''
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float64) / 16, torch.tensor(y))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)
        self.embed = torch.nn.Embedding(10, 10)
        self.out = torch.nn.Linear(10, 10, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.zeros(1, 4096, 64).transpose(0, 1))  # >= 1 MiB
        base = torch.arange(10.0)
        self.register_buffer("front", base[:6])
        self.register_buffer("back", base[4:])
        self.register_buffer("nothing", torch.empty(0, 3))
    def forward(self, x):
        return self.out(self.lin(x)) + self.table[0, 0, :10]
torch.manual_seed(0)
model = Net().double()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
'''


def _config(name, steps=8):
    return RunConfig(name=name, global_batch=32, steps=steps, checkpoint_every=4)


def test_a_run_grows_checkpoints_and_resumes_with_every_layout(idle_pool, tmp_path):
    fixed = TrainingRun(idle_pool, _config("fixed"), source=CELL, engines=2,
                        workspace=str(tmp_path / "fixed")).start()
    assert fixed.wait(timeout=180) == "finished", fixed.error
    grown = TrainingRun(idle_pool, _config("grown"), source=CELL, engines=2,
                        schedule=[(3, 3)], workspace=str(tmp_path / "grown")).start()
    assert grown.wait(timeout=180) == "finished", grown.error
    assert {r["world_size"] for r in grown.history} == {2, 3}
    expected = fixed.state_dict()
    for got in (grown.state_dict(),):
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=1e-9, atol=0, msg=k)
    # resumed from the step-8 checkpoint with 3 engines, to step 12
    resumed = TrainingRun(idle_pool, _config("grown", steps=12), source=CELL, engines=3,
                          resume=True, workspace=str(tmp_path / "grown")).start()
    assert resumed.wait(timeout=180) == "finished", resumed.error
    assert [r["step"] for r in resumed.history][-4:] == [9, 10, 11, 12]
    state = resumed.state_dict()
    assert state["table"].shape == (4096, 1, 64)
    assert torch.equal(state["out.weight"], state["embed.weight"])  # still one tensor
    assert not torch.equal(state["out.weight"], expected["out.weight"])  # and trained on
    assert torch.equal(state["front"], torch.arange(6.0, dtype=torch.float64))


def test_the_issues_cell_finishes_instead_of_retrying(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="view", global_batch=32, steps=4,
                                           checkpoint_every=0),
                      source=CELL.replace(".double()", "").replace("float64", "float32"),
                      engines=2, workspace=str(tmp_path)).start()
    assert run.wait(timeout=120) == "finished", run.error
    assert not [e for e in run.events if e["kind"] == "fault"]
