"""Operator switches: both spellings of a variable are honoured, SGLANG_ wins.

SGLang copies each SGL_* variable of its processes to SGLANG_* and warns that the
old name is deprecated; a switch must keep working whichever name the operator set.
"""

import pytest

from kernels._utils import env_switch


@pytest.mark.parametrize("env, default, expected", [
    ({}, True, True),
    ({}, False, False),
    ({"SGL_SPARSE_X_TEST": "0"}, True, False),
    ({"SGLANG_SPARSE_X_TEST": "off"}, True, False),
    ({"SGLANG_SPARSE_X_TEST": "1"}, False, True),
    ({"SGL_SPARSE_X_TEST": "yes"}, False, True),
    # SGLang's copy of the old name, then the operator's new one: the new one wins
    ({"SGL_SPARSE_X_TEST": "1", "SGLANG_SPARSE_X_TEST": "False"}, True, False),
    ({"SGL_SPARSE_X_TEST": "0", "SGLANG_SPARSE_X_TEST": " ON "}, False, True),
])
def test_env_switch(monkeypatch, env, default, expected):
    for key in ("SGL_SPARSE_X_TEST", "SGLANG_SPARSE_X_TEST"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert env_switch("X_TEST", default) is expected
