"""CommConfig from its keywords and (for the CLI) from PLAIT_COMM_*: one validation for both."""

import dataclasses

import pytest

from plait.cli.comm_config import config_from_environment
from plait.comm.config import CommConfig

# (variable, configure() keyword, bad text, words the error must contain: the valid range)
BAD = [
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "0", "finite number of seconds >= 0.001"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "-3", "finite number of seconds >= 0.001"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "inf", "finite number of seconds >= 0.001"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "nan", "finite number of seconds >= 0.001"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "1e300", "finite number of seconds >= 0.001"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "5 minutes", "finite number of seconds >= 0.001"),
    # accepted before: torch's millisecond deadline of 0 ms, "timed out after 0ms" from the C++ store (issue 31)
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "1e-300", "(torch counts whole milliseconds: less is 0 ms)"),
    ("PLAIT_COMM_TIMEOUT_S", "timeout_s", "0.0009", "finite number of seconds >= 0.001"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "abc", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "-5", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "1.5", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "1e30", "whole number of bytes from 0"),
    ("PLAIT_COMM_SEGMENT_BYTES", "segment_bytes", "inf", "whole number of bytes from 0"),
    # accepted before: the later algorithm silently won
    ("PLAIT_ALGORITHMS", "algorithms", "all_reduce=ring,all_reduce=tree", "all_reduce named more than once"),
    ("PLAIT_COMM_CHECK", "check_args", "maybe", "1/0, true/false, yes/no, on/off"),
    ("PLAIT_COMM_CHECK", "check_args", "2", "1/0, true/false, yes/no, on/off"),
]


@pytest.mark.parametrize("variable, keyword, text, valid", BAD, ids=[f"{v}={t}" for v, _, t, _ in BAD])
def test_bad_variable_is_refused_naming_it_its_value_and_the_valid_range(variable, keyword, text, valid,
                                                                          monkeypatch):
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError) as refused:
        config_from_environment()
    message = str(refused.value)
    assert message.startswith(f"{variable}={text!r}: ")
    assert valid in message


SAME_WORDS = [case for case in BAD if case[1] != "check_args"]  # CommConfig.check takes mode names: see below


@pytest.mark.parametrize("variable, keyword, text, valid", SAME_WORDS, ids=[f"{k}={t}" for _, k, t, _ in SAME_WORDS])
def test_commconfig_refuses_the_same_values_with_the_same_words(variable, keyword, text, valid, monkeypatch):
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError) as from_environment:
        config_from_environment()
    with pytest.raises(ValueError) as from_config:
        CommConfig(**{keyword: text})
    # the same check wrote both: only the name of the setting differs
    assert str(from_config.value) == "CommConfig: " + str(from_environment.value).replace(variable, keyword, 1)


def test_the_environment_never_changes_a_commconfig(monkeypatch):
    """Only the CLI reads PLAIT_*: a CommConfig built in code is what the code says."""
    monkeypatch.setenv("PLAIT_COMM_TIMEOUT_S", "7")
    monkeypatch.setenv("PLAIT_COMM_CHECK", "off")
    monkeypatch.setenv("PLAIT_ALGORITHMS", "all_reduce=ring")
    assert CommConfig() == CommConfig(timeout_s=300.0, check="inband", algorithms={})
    from_env = config_from_environment()
    assert (from_env.timeout_s, from_env.check, dict(from_env.algorithms)) == (7.0, "off", {"all_reduce": "ring"})


def test_commconfig_is_frozen_and_names_every_bad_value():
    config = CommConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout_s = 1.0
    with pytest.raises(TypeError):
        config.algorithms["all_reduce"] = "ring"  # a read-only mapping
    with pytest.raises(ValueError) as refused:
        CommConfig(timeout_s=float("inf"), check="sometimes", pipeline_segment_bytes=0)
    message = str(refused.value)
    for words in ("timeout_s=inf", "check='sometimes'", "pipeline_segment_bytes=0"):
        assert words in message
    assert CommConfig().replace(timeout_s="7").timeout_s == 7.0


def test_commconfig_refuses_a_fractional_segment_size():
    with pytest.raises(ValueError, match=r"segment_bytes=1.5: "):
        CommConfig(segment_bytes=1.5)


def test_check_spellings(monkeypatch):
    for text, expected in [("1", "inband"), ("0", "off"), ("true", "inband"), ("False", "off"), ("YES", "inband"),
                           ("no", "off"), ("On", "inband"), ("off", "off"), (" off ", "off"), ("", "inband"),
                           ("deep", "deep"), ("INBAND", "inband")]:
        monkeypatch.setenv("PLAIT_COMM_CHECK", text)
        assert config_from_environment().check == expected, text


def test_numbers_in_range_are_taken(monkeypatch):
    monkeypatch.setenv("PLAIT_COMM_TIMEOUT_S", " 2.5 ")
    monkeypatch.setenv("PLAIT_COMM_SEGMENT_BYTES", "4e6")  # a float that is a whole number is fine
    config = config_from_environment()
    assert config.timeout_s == 2.5
    assert config.segment_bytes == 4_000_000 and type(config.segment_bytes) is int
    monkeypatch.setenv("PLAIT_COMM_SEGMENT_BYTES", "0")  # 0: never split
    assert config_from_environment().segment_bytes == 0
    # unset or empty: the defaults
    monkeypatch.setenv("PLAIT_COMM_TIMEOUT_S", "")
    monkeypatch.delenv("PLAIT_COMM_SEGMENT_BYTES")
    assert (config_from_environment().timeout_s, config_from_environment().segment_bytes) == (300.0, 4 << 20)
    # ... and the same from CommConfig's keywords
    config = CommConfig(timeout_s="7", segment_bytes=2.0**20)
    assert (config.timeout_s, config.segment_bytes) == (7.0, 1 << 20)


def test_bad_algorithm_override_names_the_variable_and_value(monkeypatch):
    monkeypatch.setenv("PLAIT_ALGORITHMS", "all_reduce=nonsense")
    with pytest.raises(ValueError) as refused:
        config_from_environment()
    assert str(refused.value).startswith("PLAIT_ALGORITHMS='all_reduce=nonsense': ")
    assert "ring" in str(refused.value)  # the valid algorithms are listed
