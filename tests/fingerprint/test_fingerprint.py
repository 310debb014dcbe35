"""``batchinv.fingerprint`` on the CPU: inputs drawn the same way every time, the digest's byte
order, the JSON schema, the comparator naming exactly what differs, the CLI's exit codes, and
the quick case set's fingerprint of the references computed twice with the same bits."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json

import pytest
import torch

import batchinv
from batchinv import fingerprint as fp
from batchinv.cli import main

CPU = torch.device("cpu")
# The SHA-256 of ``Inputs("golden").values("x", (3, 5), float32)``: a torch whose CPU generator
# draws other integers (or a machine that builds other floats from them) fails here first.
GOLDEN_VALUES_SHA256 = "96a7d5a18dcd21f11d93129e844cf909ffadf6a314338c0bf46202111e940e70"
GOLDEN_IDS = [70, 21, 2, 75, 56, 29, 40]


@pytest.fixture(scope="module")
def quick() -> dict:
    return fp.fingerprint(CPU)


def test_inputs_are_the_same_bits_every_time():
    first, second = fp.Inputs("case a", CPU), fp.Inputs("case a", CPU)
    for inputs in (first, second):
        inputs.values("x", (33, 17), torch.bfloat16, 4.0)
        inputs.ids("ids", (19,), 1000)
        inputs.values("y", (5,), torch.float32)
    for name in ("x", "ids", "y"):
        assert torch.equal(first.made[name].view(-1), second.made[name].view(-1)), name
    assert first.digest() == second.digest()
    other = fp.Inputs("case b", CPU)
    other.values("x", (33, 17), torch.bfloat16, 4.0)
    assert not torch.equal(other.made["x"], first.made["x"])


def test_inputs_match_the_golden_draw():
    inputs = fp.Inputs("golden", CPU)
    x = inputs.values("x", (3, 5), torch.float32)
    assert fp.tensor_digest(x)["sha256"] == GOLDEN_VALUES_SHA256
    assert inputs.ids("ids", (7,), 100).tolist() == GOLDEN_IDS


def test_values_are_exact_24_bit_mantissas_within_scale():
    inputs = fp.Inputs("exact", CPU)
    x = inputs.values("x", (4096,), torch.float32, 2.0, octaves=4).double()
    assert float(x.abs().max()) < 2.0
    # Each value is an integer below 2**24 times 2**-(23 + octave) * scale (scale = 2).
    scaled = x * 2.0 ** (24 + 3 - 1)
    assert torch.equal(scaled, scaled.round())
    # Several octaves, so a reduction over them rounds.
    exponents = torch.frexp(x[x != 0])[1]
    assert int(exponents.max() - exponents.min()) >= 4
    with pytest.raises(ValueError, match="power of two"):
        inputs.values("bad", (2,), torch.float32, 3.0)
    with pytest.raises(ValueError, match="drawn twice"):
        inputs.values("x", (2,), torch.float32)


def test_reused_inputs_give_the_same_digest_and_tensors():
    with fp.reused_inputs():
        a = fp.Inputs("reuse", CPU)
        ta = a.values("x", (8, 8), torch.bfloat16)
        b = fp.Inputs("reuse", CPU)
        tb = b.values("x", (8, 8), torch.bfloat16)
        assert torch.equal(ta, tb)
        assert a.digest() == b.digest()
    fresh = fp.Inputs("reuse", CPU)
    assert torch.equal(fresh.values("x", (8, 8), torch.bfloat16), ta)


def test_tensor_digest_is_little_endian_bytes_of_the_contiguous_copy():
    t = torch.tensor([1, -2], dtype=torch.int16)
    assert fp.tensor_digest(t) == {
        "sha256": hashlib.sha256(bytes([0x01, 0x00, 0xFE, 0xFF])).hexdigest(),
        "dtype": "int16",
        "shape": [2],
    }
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fp.tensor_digest(x.t())["sha256"] == fp.tensor_digest(x.t().contiguous())["sha256"]
    # The bits, not the values: -0.0 is not +0.0; bf16 hashes its two bytes.
    zero = fp.tensor_digest(torch.tensor([0.0]))["sha256"]
    assert fp.tensor_digest(torch.tensor([-0.0]))["sha256"] != zero
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert fp.tensor_digest(b)["sha256"] == hashlib.sha256(bytes([0x80, 0x3F])).hexdigest()
    assert fp.tensor_digest(torch.tensor([True, False]))["shape"] == [2]
    assert fp.tensor_digest(torch.empty(0, 3))["shape"] == [0, 3]


def test_case_sets_cover_every_public_op_and_the_model():
    ops = {"embedding", "linear", "rms_norm", "fused_add_rms_norm", "rope", "silu_mul"}
    ops |= {"attention", "attention_varlen", "attention_decode", "log_softmax"}
    ops |= {"token_logprobs", "qwen3_forward", "qwen3_decode", "qwen3_token_logprobs"}
    assert {c.op for c in fp.FULL_CASES} == ops
    assert {c.op for c in fp.QUICK_CASES} == ops
    for case_set in fp.CASE_SETS:
        names = [c.name for c in fp.cases(case_set)]
        assert len(names) == len(set(names))
    full = {c.name: c.params for c in fp.FULL_CASES}
    # The production paths the full case set must reach.
    assert any(p.get("rows", 0) >= 1024 for c, p in full.items() if c.startswith("linear"))
    assert full["lm_head"]["out"] == 151936
    assert max(full["attention_varlen"]["lengths"]) > 2048
    assert max(full["attention_decode"]["contexts"]) > 2048
    assert full["log_softmax"]["vocab"] == full["token_logprobs"]["vocab"] == 151936
    with pytest.raises(ValueError, match="case_set"):
        fp.cases("huge")


def test_known_differences_name_real_cases_and_variants():
    full = {c.name for c in fp.FULL_CASES}
    variants = {v.name for v in fp.path_variants()}
    for case, variant in fp.KNOWN_PATH_DIFFERENCES:
        assert case in full and variant in variants, (case, variant)
    assert set(fp.ARCHITECTURE_DEPENDENT_CASES) <= full


def test_quick_fingerprint_of_the_references_twice_is_identical(quick):
    again = fp.fingerprint(CPU)
    assert fp.compare(quick, again) == []
    assert quick["cases"] == again["cases"]
    assert set(quick["cases"]) == {c.name for c in fp.QUICK_CASES}
    for name, entry in quick["cases"].items():
        assert "error" not in entry, (name, entry.get("error"))
        assert entry["path"] == "reference"
        assert entry["outputs"], name


def test_schema(quick, tmp_path):
    assert quick["fingerprint_version"] == fp.FINGERPRINT_VERSION
    assert quick["batchinv_version"] == batchinv.__version__
    assert quick["case_set"] == "quick"
    assert quick["card"] == {"name": "CPU"}
    path = fp.write(quick, tmp_path / "cpu.json")
    assert fp.load(path) == json.loads(json.dumps(quick))
    for key in fp.SCHEMA_KEYS:
        broken = {k: v for k, v in quick.items() if k != key}
        with pytest.raises(ValueError, match=key):
            fp.check_schema(broken)
    broken = copy.deepcopy(quick)
    broken["cases"]["linear"]["error"] = "RuntimeError: both"
    with pytest.raises(ValueError, match="either outputs or an error"):
        fp.check_schema(broken)
    broken = copy.deepcopy(quick)
    del broken["cases"]["linear"]["outputs"]["out"]["sha256"]
    with pytest.raises(ValueError, match="linear.out"):
        fp.check_schema(broken)


def test_compare_names_exactly_what_differs(quick):
    other = copy.deepcopy(quick)
    other["cases"]["linear"]["outputs"]["grad_x"]["sha256"] = "0" * 64
    other["cases"]["rope"]["outputs"]["q"]["sha256"] = "1" * 64
    other["cases"]["rope"]["path"] = "somewhere else"
    other["cases"]["silu_mul"]["inputs_sha256"] = "2" * 64
    other["cases"]["rms_norm"]["outputs"]["out"]["dtype"] = "float16"
    del other["cases"]["embedding"]
    other["cases"]["token_logprobs"] = {
        "op": "token_logprobs",
        "inputs_sha256": quick["cases"]["token_logprobs"]["inputs_sha256"],
        "error": "RuntimeError: no kernel",
    }
    found = {(d.case, d.output): d.what for d in fp.compare(quick, other)}
    assert found == {
        ("embedding", None): "only in the first fingerprint",
        ("linear", "grad_x"): "bits differ",
        ("rms_norm", "out"): "bfloat16[17, 64] vs float16[17, 64]",
        ("rope", "q"): "bits differ (paths 'reference' vs 'somewhere else')",
        ("silu_mul", None): "inputs differ (another input generator)",
        ("token_logprobs", None): "error: None vs 'RuntimeError: no kernel'",
    }
    assert fp.compare(quick, copy.deepcopy(quick)) == []
    assert str(fp.Difference("linear", "out", "bits differ")) == "linear.out: bits differ"


def test_comparable_and_architecture_exceptions(quick):
    assert fp.comparable(quick, quick) is None
    newer = dict(quick, fingerprint_version=fp.FINGERPRINT_VERSION + 1)
    assert "fingerprint_version" in fp.comparable(quick, newer)
    assert "batchinv_version" in fp.comparable(quick, dict(quick, batchinv_version="9"))
    h200 = dict(quick, card={"name": "NVIDIA H200", "compute_capability": "9.0"})
    h100 = dict(quick, card={"name": "NVIDIA H100", "compute_capability": "9.0"})
    a100 = dict(quick, card={"name": "NVIDIA A100", "compute_capability": "8.0"})
    assert fp.architecture_exceptions(h200, h100) == {}
    assert set(fp.architecture_exceptions(h200, a100)) == set(fp.ARCHITECTURE_DEPENDENT_CASES)


def test_card_slug():
    assert fp.card_slug("NVIDIA H200") == "nvidia-h200"
    assert fp.card_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert fp.card_slug("???") == "unknown"


def test_run_case_records_an_op_that_cannot_run(monkeypatch):
    def refuses(params, inputs):
        inputs.values("x", (2,), torch.float32)
        raise RuntimeError("no kernel for this card\nsecond line")

    monkeypatch.setitem(fp._RUNNERS, "linear", refuses)
    entry = fp.run_case(fp.Case("linear", "linear"), CPU)
    assert entry["error"] == "RuntimeError: no kernel for this card"
    assert "outputs" not in entry and entry["inputs_sha256"]


def test_cli_writes_the_json_and_keeps_exit_codes(tmp_path, capsys):
    out = tmp_path / "fp.json"
    assert main(["fingerprint", "--device", "cpu", "--case", "linear", "--json", str(out)]) == 0
    data = fp.load(out)
    assert list(data["cases"]) == ["linear"]
    assert "linear" in capsys.readouterr().out
    assert main(["fingerprint", "--device", "cpu", "--case", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["fingerprint", "--device", "tpu"]) == 2
    assert main(["fingerprint", "--device", "cpu", "--paths"]) == 2
    assert main(["fingerprint", "--json", str(tmp_path / "missing" / "x.json")]) == 2
    if not torch.cuda.is_available():
        assert main(["fingerprint", "--device", "cuda"]) == 2


def test_run_variant_reports_same_differs_and_not_applicable(monkeypatch):
    selected = tuple(c for c in fp.QUICK_CASES if c.name in ("linear", "rms_norm", "rope"))
    original_linear, original_rope = fp._RUNNERS["linear"], fp._RUNNERS["rope"]

    def flipped_linear(params, inputs):
        run = original_linear(params, inputs)
        run.outputs["grad_x"] = -run.outputs["grad_x"]
        return run

    def failing_rope(params, inputs):
        raise ValueError("this path does not apply")

    @contextlib.contextmanager
    def context():
        with monkeypatch.context() as m:
            m.setitem(fp._RUNNERS, "linear", flipped_linear)
            m.setitem(fp._RUNNERS, "rope", failing_rope)
            yield

    variant = fp.PathVariant("test", frozenset({"linear", "rope", "rms_norm"}), context, "")
    with fp.reused_inputs():
        baseline = {c.name: fp.run_case(c, CPU) for c in selected}
        row = fp.run_variant(variant, baseline, CPU, selected)
    assert row == {
        "linear": "differs: grad_x",
        "rms_norm": "same",
        "rope": "not applicable: ValueError: this path does not apply",
    }
    assert fp._RUNNERS["rope"] is original_rope
    assert fp.unexpected_differences({"test": row}) == ["test / linear: differs: grad_x"]
    monkeypatch.setitem(fp.KNOWN_PATH_DIFFERENCES, ("linear", "test"), "a listed reason")
    assert fp.unexpected_differences({"test": row}) == []


@pytest.mark.parametrize("debug", [[], ["--debug"]])
def test_cli_internal_error_exits_3(debug, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("an invariant of batchinv itself\nsecond line")

    monkeypatch.setattr(fp, "fingerprint", broken)
    assert main(["fingerprint", "--device", "cpu", *debug]) == 3
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: an invariant of batchinv itself" in err
    assert ("Traceback" in err) == bool(debug)


@pytest.mark.parametrize("device", ["nonsense", "meta"])
def test_cli_bad_device_exits_2_with_one_line(device, tmp_path, capsys):
    assert main(["fingerprint", "--device", device, "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert device in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
