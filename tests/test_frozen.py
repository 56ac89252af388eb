"""Frozen weights never move (issue 36): a LoRA fine-tune as users run it, in a real kernel with
the magics — a Hugging Face causal LM loaded with ``from_pretrained`` from a folder the test
wrote with ``save_pretrained`` (nothing downloaded) under a ``peft`` LoRA adapter — grows,
checkpoints and resumes moving only the adapter and its optimizer state, and ends where a run
fixed at two ranks ends (float64). Then the bad inputs: engines that build other frozen weights,
a resume on another base model, a frozen tensor that changes during training.
"""
import subprocess
import sys

import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.state.frozen import FrozenWeights, FrozenWeightsError, frozen_keys
from elastic_jupyter.run.run import RunSetupError
from kernels import Kernel, kill_leftovers
from test_bad_input import assert_pool_still_trains, unique

BASE = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed({seed})
LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=64)).save_pretrained({folder!r})
'''

CELL = '''
import os
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float64)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1,
                                         target_modules=["q_proj", "v_proj"]))
text = open(os.__file__, "rb").read()  # Python's own source, as bytes: a vocabulary of 256
dataset = torch.tensor(list(text[:33 * 384]), dtype=torch.long).view(384, 33)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

def loss_fn(model, batch):
    return model(input_ids=batch, labels=batch).loss
