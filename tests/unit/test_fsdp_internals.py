"""edgc.fsdp_internals: the one module that reads torch's private FSDP2 state. Its layout
changed between releases: a list of parameter groups (`_fsdp_param_groups`) in the torch
this project pins, one group or None (`_fsdp_param_group`) in older ones such as 2.11, the
torch of the lent GPU machines, where HSDP with edgc once failed with an AttributeError.
On a layout it does not know, it says so, naming the torch releases it was checked on."""

from types import SimpleNamespace

import pytest
import torch

from edgc.fsdp_internals import CHECKED_TORCH, module_params


def _param(name, rows=4, cols=3, dim=0):
    return SimpleNamespace(_param_fqn=name, fsdp_placement=SimpleNamespace(dim=dim),
                           padded_sharded_param_size=torch.Size([rows, cols]),
                           sharded_param=torch.zeros(rows, cols, dtype=torch.bfloat16))


def _group(*params):
    mesh = SimpleNamespace(get_group=lambda: "the shard group")
    return SimpleNamespace(fsdp_params=list(params), mesh_info=SimpleNamespace(mesh=mesh), all_reduce_grads=True)


class _Module:
    def __init__(self, reduce_dtype=None, **state):
        self._state = SimpleNamespace(_mp_policy=SimpleNamespace(reduce_dtype=reduce_dtype), **state)

    def _get_fsdp_state(self):
        return self._state


def test_a_list_of_groups_is_read_as_it_is():
    a, b = _group(_param("a.weight")), _group(_param("b.weight", 2, 5), _param("b.bias", 2, 1))
    got = module_params(_Module(_fsdp_param_groups=[a, b]))
    assert [[(p.name, p.dim, p.padded_shape) for p in g.params] for g in got] == [
        [("a.weight", 0, (4, 3))], [("b.weight", 0, (2, 5)), ("b.bias", 0, (2, 1))]]
    assert all(g.shard_group == "the shard group" and not g.native_hsdp for g in got)
    assert got[0].reduce_dtype == torch.bfloat16  # (no reduce dtype set: the parameters')
    assert got[0].all_reduce_grads is True
    a.all_reduce_grads = False  # (read at each call, as set_requires_all_reduce changes it)
    assert got[0].all_reduce_grads is False
    assert module_params(_Module(_fsdp_param_groups=[])) == []


def test_an_older_torchs_single_group_is_a_list_of_one():
    group = _group(_param("w"))
    got = module_params(_Module(reduce_dtype=torch.float32, _fsdp_param_group=group))
    assert len(got) == 1 and got[0].group is group and got[0].reduce_dtype == torch.float32


def test_an_older_torchs_module_without_parameters_has_no_group():
    assert module_params(_Module(_fsdp_param_group=None)) == []


def test_the_list_wins_where_both_are_there():
    # (recent torch keeps `_fsdp_param_group` as a property over the list)
    a = _group(_param("w"))
    assert [g.group for g in module_params(_Module(_fsdp_param_groups=[a], _fsdp_param_group=a))] == [a]


def test_a_layout_it_does_not_know_is_named_with_the_releases_it_was_checked_on():
    broken = SimpleNamespace(fsdp_params=[SimpleNamespace(_param_fqn="w")], mesh_info=None)
    with pytest.raises(RuntimeError, match="FSDPParam.fsdp_placement") as info:
        module_params(_Module(_fsdp_param_groups=[broken]))
    assert all(v in str(info.value) for v in CHECKED_TORCH) and torch.__version__ in str(info.value)
    with pytest.raises(RuntimeError, match="_fsdp_param_group"):
        module_params(_Module())
