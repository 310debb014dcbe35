"""``gpu.linear.prefetching_weights``: which launches ask for programmatic dependent launch.

On the CPU, with recording stand-ins for the kernels and the launcher: inside the context
every small-M launch (the general path, ``linear``'s kept launch, the grouped kernel, checked
and kept) is programmatic, and nothing else is; outside it none is.  The decode runner enters
the context in its steps unless ``prefetch_weights=False``.  That the bits do not change and
that the overlap is safe are GPU questions: tests/gpu/test_linear_weight_prefetch_cuda.py.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from _fake_kernels import FakeKernel
from batchinv.gpu import linear as gpu_linear


class Recorder:
    """A ``launch`` stand-in: records the ``programmatic`` flag of each call."""

    def __init__(self):
        self.programmatic = []

    def launch(self, kernel, device, grid, block, args, shared_mem=0, programmatic=False):
        self.programmatic.append(programmatic)


def programmatic_flags(launches: list) -> list[bool]:
    """The ``programmatic`` flag of each launch a ``FakeKernel`` recorded."""
    return [record[6] for record in launches]


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(gpu_linear, "launch", rec.launch)
    monkeypatch.setattr(gpu_linear, "_tensor_map", lambda *args: b"map")
    monkeypatch.setattr(gpu_linear, "_gemm_kernel", lambda *args: "kernel")
    monkeypatch.setattr(gpu_linear, "_grouped_kernel", lambda *args: "kernel")
    monkeypatch.setattr(gpu_linear, "allow_dynamic_shared", lambda *args: None)
    monkeypatch.setattr(gpu_linear, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return rec


def operands(m=1, n=64, k=128):
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    return x, torch.zeros(n, k, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)


def test_the_context_nests_and_belongs_to_its_thread():
    assert not gpu_linear.prefetches_weights()
    with gpu_linear.prefetching_weights():
        with gpu_linear.prefetching_weights():
            assert gpu_linear.prefetches_weights()
        assert gpu_linear.prefetches_weights()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(gpu_linear.prefetches_weights()))
        thread.start()
        thread.join()
        assert seen == [False]
    assert not gpu_linear.prefetches_weights()
    with pytest.raises(RuntimeError), gpu_linear.prefetching_weights():
        raise RuntimeError("left by an error")
    assert not gpu_linear.prefetches_weights()


def test_general_path_small_m_launches_are_programmatic_inside_only(recorder):
    x, w, out = operands()
    small = gpu_linear.SmallMConfig(32, 128, 8)
    tile = gpu_linear.choose_config(64, 64, 132)
    gpu_linear._launch_tma_gemm(small, 8, x, w, out, 0)
    with gpu_linear.prefetching_weights():
        gpu_linear._launch_tma_gemm(small, 8, x, w, out, 0)
        gpu_linear._launch_tma_gemm(tile, tile.block_m, x, w, out, 0)  # the tiles never
    assert recorder.programmatic == [False, True, False]


def test_grouped_launches_are_programmatic_inside_only(recorder):
    x, w, _ = operands()
    config = gpu_linear.SmallMConfig(32, 128, 8)
    gpu_linear._launch_grouped(x, [w, w], [None, None], config, None)
    with gpu_linear.prefetching_weights():
        gpu_linear._launch_grouped(x, [w, w], [None, None], config, None)
    assert recorder.programmatic == [False, True]


def test_kept_grouped_launches_are_programmatic_inside_only(recorder):
    x, w, _ = operands()
    launches = []
    plan = gpu_linear._LeanGrouped(
        FakeKernel("grouped", launches), (4,), (96,), 0, 1, 128, (64, 64, 0), 128,
        ("bf16", 8, 32), {},
    )  # fmt: skip
    gpu_linear._run_grouped(plan, x, [w, w], None)
    with gpu_linear.prefetching_weights():
        gpu_linear._run_grouped(plan, x, [w, w], None)
    assert programmatic_flags(launches) == [False, True]


@pytest.mark.parametrize("small_m", [True, False])
def test_kept_linear_launches_are_programmatic_for_small_m_inside_only(
    recorder, monkeypatch, small_m
):
    x, w, _ = operands()
    launches = []
    lean = gpu_linear._Lean(
        FakeKernel("linear", launches), (2,), (96,), 0, (1, 64), (1, 64, 128), None, ({}, {}),
        small_m,
    )  # fmt: skip
    monkeypatch.setattr(gpu_linear, "_LEAN", {})
    monkeypatch.setattr(gpu_linear, "_lean_plan", lambda *args: lean)
    gpu_linear.forward_no_grad(x, w)
    with gpu_linear.prefetching_weights():
        gpu_linear.forward_no_grad(x, w)
    assert programmatic_flags(launches) == [False, small_m]


def test_the_decode_runner_prefetches_in_its_steps_unless_told_not_to(monkeypatch):
    from batchinv.models import Qwen3
    from batchinv.models.qwen3.decode import Qwen3DecodeRunner

    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(True)
        yield

    monkeypatch.setattr(gpu_linear, "prefetching_weights", spy)
    model = Qwen3.from_config(seed=0, dtype=torch.float32)
    for prefetch, want in ((True, 1), (False, 0)):
        entered.clear()
        runner = Qwen3DecodeRunner(model, max_batch=1, capacity=8, prefetch_weights=prefetch)
        runner.add([[1, 2, 3]])
        runner.step()
        assert len(entered) == want
    with pytest.raises(TypeError, match="prefetch_weights must be a bool"):
        Qwen3DecodeRunner(model, max_batch=1, capacity=8, prefetch_weights=1)
