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
