"""The scoped switch of programmatic dependent launch (the launches themselves are tested with the linear ops)."""
import os

import pytest

from tqops.pdl import pdl_switched_off


@pytest.mark.parametrize("before", [None, "1", "0"], ids=["unset", "on", "off"])
def test_switched_off_for_its_block_only(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("TQOPS_PDL", raising=False)
    else:
        monkeypatch.setenv("TQOPS_PDL", before)
    with pdl_switched_off():
        assert os.environ["TQOPS_PDL"] == "0"
    assert os.environ.get("TQOPS_PDL") == before
    with pytest.raises(RuntimeError), pdl_switched_off():
        raise RuntimeError("a failed profile")
    assert os.environ.get("TQOPS_PDL") == before
