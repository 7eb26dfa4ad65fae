"""``environment``: variables set and unset for a block, each back as it was after it, an exception included."""

from __future__ import annotations

import os

import pytest

from rlt2t.common.environ import environment


def test_set_and_unset_inside_the_block_restored_after_it_even_on_an_error(monkeypatch):
    monkeypatch.setenv("RLT2T_T_KEPT", "old")
    monkeypatch.setenv("RLT2T_T_GONE", "there")
    monkeypatch.delenv("RLT2T_T_NEW", raising=False)
    with pytest.raises(RuntimeError), environment({"RLT2T_T_KEPT": "new", "RLT2T_T_GONE": None, "RLT2T_T_NEW": "1"}):
        assert (os.environ["RLT2T_T_KEPT"], os.environ.get("RLT2T_T_GONE"), os.environ["RLT2T_T_NEW"]) == (
            "new", None, "1")
        raise RuntimeError
    assert (os.environ["RLT2T_T_KEPT"], os.environ["RLT2T_T_GONE"]) == ("old", "there")
    assert "RLT2T_T_NEW" not in os.environ
