"""config.Switch: the environment's setting, read once, unless forced."""

import pytest

from roofline.config import Switch


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), (" On ", True), ("0", False), ("false", False),
                                      ("NO", False), ("off", False), ("", False)])
def test_environment_values(monkeypatch, value, on):
    monkeypatch.setenv("ROOFLINE_TEST_SWITCH", value)
    assert Switch("ROOFLINE_TEST_SWITCH").on() is on


def test_default_read_once_and_forcing(monkeypatch):
    monkeypatch.delenv("ROOFLINE_TEST_SWITCH", raising=False)
    s = Switch("ROOFLINE_TEST_SWITCH")
    assert s.on()  # default "1"
    monkeypatch.setenv("ROOFLINE_TEST_SWITCH", "0")
    assert s.on()  # read once
    with s.forced(False):
        assert not s.on()
        with s.forced(True):
            assert s.on()
        assert not s.on()
    assert s.on() and s.override is None
    s.set(False)
    assert not s.on()
    s.set(None)
    assert s.on()
