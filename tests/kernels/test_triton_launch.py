"""The cached Triton launcher's key: at least as fine as what Triton specialises a kernel on."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.triton_launch import argument_key


def test_a_tensor_is_keyed_by_dtype_and_sixteen_byte_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert argument_key(base) == argument_key(base[8:])  # 16 bytes further: aligned alike
    assert argument_key(base) != argument_key(base[1:])  # 2 bytes further: not aligned
    assert argument_key(base) != argument_key(base.to(torch.float16))


@pytest.mark.parametrize("value, other", [(1, 2), (16, 17), (0, 3), (2**31 - 16, 2**31), (2**40, 2**63)])
def test_integers_that_triton_compiles_differently_get_different_keys(value, other):
    """Triton makes 1 a constant, marks multiples of 16 (0 too) and widens past int32 (and to
    uint64 from 2**63)."""
    assert argument_key(value) != argument_key(other)


def test_integers_that_triton_compiles_alike_share_a_key():
    assert argument_key(32) == argument_key(4096) == argument_key(-16)
    assert argument_key(3) == argument_key(17)


def test_floats_bools_and_none_are_keyed_by_type():
    assert argument_key(1e-5) == argument_key(1e-6)
    assert argument_key(True) == argument_key(False) != argument_key(1)
    assert argument_key(None) is None


def test_an_unknown_argument_is_refused():
    with pytest.raises(TypeError, match="no key for a str"):
        argument_key("x")


def _triton_specialisation(arg: object) -> object:
    """Triton's own specialisation of ``arg`` (its native binder), where this Triton exposes it."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    specialize = getattr(libtriton, "native_specialize_impl", None)
    if specialize is None:
        pytest.skip("this Triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    return specialize(BaseBackend, arg, False, True, True)


def test_one_key_never_spans_two_triton_specialisations():
    """Against Triton's binder: every pair of arguments with one key has one specialisation."""
    buffer = torch.zeros(256, dtype=torch.bfloat16)
    integers = [0, 1, 2, 15, 16, 17, 31, 32, 48, 4096, 4097, -1, -16, 2**31 - 1, 2**31 - 16, 2**31, 2**32 + 16,
                2**62 + 3, 2**63, 2**63 + 16]
    arguments = [*integers, *(buffer[i:] for i in range(0, 24)), buffer.float(), 1e-5, 0.5, True, False, None]
    by_key: dict[object, object] = {}
    for arg in arguments:
        specialisation = _triton_specialisation(arg)
        key = argument_key(arg)
        assert by_key.setdefault(key, specialisation) == specialisation, (arg, key)
