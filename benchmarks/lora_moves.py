"""What a LoRA fine-tune moves: frozen weights left where the cell built them, against moved.

A Llama-style causal LM (``transformers``, written with ``save_pretrained`` to a temporary
folder and loaded with ``from_pretrained``: nothing is downloaded) under a ``peft`` LoRA adapter
on q_proj and v_proj trains 8 steps on a pool of 2 (max 3), grows to 3 after step 3, and
checkpoints every 4 steps. Side by side in one run, alternating (``--rounds`` times each):

- **frozen stay** (the default): a grow sends, and a checkpoint writes, the adapter and its
  AdamW state (engine.state.frozen);
- **frozen moved** (``--move-frozen``, what every run did before): the base model too.

Per mode: the bytes the grow sent (structure and tensors, at the transport: the ``state_sent``
event) and its time, the resize's latency (request to the first step at 3), the checkpoint file's
bytes and its write time (queued to written), and the setup's hashing time. Ratios are what to
compare: this machine is noisy. A first run, not counted, lets the kernel's zygote load
transformers and peft, as it does for a notebook's second run.

Run: ``python benchmarks/lora_moves.py [--rounds N] [--hidden H] [--layers L]``; figures in
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile

import torch

from elastic_jupyter import EnginePool, RunConfig, TrainingRun

CELL = '''
import os
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                         target_modules=["q_proj", "v_proj"]))
text = open(os.__file__, "rb").read()  # Python's own source, as bytes: a vocabulary of 256
dataset = torch.tensor(list(text[:33 * 512]), dtype=torch.long).view(512, 33)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

def loss_fn(model, batch):
    return model(input_ids=batch, labels=batch).loss
'''


def write_base(folder: str, hidden: int, layers: int) -> int:
    """Save the base model; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, max_position_embeddings=64))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def one_run(pool: EnginePool, cell: str, workspace: str, name: str, move: bool) -> dict:
    pool.resize(2)
    run = TrainingRun(pool, RunConfig(name=name, steps=8, global_batch=12, checkpoint_every=4,
                                      move_frozen=move),
                      source=cell, workspace=workspace, schedule=[(3, 3)]).start()
    assert run.wait(timeout=600) == "finished", run.logs()
    events = run.events
    (grow,) = [e for e in events if e["kind"] == "state_sent" and e["step"] == 3]
    (resized,) = [e for e in events if e["kind"] == "resized" and e["to"] == 3]
    checkpoint = next(e for e in events if e["kind"] == "checkpoint" and e["step"] == 4)
    frozen = [e["message"] for e in events if e["kind"] == "frozen"]
    hashing = float(re.search(r"hashing took at most ([\d.]+) s", frozen[0]).group(1)) \
        if frozen else 0.0
    return {"grow MB": grow["bytes"] / 1e6, "grow send s": grow["seconds"],
            "resize latency s": resized["latency_s"], "checkpoint MB": checkpoint["bytes"] / 1e6,
            "checkpoint write s": checkpoint["seconds"], "setup hashing s": hashing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    workspace = tempfile.mkdtemp(prefix="lora-moves-")
    base = f"{workspace}/base"
    parameters = write_base(base, args.hidden, args.layers)
    cell = CELL.format(folder=base)
    figures: dict[bool, list[dict]] = {False: [], True: []}
    pool = EnginePool(n=2, min_size=1, max_size=3, gpus="none").start()
    try:
        # not counted: the first grow's engine imports transformers and peft; later ones fork
        # from the kernel's zygote, which has them loaded by then (pool.zygote)
        one_run(pool, cell, workspace, "lora-warm-up", False)
        for i in range(args.rounds):
            for move in (False, True):
                figures[move].append(one_run(pool, cell, workspace, f"lora-{i}-{move}", move))
    finally:
        pool.stop()
    print(f"base model: {parameters / 1e6:.1f} M parameters ({parameters * 4 / 1e6:.0f} MB "
          f"fp32); LoRA r=16 on q_proj, v_proj; {args.rounds} rounds, medians")
    print(f"{'':24s} {'frozen stay':>12s} {'frozen moved':>13s} {'ratio':>7s}")
    for key in figures[False][0]:
        stay = statistics.median(f[key] for f in figures[False])
        moved = statistics.median(f[key] for f in figures[True])
        ratio = f"{stay / moved:.3f}" if moved else "-"
        print(f"{key:24s} {stay:12.3f} {moved:13.3f} {ratio:>7s}")


if __name__ == "__main__":
    main()
