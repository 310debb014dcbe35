"""Bit fingerprints on CUDA: every code path the library can take on another card gives this
card's default bits (or the difference is one ``KNOWN_PATH_DIFFERENCES`` lists), and this
card's fingerprint equals every committed one of the same fingerprint and batchinv versions
(up to ``architecture_exceptions`` between architectures).  See docs/fingerprints.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import batchinv
from batchinv import fingerprint as fp

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
COMMITTED = Path(__file__).resolve().parents[2] / "reports" / "fingerprints"


def _variant_names() -> list[str]:
    try:
        return [v.name for v in fp.path_variants()]
    except Exception:  # no native module: nothing to compare (the cuda marker skips anyway)
        return []


@pytest.fixture(scope="module")
def baseline():
    """Each full case on this card's default paths; inputs drawn once for the module."""
    with fp.reused_inputs():
        try:
            yield {case.name: fp.run_case(case, DEVICE) for case in fp.FULL_CASES}
        finally:
            fp._MODELS.clear()


def test_default_paths_run_every_case(baseline):
    from batchinv.runtime import uses_hopper

    errors = {name: e["error"] for name, e in baseline.items() if "error" in e}
    if uses_hopper(torch.device(DEVICE)):
        assert errors == {}
    else:  # only the sm_90a-only kernels may be missing
        assert set(errors) <= {"token_logprobs", "qwen3_token_logprobs"}, errors
    for name, entry in baseline.items():
        if "error" not in entry and entry["op"] in ("linear", "log_softmax", "attention_varlen"):
            assert entry["path"], name


@pytest.mark.parametrize("name", _variant_names())
def test_path_variant_gives_the_default_bits(name, baseline):
    variant = next(v for v in fp.path_variants() if v.name == name)
    with fp.reused_inputs():
        row = fp.run_variant(variant, baseline, DEVICE, fp.FULL_CASES)
    for case, verdict in row.items():
        known = fp.KNOWN_PATH_DIFFERENCES.get((case, name))
        print(f"{name} / {case}: {verdict}" + (f" (known: {known})" if known else ""))
    assert fp.unexpected_differences({name: row}) == []
    ran = [case for case, verdict in row.items() if not verdict.startswith("not applicable")]
    assert ran, f"{name} ran no case: {row}"


def _committed() -> tuple[list[dict], list[str]]:
    """The committed fingerprints of this tree's versions and the full set, and the other
    files found (with why they are not compared)."""
    usable, others = [], []
    for path in sorted(COMMITTED.glob("*.json")):
        data = fp.load(path)
        if (
            data["fingerprint_version"] == fp.FINGERPRINT_VERSION
            and data["batchinv_version"] == batchinv.__version__
            and data["case_set"] == "full"
        ):
            usable.append(data)
        else:
            others.append(
                f"{path.name} (fingerprint v{data['fingerprint_version']}, batchinv "
                f"{data['batchinv_version']}, {data['case_set']} set)"
            )
    return usable, others


def test_this_card_matches_the_committed_fingerprints():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: a fresh fingerprint needs one")
    usable, others = _committed()
    if not usable:
        found = f"; found only {', '.join(others)}" if others else ""
        pytest.skip(
            f"no committed fingerprint in reports/fingerprints/ for fingerprint version "
            f"{fp.FINGERPRINT_VERSION}, batchinv {batchinv.__version__} and the full set{found}"
        )
    fresh = fp.fingerprint(DEVICE, "full")
    failures = []
    for committed in usable:
        assert fp.comparable(fresh, committed) is None
        exceptions = fp.architecture_exceptions(fresh, committed)
        card = committed["card"]["name"]
        for difference in fp.compare(fresh, committed):
            if difference.case in exceptions:
                print(f"{card}: {difference} (known: {exceptions[difference.case]})")
            else:
                failures.append(f"{card}: {difference}")
    assert failures == []
