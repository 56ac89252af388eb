"""The contract between the kernel and the engines (engine.protocol) matches both sides."""
import pickle

from elastic_jupyter.engine.protocol import GenerationSpec, decode_end_at, encode_end_at


def test_a_generation_spec_travels_pickled():
    spec = GenerationSpec(rank=1, world_size=3, generation=4, backend="gloo", timeout=30.0,
                          receive_state=True, broadcast=True, end_at=12)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_the_owners_request_to_leave_reads_back():
    for end_at in (None, 0, 17):
        assert decode_end_at(encode_end_at(end_at).encode()) == end_at