'''

COMPARE = '''
import json as _json
def _deviation(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(((a[k] - b[k]).abs() / b[k].abs().clamp(min=1e-300)).max()) for k in b)
_trained = fixed.state_dict()
_grows = [e for e in first.events if e["kind"] == "state_sent"]
_checkpoints = [e for e in first.events + resumed.events if e["kind"] == "checkpoint"]
exec(CELL_SOURCE)  # the model as the cell builds it, here in the kernel
_built = model
resumed.load_into(_built)
_other = AutoModelForCausalLM.from_pretrained("other", dtype=torch.float64)
_other = get_peft_model(_other, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
try:
    resumed.load_into(_other)
    _refused = ""
except Exception as e:
    _refused = str(e)
print("@@" + _json.dumps({
    "model": _deviation(resumed.state_dict(), _trained),
    "loaded": max(float((_built.state_dict()[k] - v).abs().max())
                  for k, v in resumed.state_dict().items()),
    "keys": sorted({k.split(".")[-3] for k in _trained}),
    "trainable_bytes": sum(v.numel() * v.element_size() for v in _trained.values()),
    "grows": _grows, "checkpoints": [c["bytes"] for c in _checkpoints],
    "frozen_events": [e["message"] for e in first.events if e["kind"] == "frozen"],
    "refused": _refused,
    "sizes": sorted({r["world_size"] for r in first.history + resumed.history}),
    "steps": [first.history[-1]["step"], resumed.history[-1]["step"]]}))
'''

RESUME_ON_OTHER_BASE = '''
import json as _json
try:
    get_ipython().run_cell_magic("elastic_train", "bad --name lora --steps 12 --resume "
                                 "--global-batch 16 --seed 3 --wait --no-dashboard", OTHER_CELL)
    print("@@" + _json.dumps({"error": None}))
except Exception as e:
    print("@@" + _json.dumps({"error": str(e), "kind": type(e).__name__}))
import os as _os
print("@@" + _json.dumps({"left": sorted(_os.listdir("elastic-checkpoints/lora"))}))
'''


def test_a_lora_fine_tune_moves_and_writes_only_its_adapter_and_resumes_exactly(tmp_path):
    kernel = Kernel(tmp_path)
    try:
        kernel.execute(BASE.format(seed=0, folder="base") + BASE.format(seed=1, folder="other"))
        kernel.execute(f"CELL_SOURCE = {CELL.format(folder='base')!r}\n"
                       f"OTHER_CELL = {CELL.format(folder='other')!r}")
        kernel.execute("%load_ext elastic_jupyter\n%elastic_pool start -n 2 --max 3 --gpus none")
        options = "--global-batch 16 --seed 3 --checkpoint-every 4 --wait --no-dashboard"
        cell = CELL.format(folder="base")
        kernel.execute(f"%%elastic_train fixed --name fixed --steps 12 {options}\n{cell}")
        kernel.execute(f"%%elastic_train first --name lora --steps 8 --schedule 3:3 {options}\n"
                       f"{cell}")
        kernel.execute(f"%%elastic_train resumed --name lora --steps 12 --resume "
                       f"--schedule 10:1 {options}\n{cell}")
        (out,) = kernel.execute(COMPARE)
        before = sorted((tmp_path / "elastic-checkpoints" / "lora").iterdir())
        bad, left = kernel.execute(RESUME_ON_OTHER_BASE)
    finally:
        kernel.close()
        kill_leftovers(kernel.seen)
    assert out["sizes"] == [1, 2, 3] and out["steps"] == [8, 12], out
    assert out["model"] < 1e-9, out  # resized, checkpointed and resumed = fixed at 2
    assert out["keys"] == ["lora_A", "lora_B"], out  # the state holds the adapter alone
    assert out["loaded"] == 0.0, out  # load_into a model built as the cell builds it
    assert "frozen weights that `model` does not hold" in out["refused"], out
    # the adapter (32k float64) and AdamW's two moments; the base (1.4M) never moves
    trained_state = 3 * out["trainable_bytes"]
    # the run's start sends rank 1 the setup's state, the grow at step 3 its state then
    assert [g["step"] for g in out["grows"]] == [0, 3], out
    for grow in out["grows"]:
        assert grow["bytes"] <= 1.2 * trained_state < grow["frozen_bytes"] / 10, out
    assert out["checkpoints"] and all(b <= 1.2 * trained_state for b in out["checkpoints"]), out
    assert "21 frozen tensors" in out["frozen_events"][0], out
    # a resume on another base model is refused, naming a tensor; the checkpoints stay
    assert bad["kind"] == "UsageError" and "other frozen weights" in bad["error"], bad
    assert "'base_model.model.model.embed_tokens.weight'" in bad["error"], bad
    assert "--name" in bad["error"], bad
    assert left["left"] == [p.name for p in before], (left, before)


# ------------------------------------------------------------------ the rules, and bad input

def test_which_tensors_are_frozen():
    """Parameters without requires_grad, and buffers of modules whose parameters all are
    (a module without parameters follows its parent), but never running statistics."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Identity()),
                                torch.nn.Linear(4, 2))
    model[2][1].register_buffer("table", torch.arange(3.0))
    model[3].register_buffer("scale", torch.ones(1))
    for part in model[:3]:
        part.requires_grad_(False)
    assert frozen_keys(model) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.0.weight",
                                  "2.0.bias", "2.1.table"]
    assert FrozenWeights(model, stay=False).names == frozenset()


def test_states_without_digests_tied_weights_and_a_load_refused_before_it_starts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, as GPT-2's embedding and head
    model[0].requires_grad_(False)
    frozen = FrozenWeights(model)
    assert frozen.names == {"0.weight", "1.weight"} and frozen.nbytes == 10 * 4 * 4  # once
    # a state that holds its frozen weights (--move-frozen, or written before they stayed)
    old = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    frozen.check(old)
    other = {"model": dict(old["model"], **{"0.weight": torch.zeros(10, 4),
                                            "1.weight": torch.zeros(10, 4)})}
    with pytest.raises(FrozenWeightsError, match="resume with --move-frozen"):
        frozen.check(other)
    # a key this model lacks: refused naming it, with nothing loaded
    bias = model[1].bias.detach().clone()
    state = {"model": {"1.bias": torch.ones(10), "2.bias": torch.ones(1)},
             "frozen": dict(frozen.digests)}
    with pytest.raises(FrozenWeightsError, match=r"unexpected \['2.bias'\]"):
        frozen.load(state["model"], state)
    assert torch.equal(model[1].bias, bias)
    del state["model"]["2.bias"]
    frozen.load(state["model"], state)
    assert torch.equal(model[1].bias, torch.ones(10))


FROZEN_BY_ENGINE = '''
import os
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
torch.manual_seed({seed})
backbone = torch.nn.Linear(64, 32).requires_grad_(False)
head = torch.nn.Linear(32, 10)
model = torch.nn.Sequential(backbone, torch.nn.ReLU(), head)
optimizer = torch.optim.SGD(head.parameters(), lr=0.05)
def loss_fn(model, batch):
    x, y = batch
    {change}
    return torch.nn.functional.cross_entropy(model(x), y)
'''


def test_engines_that_build_other_frozen_weights_are_refused_at_setup(idle_pool, tmp_path):
    source = FROZEN_BY_ENGINE.format(seed="os.getpid()", change="")  # unseeded, in effect
    idle_pool.resize(2)  # two engines to differ (an earlier test may leave the pool at one)
    run = TrainingRun(idle_pool, RunConfig(name=unique("frozen-differ"), steps=10),
                      source=source, workspace=tmp_path)
    with pytest.raises(RunSetupError) as refused:
        run.start()
    message = str(refused.value)
    assert "built other frozen weights" in message and "'0.weight'" in message, message
    assert "seed before building them" in message and "--move-frozen" in message, message
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)


def test_a_frozen_tensor_that_changes_fails_the_run_at_its_checkpoint(idle_pool, tmp_path):
    change = "with torch.no_grad(): model[0].bias.add_(1e-3)"
    run = TrainingRun(idle_pool, RunConfig(name=unique("frozen-moves"), steps=12,
                                           checkpoint_every=4),
                      source=FROZEN_BY_ENGINE.format(seed=0, change=change), workspace=tmp_path)
    run.start()
    assert run.wait(timeout=120) == "failed"
    assert "frozen tensor '0.bias' (a parameter with requires_grad=False) changed" in run.error, \
        run.error
    assert "--move-frozen" in run.error
    assert not [c for c in run.checkpoints if c["step"] >= 4]  # none written without it
    # the same cell with --move-frozen trains, and its state holds the frozen tensors
    moved = TrainingRun(idle_pool, RunConfig(name=unique("frozen-moved"), steps=12,
                                             checkpoint_every=4, move_frozen=True),
                        source=FROZEN_BY_ENGINE.format(seed=0, change=change),
                        workspace=tmp_path)
    moved.start()
    assert moved.wait(timeout=120) == "finished", moved.error
    assert {"0.weight", "0.bias", "2.weight"} <= set(moved.state_dict())


def test_a_sharded_lora_fine_tune_keeps_its_base_where_each_cell_built_it(idle_pool, tmp_path):
    # --shard: FSDP2 leaves the frozen base whole on every rank (ignored_params), so the
    # rows that move, the partner replicas and the checkpoint parts are the adapter's alone
    for seed, folder in ((0, "base"), (1, "other")):  # apart: tests/kernels.py is not HF's
        subprocess.run([sys.executable, "-c", BASE.format(seed=seed, folder=str(
            tmp_path / folder))], check=True, cwd=tmp_path)
    cell = CELL.format(folder=str(tmp_path / "base"))

    def run(name: str, engines: int, steps: int, source: str = cell, **options) -> TrainingRun:
        config = RunConfig(name=name, global_batch=16, seed=3, steps=steps, checkpoint_every=4,
                           shard=True, replica_every=2)
        run = TrainingRun(idle_pool, config, source=source, engines=engines,
                          workspace=str(tmp_path), **options).start()
        assert run.wait(timeout=240) == "finished", run.logs()
        return run
    fixed = run("fixed", 2, 8)
    first = run("lora", 2, 6, schedule=[(3, 3)])  # grows at step 3: the adapter's rows move
    resumed = run("lora", 3, 8, resume=True)
    assert [r["world_size"] for r in resumed.history] == [2] * 3 + [3] * 5
    expected, got = fixed.state_dict(), resumed.state_dict()
    assert sorted({k.split(".")[-3] for k in got}) == ["lora_A", "lora_B"]
    for k, value in expected.items():
        assert torch.allclose(got[k], value, rtol=1e-9, atol=1e-12), k
    # the adapter exports alone, a tensor at a time (load_into: tests/test_sharded_run.py)
    exported = torch.load(resumed.export(str(tmp_path / "adapter.pt")), weights_only=True)
    assert exported.keys() == got.keys() and all(torch.equal(exported[k], got[k]) for k in got)
    trained_state = 3 * sum(v.numel() * v.element_size() for v in got.values())  # + AdamW's
    frozen = [e for e in first.events if e["kind"] == "frozen"]
    assert frozen and "21 frozen tensors" in frozen[0]["message"]
    copies = [e["bytes"] for e in first.events + resumed.events if e["kind"] == "replicas"]
    parts = [e["bytes"] for e in first.events + resumed.events if e["kind"] == "checkpoint"]
    assert copies and max(copies) <= 1.2 * trained_state / 2  # a rank's part: half or less
    assert parts and max(parts) <= 1.2 * trained_state
    with pytest.raises(Exception, match="other frozen weights"):
        run("lora", 2, 10, source=CELL.format(folder=str(tmp_path / "other")), resume=True)
