"""The job's record (control/record.py) goes to the standby whole: every
field, filled with a value other than its default, comes back from its JSON
equal; a codec that leaves one field out is caught (the negative control),
so a field added to the record is either carried or fails here."""

import dataclasses
import enum
import typing

import pydantic
import pytest

from deadpool_ext.control.record import JobRecord, Round, _codec
from deadpool_ext.protocol import CoordinatorSettings

RECORD_FIELDS = [f.name for f in dataclasses.fields(JobRecord)]


def sample(kind):
    """A value of ``kind`` (a type hint) unlike any default: every field of
    a dataclass filled, every container holding one element."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return sample(next(a for a in args if a is not type(None)))
    if origin in (list, set, dict, tuple) or kind in (list, dict):
        return sample_container(origin or kind, args)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return list(kind)[-1]
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        values = {f.name: sample(hints[f.name]) for f in dataclasses.fields(kind) if f.init}
        return kind(**values)
    return {int: 7, float: 2.5, str: "x", bool: True, typing.Any: 7}[kind]


def sample_container(origin, args):
    item = sample(args[0]) if args else 7
    if origin is list:
        return [item]
    if origin is set:
        return {item}
    if origin is dict:
        return {item: sample(args[1]) if args else 7}
    if len(args) == 2 and args[1] is Ellipsis:
        return (item,)
    return tuple(sample(a) for a in args)


def full_record() -> JobRecord:
    record, defaults = sample(JobRecord), default_record()
    for name in RECORD_FIELDS:
        assert getattr(record, name) != getattr(defaults, name), f"{name}: sampled its default"
    return record


def test_every_field_of_the_record_comes_back_from_its_json():
    record = full_record()
    assert JobRecord.from_json(record.to_json()) == record


@pytest.mark.parametrize("left_out", RECORD_FIELDS)
def test_a_codec_that_leaves_a_field_out_is_caught(left_out):
    """The negative control: the check above sees every field."""
    record = full_record()
    lossy = _codec().dump_json(record, exclude={left_out}).decode()
    if left_out in ("settings", "membership"):  # no default: refused outright
        with pytest.raises(pydantic.ValidationError):
            JobRecord.from_json(lossy)
        return
    back = JobRecord.from_json(lossy)
    assert back != record
    assert back == dataclasses.replace(record, **{left_out: getattr(default_record(), left_out)})


def default_record() -> JobRecord:
    """A record as a job of 2 nodes of 2 ranks and a spare node starts."""
    return JobRecord.launched(CoordinatorSettings(), 2, 1, 2)


def test_a_generations_collection_is_no_part_of_the_record():
    """A takeover opens a new generation: what one collects (reports,
    joining, resumed) is never replicated."""
    assert not {f.name for f in dataclasses.fields(Round)} & set(RECORD_FIELDS)
    hints = typing.get_type_hints(JobRecord)
    assert Round not in hints.values()
