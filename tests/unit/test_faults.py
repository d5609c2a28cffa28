"""The test-only fault spec (ouro_cli/testing/faults.py): signals, the device error and the
memory hog parse; anything else is refused."""

from __future__ import annotations

import signal

import pytest

from ouro_cli.testing import faults


def test_fault_specs_parse_into_their_actions():
    assert faults._parse("generate@2=CUDA") == ("generate", 2, ["CUDA"])
    assert faults._parse("generate=hog100+term") == ("generate", 1, ["HOG100", signal.SIGTERM])
    assert faults._parse("generate@1=HOG-12.5") == ("generate", 1, ["HOG-12.5"])
    assert faults._parse("") is None


@pytest.mark.parametrize("spec", ["nowhere=TERM", "generate=", "generate=HOGx", "generate=NOSUCH"])
def test_bad_fault_specs_are_refused(spec):
    with pytest.raises((ValueError, KeyError)):
        faults._parse(spec)


def test_a_hog_off_cuda_takes_nothing_and_the_rollout_end_lets_go():
    faults.hog("cpu", 1.0)
    faults._held.append(object())
    faults.point("rollout")
    assert faults._held == []
