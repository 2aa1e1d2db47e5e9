"""from_spec: CLI strings to compressors, and errors that list the valid forms."""

import pytest

from plait.compress import BF16, FP16, QSGD, ErrorFeedback, PowerSGD, RandomK, Sign, TopK, from_spec


def test_every_form():
    assert from_spec("none") is None
    assert isinstance(from_spec("topk:0.01"), TopK) and from_spec("topk:0.01").ratio_kept == 0.01
    ef = from_spec("topk:0.01+ef")
    assert isinstance(ef, ErrorFeedback) and isinstance(ef.inner, TopK) and ef.describe() == "topk(ratio=0.01)+ef"
    assert isinstance(from_spec("randomk:0.01+ef").inner, RandomK)
    sign = from_spec("sign")
    assert isinstance(sign, Sign) and not sign.scaled
    sign_ef = from_spec("sign+ef")
    assert isinstance(sign_ef.inner, Sign) and sign_ef.inner.scaled  # EF-signSGD needs the scale
    assert from_spec("qsgd:2").bits == 2 and from_spec("qsgd").bits == 4
    assert isinstance(from_spec("qsgd:8+ef").inner, QSGD)
    assert isinstance(from_spec("powersgd:2"), PowerSGD) and from_spec("powersgd:4").rank == 4
    assert from_spec("powersgd").rank == 2
    assert isinstance(from_spec("fp16"), FP16) and isinstance(from_spec("bf16"), BF16)
    assert from_spec(" TopK:0.5 ").ratio_kept == 0.5


@pytest.mark.parametrize("text, why", [
    ("gzip", "unknown compressor 'gzip'"),
    ("topk", "topk needs a ratio, e.g. topk:0.01"),
    ("topk:", "nothing after 'topk:'"),
    ("topk:abc", "'abc' is not a number"),
    ("topk:0", r"TopK ratio must be in \(0, 1\], got 0"),
    ("randomk:2+ef", r"RandomK ratio must be in \(0, 1\], got 2"),
    ("qsgd:3", "QSGD bits must be 2, 4 or 8"),
    ("qsgd:x", "'x' is not an integer"),
    ("powersgd:0", "PowerSGD rank must be an integer >= 1, got 0"),
    ("powersgd:2+ef", "PowerSGD keeps its own error feedback; drop '\\+ef'"),
    ("sign:1", "unknown compressor 'sign' with argument '1'"),
    ("none+ef", "'none' takes no argument and no '\\+ef'"),
])
def test_errors_say_why_and_list_the_valid_forms(text, why):
    with pytest.raises(ValueError, match=why) as error:
        from_spec(text)
    assert "Valid forms: none; topk:RATIO[+ef]" in str(error.value) and "bf16" in str(error.value)


def test_non_string():
    with pytest.raises(ValueError, match="expected a string, got int"):
        from_spec(3)
