"""The CUDA linear backward's plan on the CPU: which products read their operands in place
(``matmul_nn``, ``matmul_tn``) and which keep the transposed copies, the tile choice, and the
launch arguments (TMA maps, grid, block), with the GPU replaced by stand-ins.  The stand-in
products compute the definitions exactly, so the wiring (which operand goes where) is checked
by comparing the two routes' results; tests/gpu/test_linear_backward_cuda.py compares the
real kernels' bits."""

from __future__ import annotations

import pytest
import torch

from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import linear_cublaslt as lc

SMS = 132


def _exact(t: torch.Tensor) -> torch.Tensor:
    return t.double()


class FakeGpu:
    """sm_90 with the products computed exactly in float64 (then cast), each call recorded
    as ``(name, operand shapes)``."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, tuple]] = []
        monkeypatch.setattr(gpu_linear, "uses_hopper", lambda device: True)
        monkeypatch.setattr(gpu_linear, "multiprocessors", lambda index: SMS)
        # The general path's routing; the kept launches that replay it are
        # tests/ops/test_host_path_cache.py's.
        monkeypatch.setattr(gpu_linear, "_lean_backward", lambda *args: None)
        for name, product in (
            ("matmul_nn", lambda a, b: _exact(a) @ _exact(b)),
            ("matmul_tn", lambda a, b: _exact(a).T @ _exact(b)),
            ("matmul_nt", lambda a, b: _exact(a) @ _exact(b).T),
            ("matmul_rows", lambda a, b: _exact(a) @ _exact(b).T),
            ("_pinned_rows", lambda a, b: _exact(a) @ _exact(b).T),
        ):
            monkeypatch.setattr(gpu_linear, name, self._recording(name, product))

    def _recording(self, name, product):
        def call(a, b, *args, **kwargs):
            self.calls.append((name, (tuple(a.shape), tuple(b.shape))))
            return product(a, b).to(a.dtype)

        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(lc, "_chosen", "own")  # the switch: batchinv's kernels only
    return FakeGpu(monkeypatch)


def _case(m, n, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (m, k), generator=gen).to(dtype)  # small integers: exact sums
    w = torch.randint(-4, 5, (n, k), generator=gen).to(dtype)
    grad = torch.randint(-4, 5, (m, n), generator=gen).to(dtype)
    return grad, x, w


# ------------------------------------------------------------------------------ the routes


@pytest.mark.parametrize("m", (17, 64, 257, 4096))
def test_training_sized_batches_read_every_operand_in_place(gpu, m):
    grad, x, w = _case(m, 48, 64)
    gpu_linear.backward(grad, x, w, torch.bfloat16)
    assert gpu.calls == [
        ("matmul_nn", ((m, 48), (48, 64))),  # grad_x = dY · W, W as it lies
        ("matmul_tn", ((m, 48), (m, 64))),  # grad_W = dYᵀ · X, both as they lie
        ("matmul_nn", ((1, m), (m, 48))),  # grad_bias = 1ᵀ · dY
    ]


@pytest.mark.parametrize("m", (1, 8, 16))
def test_decode_sized_grad_x_keeps_the_small_m_kernel_on_the_transposed_weight(gpu, m):
    grad, x, w = _case(m, 48, 64)
    gpu_linear.backward(grad, x, w, None)
    assert gpu.calls == [
        ("matmul_rows", ((m, 48), (64, 48))),
        ("matmul_tn", ((m, 48), (m, 64))),
    ]


def test_out_features_not_a_multiple_of_8_keep_the_padded_copies(gpu):
    # dY's rows are 2 * 44 = 88 bytes apart: TMA cannot read them where they lie.
    grad, x, w = _case(33, 44, 64)
    gpu_linear.backward(grad, x, w, torch.bfloat16)
    assert gpu.calls == [
        ("matmul_rows", ((33, 48), (64, 48))),  # N padded to 48 with zero columns
        ("matmul_nt", ((44, 40), (64, 40))),  # tokens padded to 40
        ("matmul_nt", ((1, 40), (44, 40))),
    ]


def test_misaligned_input_keeps_the_copies_for_the_products_that_read_it(gpu):
    grad, x, w = _case(33, 48, 64)
    storage = torch.empty(33 * 64 + 4, dtype=x.dtype)
    x_view = storage[4:].view(33, 64)  # 8 bytes past a 16-byte boundary
    x_view.copy_(x)
    assert not gpu_linear.tma_readable(x_view)
    gpu_linear.backward(grad, x_view, w, None)
    assert gpu.calls == [
        ("matmul_nn", ((33, 48), (48, 64))),  # grad_x does not read x
        ("matmul_nt", ((48, 40), (64, 40))),
    ]


def test_a_strided_input_is_read_in_place_with_its_row_stride(gpu):
    grad, x, w = _case(33, 48, 64)
    wide = torch.zeros(33, 72, dtype=x.dtype)
    wide[:, :64] = x
    x_view = wide[:, :64]  # rows 144 bytes apart
    assert gpu_linear.tma_readable(x_view) and not x_view.is_contiguous()
    gpu_linear.backward(grad, x_view, w, None, (False, True, False))
    assert gpu.names() == ["matmul_tn"]


def test_transposed_copies_runs_the_copy_based_products(gpu):
    grad, x, w = _case(257, 48, 64)
    gpu_linear.backward(grad, x, w, torch.bfloat16, transposed_copies=True)
    assert gpu.calls == [
        ("matmul_rows", ((257, 48), (64, 48))),
        ("matmul_nt", ((48, 264), (64, 264))),
        ("matmul_nt", ((1, 264), (48, 264))),
    ]


def test_other_gpus_run_the_copy_based_products(gpu, monkeypatch):
    monkeypatch.setattr(gpu_linear, "uses_hopper", lambda device: False)
    grad, x, w = _case(257, 48, 64)
    gpu_linear.backward(grad, x, w, None)
    assert gpu.names() == ["matmul_rows", "matmul_nt"]


@pytest.mark.parametrize(
    "m, n, k, needs, with_bias",
    [
        (257, 48, 64, (True, True, True), True),
        (17, 8, 8, (True, True, True), True),
        (3, 48, 64, (True, True, False), False),
        (40, 44, 64, (True, True, True), True),
        (300, 136, 256, (False, True, True), True),
        (300, 136, 256, (True, False, False), False),
    ],
)
def test_both_routes_compute_the_same_products(gpu, m, n, k, needs, with_bias):
    grad, x, w = _case(m, n, k, seed=m)
    bias_dtype = torch.bfloat16 if with_bias else None
    in_place = gpu_linear.backward(grad, x.reshape(1, m, k), w, bias_dtype, needs)
    copies = gpu_linear.backward(
        grad, x.reshape(1, m, k), w, bias_dtype, needs, transposed_copies=True
    )
    expected = (grad.double() @ w.double(), grad.double().T @ x.double(), grad.double().sum(0))
    wanted = (needs[0], needs[1], needs[2] and with_bias)
    for got, want, other, needed in zip(in_place, expected, copies, wanted, strict=True):
        if not needed:
            assert got is None and other is None
            continue
        # The stand-ins sum exactly and round once, as the definition does.
        assert torch.equal(got.reshape(want.shape), want.to(got.dtype))
        assert torch.equal(other, got)
    assert in_place[0] is None or in_place[0].shape == (1, m, k)


def test_empty_batch_takes_the_copies(gpu):
    grad, x, w = _case(0, 48, 64)
    gpu_linear.backward(grad, x, w, torch.bfloat16)
    assert "matmul_nn" not in gpu.names() and "matmul_tn" not in gpu.names()


# ------------------------------------------------------------- grad_x and the cuBLASLt switch


def _no_rows_path(*args, **kwargs):
    raise AssertionError("rows_path (and a copy of Wᵀ for it) was not expected")


def test_own_path_never_copies_the_weight_for_cublaslt(gpu, monkeypatch):
    monkeypatch.setattr(gpu_linear, "rows_path", _no_rows_path)
    grad, _, w = _case(lc.MIN_ROWS, 48, 64)
    assert gpu_linear.grad_x_route(grad, w) == ("in place", None)


def test_auto_asks_the_pinned_path_once_and_a_refused_shape_stays_in_place(gpu, monkeypatch):
    monkeypatch.setattr(lc, "_chosen", "auto")
    monkeypatch.setattr(lc, "_REFUSED", {})
    grad, _, w = _case(lc.MIN_ROWS, 48, 64, dtype=torch.float16)
    asked = []

    def refusing_rows_path(m, weight, has_bias, path=None):
        asked.append((m, tuple(weight.shape), weight.is_contiguous()))
        lc._REFUSED[(weight.device.index, *weight.shape, weight.dtype)] = "stand-in refusal"
        return "own"

    monkeypatch.setattr(gpu_linear, "rows_path", refusing_rows_path)
    assert gpu_linear.grad_x_route(grad, w) == ("in place", None)
    assert asked == [(lc.MIN_ROWS, (64, 48), True)]  # the Wᵀ its self-check compares
    assert gpu_linear.grad_x_route(grad, w) == ("in place", None)
    assert len(asked) == 1, "a refused shape makes no second copy of Wᵀ"


@pytest.mark.parametrize("path", ("auto", "cublaslt"))
def test_where_the_pinned_path_serves_grad_x_runs_it_on_the_transposed_weight(
    gpu, monkeypatch, path
):
    monkeypatch.setattr(lc, "_chosen", path)
    monkeypatch.setattr(lc, "_REFUSED", {})
    monkeypatch.setattr(gpu_linear, "rows_path", lambda m, weight, has_bias, p=None: "cublaslt")
    grad, x, w = _case(lc.MIN_ROWS, 48, 64, dtype=torch.float16)
    route, weight_t = gpu_linear.grad_x_route(grad, w)
    assert route == "cublaslt" and torch.equal(weight_t, w.t()) and weight_t.is_contiguous()
    gpu_linear.backward(grad, x, w, None, (True, False, False))
    # The pinned product itself: grad_x_route has asked rows_path, which is not asked again.
    assert gpu.calls == [("_pinned_rows", ((lc.MIN_ROWS, 48), (64, 48)))]


def test_below_min_rows_the_switch_is_not_consulted(gpu, monkeypatch):
    monkeypatch.setattr(lc, "_chosen", "cublaslt")
    monkeypatch.setattr(gpu_linear, "rows_path", _no_rows_path)
    grad, _, w = _case(lc.MIN_ROWS - 1, 48, 64)
    assert gpu_linear.grad_x_route(grad, w) == ("in place", None)


# ------------------------------------------------------------------- tiles and launches


@pytest.mark.parametrize(
    "rows, cols, block_m",
    [
        (1, 4096, 64),  # grad_bias: one row
        (300, 4096, 64),  # 5 x 16 tiles of 64 rows fill 80 SMs; 128-row tiles 48
        (4096, 4096, 128),
        (16384, 12288, 128),
        (151936, 4096, 128),
    ],
)
def test_tile_rows_follow_the_cost_model(rows, cols, block_m):
    for layout in ("tb", "tab"):
        config = gpu_linear.choose_transposed_config(layout, rows, cols, SMS)
        assert config == gpu_linear.TransposedConfig(layout, block_m)


def test_transposed_config_names_and_resources():
    config = gpu_linear.TransposedConfig("tab", 128)
    assert config.kernel_name(torch.bfloat16) == "linear_hopper_tab_bf16_bm128_bn256_k64_s4"
    assert config.kernel_name(torch.float16) == "linear_hopper_tab_f16_bm128_bn256_k64_s4"
    assert gpu_linear._TRANSPOSED_NAME.match(config.kernel_name(torch.float16))
    assert not gpu_linear._HOPPER_NAME.match(config.kernel_name(torch.float16))
    assert config.tile.threads == 384
    assert config.tile.shared_bytes == 4 * (128 + 256) * 64 * 2 + 16 * 4 + 1024
    assert str(gpu_linear.TransposedConfig("tb", 64)) == "hopper tb bm64 bn256 k64 s4"


def test_tma_readable():
    t = torch.empty(4, 16, dtype=torch.bfloat16)
    assert gpu_linear.tma_readable(t)
    assert gpu_linear.tma_readable(torch.empty(1, 16, dtype=torch.bfloat16)[:, :13])
    assert not gpu_linear.tma_readable(torch.empty(4, 12, dtype=torch.bfloat16))  # 24-byte rows
    assert not gpu_linear.tma_readable(t.t())  # column stride 16
    assert not gpu_linear.tma_readable(t.flatten()[4:52].view(3, 16))  # base 8 bytes off
    assert not gpu_linear.tma_readable(torch.empty(0, 16, dtype=torch.bfloat16))
    assert not gpu_linear.tma_readable(torch.empty(4, 16, dtype=torch.bfloat16)[None])


@pytest.fixture
def launches(monkeypatch):
    """sm_90 with 132 SMs whose TMA maps and launches are recorded instead of made."""
    recorded = {"maps": [], "launches": []}

    def tensor_map(address, dtype_name, rows, cols, row_bytes, box_rows, box_cols, swizzle, device):
        recorded["maps"].append(
            {"rows": rows, "cols": cols, "row_bytes": row_bytes, "box": (box_rows, box_cols)}
        )
        return f"map{len(recorded['maps'])}".encode()

    def record(kernel, device, grid, block, args, **options):
        recorded["launches"].append({"kernel": kernel, "grid": grid, "block": block, "args": args})

    monkeypatch.setattr(gpu_linear, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_linear, "multiprocessors", lambda index: SMS)
    monkeypatch.setattr(gpu_linear, "tensor_map_2d", tensor_map)
    monkeypatch.setattr(gpu_linear, "kernel_for", lambda module, kernel, device: kernel)
    monkeypatch.setattr(gpu_linear, "allow_dynamic_shared", lambda *args: None)
    monkeypatch.setattr(gpu_linear, "launch", record)
    gpu_linear._tensor_map.cache_clear()
    gpu_linear._gemm_kernel.cache_clear()
    yield recorded
    gpu_linear._tensor_map.cache_clear()
    gpu_linear._gemm_kernel.cache_clear()


def test_matmul_nn_reads_b_n_major_where_it_lies(launches):
    a = torch.empty(300, 4096, dtype=torch.bfloat16)  # dY [M, N_out]
    b = torch.empty(4096, 1000, dtype=torch.bfloat16)  # W [N_out, K_in]
    out = gpu_linear.matmul_nn(a, b)
    assert out.shape == (300, 1000) and out.dtype == torch.bfloat16
    assert launches["maps"] == [
        {"rows": 300, "cols": 4096, "row_bytes": 8192, "box": (64, 64)},  # K-major, BM rows
        {"rows": 4096, "cols": 1000, "row_bytes": 2000, "box": (64, 64)},  # 64 k-rows x 64
    ]
    (launch,) = launches["launches"]
    assert launch["kernel"] == "linear_hopper_tb_bf16_bm64_bn256_k64_s4"
    assert launch["grid"] == (5 * 4,) and launch["block"] == (256,)
    assert launch["args"][2] is out and launch["args"][3:] == (0, 300, 1000, 4096)  # no bias


def test_matmul_tn_reads_both_operands_where_they_lie(launches):
    tokens = 257
    wide = torch.empty(tokens, 4104, dtype=torch.float16)
    grad = torch.empty(tokens, 4096, dtype=torch.float16)  # dY [tokens, N_out]
    x = wide[:, :1000]  # X [tokens, K_in], rows 4104 elements apart
    out = gpu_linear.matmul_tn(grad, x)
    assert out.shape == (4096, 1000) and out.dtype == torch.float16
    assert launches["maps"] == [
        {"rows": tokens, "cols": 4096, "row_bytes": 8192, "box": (64, 64)},  # M-major
        {"rows": tokens, "cols": 1000, "row_bytes": 8208, "box": (64, 64)},  # N-major
    ]
    (launch,) = launches["launches"]
    assert launch["kernel"] == "linear_hopper_tab_f16_bm128_bn256_k64_s4"
    assert launch["grid"] == (32 * 4,) and launch["block"] == (384,)
    assert launch["args"][3:] == (0, 4096, 1000, tokens)


def test_bias_gradient_reads_a_16_byte_row_of_ones(launches):
    grad = torch.empty(13, 48, dtype=torch.bfloat16)
    x = torch.empty(13, 64, dtype=torch.bfloat16)
    w = torch.empty(48, 64, dtype=torch.bfloat16)
    gpu_linear.backward(grad, x, w, torch.float32, (False, False, True))
    assert launches["maps"] == [
        {"rows": 1, "cols": 13, "row_bytes": 32, "box": (64, 64)},  # 16 ones, 13 read
        {"rows": 13, "cols": 48, "row_bytes": 96, "box": (64, 64)},
    ]
    (launch,) = launches["launches"]
    assert launch["kernel"] == "linear_hopper_tb_bf16_bm64_bn256_k64_s4"
    assert launch["args"][3:] == (0, 1, 48, 13)


def test_operands_tma_cannot_read_are_a_clear_error(launches):
    a = torch.empty(3, 12, dtype=torch.bfloat16)
    b = torch.empty(12, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a cannot be read in place by TMA"):
        gpu_linear.matmul_nn(a, b)
    with pytest.raises(ValueError, match="reduced dimensions differ"):
        gpu_linear.matmul_tn(torch.empty(8, 16, dtype=torch.bfloat16), b)
    with pytest.raises(TypeError, match="both bf16 or both fp16"):
        gpu_linear.matmul_nn(torch.empty(3, 16, dtype=torch.bfloat16), b.half())
    with pytest.raises(ValueError, match="runs the 'tb' kernels"):
        gpu_linear.matmul_nn(
            torch.empty(3, 16, dtype=torch.bfloat16),
            torch.empty(16, 16, dtype=torch.bfloat16),
            config=gpu_linear.TransposedConfig("tab", 64),
        )
