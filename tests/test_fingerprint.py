"""A dataset's fingerprint hashes its items by value, also when they are mappings other than
dict (a tokenizer's BatchEncoding is a UserDict) or dataclass instances."""
import collections
import dataclasses

import pytest
import torch

from elastic_jupyter.engine.data.fingerprint import dataset_fingerprint


@dataclasses.dataclass
class Example:
    input_ids: torch.Tensor
    label: int


def _user_dicts(scale: float) -> list:
    return [collections.UserDict(input_ids=torch.arange(4) * scale, label=i % 2)
            for i in range(10)]


def _dataclasses(scale: float) -> list:
    return [Example(torch.arange(4) * scale, i % 2) for i in range(10)]


@pytest.mark.parametrize("items", [_user_dicts, _dataclasses], ids=["UserDict", "dataclass"])
def test_items_are_hashed_by_value(items):
    same, again = dataset_fingerprint(items(1.0)), dataset_fingerprint(items(1.0))
    other = dataset_fingerprint(items(2.0))  # the same length and types, other tensor values
    assert same == again
    assert other["samples"] == same["samples"] == 10
    assert other["hash"] != same["hash"]


def test_a_dataclass_field_name_counts():
    @dataclasses.dataclass
    class Renamed:
        tokens: torch.Tensor
        label: int

    renamed = [Renamed(torch.arange(4) * 1.0, i % 2) for i in range(10)]
    assert dataset_fingerprint(renamed)["hash"] != dataset_fingerprint(_dataclasses(1.0))["hash"]
