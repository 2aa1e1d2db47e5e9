"""CommConfig's start values from PLAIT_COMM_* and configure(): one validation for both."""

import pytest

from plait.comm.engine import CONFIG, CommConfig, configure

# (variable, configure() keyword, bad text, words the error must contain: the valid range)
BAD = [
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "0", "finite number of seconds > 0"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "-3", "finite number of seconds > 0"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "inf", "finite number of seconds > 0"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "nan", "finite number of seconds > 0"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "1e300", "finite number of seconds > 0"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "5 minutes", "finite number of seconds > 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "abc", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "-5", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "1.5", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "1e30", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "inf", "whole number of bytes from 0"),
    ("PLAIT_COMM_CHECK", "check_args", "maybe", "1/0, true/false, yes/no, on/off"),
    ("PLAIT_COMM_CHECK", "check_args", "2", "1/0, true/false, yes/no, on/off"),
]


@pytest.fixture
def restore_config():
    previous = configure()
    yield
    configure(**previous)


@pytest.mark.parametrize("variable, keyword, text, valid", BAD, ids=[f"{v}={t}" for v, _, t, _ in BAD])
def test_bad_variable_is_refused_naming_it_its_value_and_the_valid_range(variable, keyword, text, valid,
                                                                          monkeypatch):
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError) as refused:
        CommConfig()
    message = str(refused.value)
    assert message.startswith(f"{variable}={text!r}: ")
    assert valid in message


@pytest.mark.parametrize("variable, keyword, text, valid", BAD, ids=[f"{k}={t}" for _, k, t, _ in BAD])
def test_configure_refuses_the_same_values_with_the_same_words(variable, keyword, text, valid, monkeypatch,
                                                               restore_config):
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError) as from_environment:
        CommConfig()
    with pytest.raises(ValueError) as from_configure:
        configure(**{keyword: text})
    # the same check wrote both: only the name of the setting differs
    assert str(from_configure.value) == str(from_environment.value).replace(variable, keyword, 1)


def test_configure_refuses_an_infinite_timeout(restore_config):
    """Every blocking wait must have a timeout: inf is not one."""
    with pytest.raises(ValueError, match=r"timeout_s=inf: .*finite"):
        configure(timeout_s=float("inf"))
    assert CONFIG.timeout_s != float("inf")


def test_configure_refuses_a_fractional_segment_size(restore_config):
    with pytest.raises(ValueError, match=r"segment_bytes=1.5: "):
        configure(segment_bytes=1.5)


def test_check_spellings(monkeypatch, restore_config):
    for text, expected in [("1", True), ("0", False), ("true", True), ("False", False), ("YES", True),
                           ("no", False), ("On", True), ("off", False), (" off ", False), ("", True)]:
        monkeypatch.setenv("PLAIT_COMM_CHECK", text)
        assert CommConfig().check_args is expected, text
        configure(check_args=not expected)
        configure(check_args=text or "1")
        assert CONFIG.check_args is expected, text


def test_numbers_in_range_are_taken(monkeypatch):
    monkeypatch.setenv("PLAIT_COMM_TIMEOUT_S", " 2.5 ")
    monkeypatch.setenv("PLAIT_COMM_SEGMENT_BYTES", "4e6")  # a float that is a whole number is fine
    config = CommConfig()
    assert config.timeout_s == 2.5
    assert config.segment_bytes == 4_000_000 and type(config.segment_bytes) is int
    monkeypatch.setenv("PLAIT_COMM_SEGMENT_BYTES", "0")  # 0: never split
    assert CommConfig().segment_bytes == 0
    # unset or empty: the defaults
    monkeypatch.setenv("PLAIT_COMM_TIMEOUT_S", "")
    monkeypatch.delenv("PLAIT_COMM_SEGMENT_BYTES")
    assert (CommConfig().timeout_s, CommConfig().segment_bytes) == (300.0, 4 << 20)
    # ... and the same from configure()
    previous = configure(timeout_s="7", segment_bytes=2.0**20)
    try:
        assert (CONFIG.timeout_s, CONFIG.segment_bytes) == (7.0, 1 << 20)
    finally:
        configure(**previous)


def test_bad_algorithm_override_names_the_variable_and_value(monkeypatch):
    monkeypatch.setenv("PLAIT_ALGORITHMS", "all_reduce=nonsense")
    with pytest.raises(ValueError) as refused:
        CommConfig()
    assert str(refused.value).startswith("PLAIT_ALGORITHMS='all_reduce=nonsense': ")
    assert "ring" in str(refused.value)  # the valid algorithms are listed
