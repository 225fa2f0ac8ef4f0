"""The names the engine gives its weights (core/weight_versions.py), against a plain counter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from siesta.core.weight_versions import MAX_VERSION_CHARS, SOURCE_KEY, VersionError, WeightVersions, check_version


def test_automatic_names_count_up_and_never_repeat_after_a_reload():
    v = WeightVersions.at_start("0")
    assert [v.wrote(None) for _ in range(3)] == ["1", "2", "3"]
    v.reloaded_source()
    assert (v.name, v.key) == ("0", SOURCE_KEY)
    assert v.wrote(None) == "4"  # "1" named other weights earlier in this process


def test_named_bases_count_with_a_suffix_that_does_not_grow():
    v = WeightVersions.at_start("step")
    assert [v.wrote(None) for _ in range(3)] == ["step+1", "step+2", "step+3"]
    v.rename("rl-7")
    assert v.wrote(None) == "rl-7+1"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["auto", "rename", "reload"]), max_size=40))
def test_every_write_has_a_key_of_its_own_and_renames_keep_it(ops):
    v = WeightVersions.at_start("0")
    keys = {v.key}
    for i, op in enumerate(ops):
        before = v.key
        if op == "auto":
            v.wrote(None)
            assert v.key not in keys  # never used before, in this process or (uuid4) any other
            keys.add(v.key)
        elif op == "rename":
            v.rename(f"name-{i}")
            assert v.key == before
        else:
            v.reloaded_source()
            assert v.key == SOURCE_KEY


@pytest.mark.parametrize("bad", ["", "x" * (MAX_VERSION_CHARS + 1), "a\nb", True, None, 1.5, ["1"]])
def test_bad_version_strings_are_refused(bad):
    with pytest.raises(VersionError):
        check_version(bad)


def test_integers_and_bounded_text_are_versions():
    assert check_version(7) == "7" and check_version("x" * MAX_VERSION_CHARS) == "x" * MAX_VERSION_CHARS
