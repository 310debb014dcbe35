"""KVCache, attention_with_kv_cache and the static cache under bad input (CPU): each case
raises the documented error naming the argument, leaves every cache byte and length as it was,
and the next valid call gives the bits it gives on a cache that never saw the bad call."""

from __future__ import annotations

import pytest

from _adversarial import (
    CPU,
    ids,
    kv_attention_cases,
    kv_cache_constructor_cases,
    kv_cache_method_cases,
    run_case,
    static_cache_cases,
)

CASES = (
    kv_cache_constructor_cases(CPU)
    + kv_cache_method_cases(CPU)
    + kv_attention_cases(CPU)
    + static_cache_cases(CPU)
)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_call_changes_nothing(case):
    run_case(case)
