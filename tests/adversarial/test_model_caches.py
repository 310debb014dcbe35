"""Qwen3.forward over many layers' KV caches (CPU): a bad cache in any layer, bad slots,
lengths, ids or positions are found before layer 0 appends, so no layer's cache changes."""

from __future__ import annotations

import pytest

from _adversarial import CPU, ids, model_cache_cases, run_case

CASES = model_cache_cases(CPU)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_forward_changes_no_cache(case):
    run_case(case)
