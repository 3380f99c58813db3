"""register_edgc reads each FSDPModule's parameter groups from torch's FSDP state, whose
layout changed between releases: a list (`_fsdp_param_groups`) in the torch this project
pins, one group or None (`_fsdp_param_group`) in older ones such as 2.11, the torch of the
lent GPU machines, where HSDP with edgc failed with an AttributeError before this."""

from types import SimpleNamespace

from edgc.fsdp import _param_groups


class _Module:
    def __init__(self, **state):
        self._state = SimpleNamespace(**state)

    def _get_fsdp_state(self):
        return self._state


def test_a_list_of_groups_is_read_as_it_is():
    a, b = object(), object()
    assert _param_groups(_Module(_fsdp_param_groups=[a, b])) == [a, b]
    assert _param_groups(_Module(_fsdp_param_groups=[])) == []


def test_an_older_torchs_single_group_is_a_list_of_one():
    group = object()
    assert _param_groups(_Module(_fsdp_param_group=group)) == [group]


def test_an_older_torchs_module_without_parameters_has_no_group():
    assert _param_groups(_Module(_fsdp_param_group=None)) == []


def test_the_list_wins_where_both_are_there():
    # (recent torch keeps `_fsdp_param_group` as a property over the list)
    a = object()
    assert _param_groups(_Module(_fsdp_param_groups=[a], _fsdp_param_group=a)) == [a]
