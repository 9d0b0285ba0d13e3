"""engine/settings.py: every PDSERVE_* switch declared once, read one way."""
from __future__ import annotations

import pytest

from engine import settings


def test_unset_or_empty_is_the_default():
    assert settings.DEBUG_STEP_DELAY.get({}) == 0.0
    assert settings.DEBUG_STEP_DELAY.get({"PDSERVE_DEBUG_STEP_DELAY": "  "}) == 0.0
    assert settings.ENFORCE_EAGER.get({}) is None


def test_values_parse_by_type():
    assert settings.DEBUG_STEP_DELAY.get({"PDSERVE_DEBUG_STEP_DELAY": "0.25"}) == 0.25
    for raw, want in (("1", True), ("true", True), ("0", False), ("false", False), ("OFF", False), ("no", False)):
        assert settings.DEBUG_INVARIANTS.get({"PDSERVE_DEBUG_INVARIANTS": raw}) is want, raw


def test_a_bad_value_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="PDSERVE_DEBUG_STEP_DELAY"):
        settings.DEBUG_STEP_DELAY.get({"PDSERVE_DEBUG_STEP_DELAY": "soon"})


def test_flags_map_to_their_variables():
    assert settings.flag_env_name("--max-num-seqs") == "PDSERVE_MAX_NUM_SEQS"
    assert settings.flag_env("--max-num-seqs", {"PDSERVE_MAX_NUM_SEQS": "8"}) == "8"


def test_every_switch_is_declared_once_with_a_purpose():
    names = [s.name for s in settings.SWITCHES]
    assert len(names) == len(set(names))
    assert all(s.name.startswith(settings.FLAG_ENV_PREFIX) and s.purpose for s in settings.SWITCHES)
