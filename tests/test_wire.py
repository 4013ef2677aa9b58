"""The lossless wire format: any nested payload of tensors (every dtype), numbers, strings,
booleans and None round-trips exactly, through ``fedlt.wire`` and through Flower's records; a
value it cannot carry is a one-line error naming the field, never a silent drop."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fedlt import wire
from fedlt.algorithms.protocol import ClientResult
from fedlt.errors import FedltError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    raw = torch.randint(0, 256, (max(1, math.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[: math.prod(shape)].reshape(shape)  # any bit pattern: NaNs, infs, -0.0, subnormals
    if draw(st.booleans()) and t.ndim == 2:
        t = t.t()  # non-contiguous
    return t


leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(allow_nan=True),
                   st.text(max_size=8), tensors())
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=2)))
payloads = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                        st.dictionaries(keys, inner, max_size=4)), max_leaves=12)


def same(a, b) -> bool:
    """Equal in type and value; tensors bit for bit (NaN payloads and signed zeros included)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8) if a.numel() else a,
                                b.contiguous().view(-1).view(torch.uint8) if b.numel() else b))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):  # bit for bit: a NaN's sign and payload, a zero's sign
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(payloads)
@example(-math.nan)  # found by the hostile pass: a negative NaN came back positive
@example(struct.unpack(">d", bytes.fromhex("7ff0000000000bad"))[0])  # a NaN with a payload
@example([math.inf, -math.inf, -0.0])
def test_any_nested_payload_round_trips_exactly(value):
    assert same(wire.decode(*wire.encode(value)), value)


@settings(max_examples=30, deadline=None)
@given(payloads)
def test_flower_records_carry_it_exactly(value):
    pytest.importorskip("flwr")
    from fedlt.flower import codec

    assert same(codec.value(codec.content(value)), value)


def test_a_result_with_every_kind_of_field_crosses_whole():
    """SCAFFOLD's extras, nested client state, typed fields: nothing named, nothing dropped."""
    result = ClientResult(3, {"w": torch.randn(2, 2)}, 17, steps=5, train_loss=0.25,
                          state={"loss": {"sgb.pos": torch.zeros(3)}, "c": {"w": torch.ones(2, 2)}},
                          extras={"delta_c": {"w": torch.full((2, 2), -1.0)}, "note": None})
    back = wire.decode(*wire.encode(result))
    assert isinstance(back, ClientResult)
    for field in ("cid", "num_samples", "steps", "train_loss", "weights", "state", "extras"):
        assert same(getattr(back, field), getattr(result, field)), field


@pytest.mark.parametrize("bad, where", [({"a": {"b": {1, 2}}}, "value['a']['b']"), ([object()], "value[0]"),
                                        ({"dt": torch.float32}, "value['dt']")])
def test_a_value_it_cannot_carry_is_one_line_naming_the_field(bad, where):
    with pytest.raises(FedltError) as info:
        wire.encode(bad)
    message = str(info.value)
    assert where in message and "\n" not in message


def test_only_registered_dataclasses_are_created_on_decode():
    text, arrays = wire.encode(ClientResult(0, {}, 1))
    forged = text.replace("fedlt.algorithms.protocol:ClientResult", "os:system")
    with pytest.raises(FedltError, match="not a registered wire type"):
        wire.decode(forged, arrays)


def test_nesting_beyond_the_limit_is_refused_not_a_recursion_error():
    value: list = []
    for _ in range(wire.MAX_DEPTH + 5):
        value = [value]
    with pytest.raises(FedltError, match="nested deeper"):
        wire.encode(value)
