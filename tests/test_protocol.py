"""The contract between the kernel and the engines (engine.protocol) matches both sides."""
import dataclasses
import pickle

from elastic_jupyter.config import RunConfig
from elastic_jupyter.engine.protocol import (EngineConfig, GenerationSpec, decode_end_at,
                                             encode_end_at)


def test_the_engine_reads_every_option_the_kernel_sends_with_the_same_defaults():
    kernel = {f.name: f for f in dataclasses.fields(RunConfig)}
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert list(engine) == list(kernel)  # in order: a positional call means the same
    for name, field in kernel.items():
        if field.default is not dataclasses.MISSING:
            assert engine[name].default == field.default, name


def test_a_run_config_crosses_as_a_dict_and_reads_back_the_same():
    config = RunConfig("r", global_batch=32, micro_batch=4, sync_batchnorm=True, total_steps=7)
    sent = config.as_dict()
    assert EngineConfig.from_dict(sent).as_dict() == sent
    assert EngineConfig.from_dict(dict(sent, dataset={"hash": "x"})).global_batch == 32


def test_a_generation_spec_travels_pickled():
    spec = GenerationSpec(rank=1, world_size=3, generation=4, backend="gloo", timeout=30.0,
                          receive_state=True, broadcast=True, end_at=12)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_the_owners_request_to_leave_reads_back():
    for end_at in (None, 0, 17):
        assert decode_end_at(encode_end_at(end_at).encode()) == end_at
