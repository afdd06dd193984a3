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


@pytest.mark.parametrize("env, expected", [
    ({}, 1),
    ({"SGL_SPARSE_X_COUNT": "3"}, 3),
    ({"SGL_SPARSE_X_COUNT": "4", "SGLANG_SPARSE_X_COUNT": " 2 "}, 2),
    ({"SGLANG_SPARSE_X_COUNT": "0"}, "SGLANG_SPARSE_X_COUNT: an integer in [1, 4] (got '0')"),
    ({"SGL_SPARSE_X_COUNT": "two"}, "SGL_SPARSE_X_COUNT: an integer in [1, 4] (got 'two')"),
])
def test_env_count(monkeypatch, env, expected):
    from kernels._utils import env_count

    for key in ("SGL_SPARSE_X_COUNT", "SGLANG_SPARSE_X_COUNT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if isinstance(expected, str):
        with pytest.raises(ValueError) as e:
            env_count("X_COUNT", 1, 1, 4)
        assert str(e.value) == expected
    else:
        assert env_count("X_COUNT", 1, 1, 4) == expected
