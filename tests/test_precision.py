"""--precision bf16|fp16: loss_fn under torch.autocast; fp16's gradient scaler decides on the
reduced gradients (the same skip on every rank) and its state is part of the training state."""
import contextlib

import pytest
import torch
from worlds import cell_namespace, config, max_relative_deviation, reference, train

from elastic_jupyter import RunConfig, UsageError
from elastic_jupyter.engine.step import precision as precision_mod
from elastic_jupyter.engine.worker import SetupError, Worker
from elastic_jupyter.ui.magics import _train_parser

CELL = '''
import torch
import torch.distributed as dist
g = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                         torch.randn(64, 1, generator=g))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
_calls = [0]
def loss_fn(model, batch):
    x, y = batch
    _calls[0] += 1
    loss = torch.nn.functional.mse_loss(model(x), y)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _calls[0] == 1 and rank == OVERFLOW_RANK:  # this rank's first gradients overflow
        loss = loss * 1e38
    dtype = torch.get_autocast_dtype("cpu")
    return loss, {"autocast": float(torch.is_autocast_enabled("cpu")),
                  "bf16": float(dtype == torch.bfloat16), "fp16": float(dtype == torch.float16)}
'''


def cell(overflow_rank: int = -1) -> str:
    return CELL.replace("OVERFLOW_RANK", str(overflow_rank))


def test_bf16_runs_loss_fn_under_autocast(tmp_path):
    cfg = config(precision="bf16")
    expected = reference(cell(), cfg, steps=6)
    [alone] = train(cell(), cfg, 1, 6, tmp_path)
    for k in expected.params:  # one rank, one pass: exactly plain PyTorch under autocast
        assert torch.equal(alone.params[k], expected.params[k]), k
    assert {(r["autocast"], r["bf16"]) for r in alone.history} == {(1.0, 1.0)}
    ranks = train(cell(), dict(cfg, micro_batch=3), 2, 6, tmp_path)
    for got in ranks:
        assert max_relative_deviation(got.params, expected.params) < 2e-2
        assert all(v.dtype == torch.float32 for v in got.params.values())
    for k in expected.params:
        assert torch.equal(ranks[0].params[k], ranks[1].params[k]), k
    plain = reference(cell(), config(), steps=6)  # without autocast the result differs
    assert max_relative_deviation(plain.params, expected.params) > 1e-4


def test_fp16_with_one_rank_is_plain_amp(tmp_path):
    cfg = config(precision="fp16")
    expected = reference(cell(), cfg, steps=6)
    [alone] = train(cell(), cfg, 1, 6, tmp_path)
    for k in expected.params:
        assert torch.equal(alone.params[k], expected.params[k]), k
    assert alone.scaler == expected.scaler
    assert {(r["autocast"], r["fp16"]) for r in alone.history} == {(1.0, 1.0)}


def test_fp16_skips_a_step_on_every_rank_when_one_rank_overflows(tmp_path):
    start = {k: v.detach() for k, v in cell_namespace(cell(1), 3)["model"].named_parameters()}
    ranks = train(cell(1), config(precision="fp16", micro_batch=3), 2, 1, tmp_path)
    for got in ranks:  # rank 0's own gradients were finite: it skips because the sum is not
        assert all(torch.equal(got.params[k], start[k]) for k in start)
        assert got.scaler["scale"] == 65536.0 / 2
    ranks = train(cell(1), config(precision="fp16", micro_batch=3), 2, 5, tmp_path)
    assert ranks[0].scaler == ranks[1].scaler
    for k in start:
        assert torch.equal(ranks[0].params[k], ranks[1].params[k]), k
        assert not torch.equal(ranks[0].params[k], start[k]), k  # later steps were taken


def test_the_gradient_scaler_is_part_of_the_training_state(tmp_path):
    cfg = config(precision="fp16", steps=2)
    worker = Worker(cell_namespace(cell(0), 3), cfg, "cpu")
    worker.train_step(0, 1)  # skipped: the scale backs off
    state = worker.capture()
    torch.save(state, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain data
    assert state["grad_scaler"]["scale"] == 32768.0
    fresh = Worker(cell_namespace(cell(), 3), cfg, "cpu")
    assert fresh.precision.scaler.get_scale() == 65536.0
    fresh.restore(state)
    assert fresh.precision.scaler.state_dict() == worker.precision.scaler.state_dict()


def test_a_precision_torch_cannot_autocast_to_is_refused_at_setup(monkeypatch):
    # as on a torch whose CPU autocast has no fp16: it warns and runs in fp32
    monkeypatch.setattr(precision_mod.torch, "autocast", lambda *a, **k: contextlib.nullcontext())
    with pytest.raises(SetupError, match=r"--precision fp16: torch .* cannot autocast to "
                                         r"torch.float16 on cpu slots; use --precision bf16"):
        Worker(cell_namespace(cell(), 3), config(precision="fp16", steps=1), "cpu")
    with pytest.raises(precision_mod.PrecisionError):
        precision_mod.Precision("bf16", torch.device("cpu"))


def test_the_precision_option():
    assert _train_parser().parse_args(["--name", "x", "--precision", "bf16"]).precision == "bf16"
    assert _train_parser().parse_args(["--name", "x"]).precision is None
    with pytest.raises(UsageError, match="--precision takes bf16 or fp16"):
        RunConfig(name="x", precision="fp8").validate()
