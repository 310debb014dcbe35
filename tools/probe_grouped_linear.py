"""The grouped small-M linear against separate launches, at decode sizes (sm_90a).

For the Qwen3-8B q/k/v (N = 4096, 1024, 1024) and gate/up (N = 12288 x 2) products of one
``x [M, 4096]``, M = 1, 8, 16, bf16, times in a CUDA graph:

- ``separate``: one ``batchinv.linear`` per weight (the chain without ``linear_group``);
- ``grouped``: one ``matmul_grouped`` launch (its default configuration, then each built one);
- eagerly too, ``separate`` against the op table's entry ``gpu.linear.linear_group`` (host
  launch costs included: what an eager decode step pays);

against the copy-rate limit: the bytes the products must move (weights, x, output) over the
rate of a device-to-device copy measured in the same run.  Each graph runs ``--layers``
layers, each with its own weights, so every layer's weights come from HBM as in a decode step
(one layer's q/k/v weights would fit in L2); times are per layer.  Every grouped output is
checked bit for bit against the separate ones after the timed replays; the exit status is 1
if any differs.

    PYTHONPATH=py python tools/probe_grouped_linear.py [--layers 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import batchinv
from batchinv.contract import bitwise_equal
from batchinv.gpu import linear as gpu_linear
from batchinv.shapes import QWEN3_8B_CONFIG

ROWS = (1, 8, 16)
_C = QWEN3_8B_CONFIG
_Q = _C["num_attention_heads"] * _C["head_dim"]
_KV = _C["num_key_value_heads"] * _C["head_dim"]
GROUPS = (("qkv", (_Q, _KV, _KV)), ("gate_up", (_C["intermediate_size"],) * 2))
K = _C["hidden_size"]


def _median_ms(fn, reps: int = 50) -> float:
    """Median time of ``fn()`` (a graph's replay, or eager calls with their host launch
    costs) between CUDA events, after warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _graphed(fn):
    """``fn`` captured in a CUDA graph after warm-up runs (kernel loads, allocator); the graph
    and what the capture returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def copy_gb_per_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    graph, _ = _graphed(lambda: dst.copy_(src))
    ms = _median_ms(graph.replay, reps=20)
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # bytes read + written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="distinct weight sets per graph")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not gpu_linear.uses_hopper(torch.device("cuda")):
        print("the grouped small-M kernel needs an sm_90a GPU and build", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rate = copy_gb_per_s()
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; copy rate {rate:.0f} GB/s; {args.layers} layers per graph")
    results, all_equal = [], True
    dtype = torch.bfloat16
    configs = gpu_linear.small_m_grouped_configs()
    for group, out_features in GROUPS:
        layers = [
            [(torch.randn(n, K, device="cuda") / K**0.5).to(dtype) for n in out_features]
            for _ in range(args.layers)
        ]
        for m in ROWS:
            x = torch.randn(m, K, device="cuda").to(dtype)
            nbytes = 2 * (sum(out_features) * K + m * K + m * sum(out_features))
            limit_ms = nbytes / (rate * 1e9) * 1e3
            with torch.no_grad():
                separate_fn = lambda x=x, layers=layers: [  # noqa: E731
                    [batchinv.linear(x, w) for w in weights] for weights in layers
                ]
                # The op table's entry (checks, views) as a decode step calls it.
                entry_fn = lambda x=x, layers=layers: [  # noqa: E731
                    gpu_linear.linear_group(x, weights, None) for weights in layers
                ]
                if any(outputs is None for outputs in entry_fn()):
                    raise RuntimeError("linear_group declined a case it should take")
                eager = {
                    "separate": _median_ms(separate_fn) / args.layers,
                    "linear_group": _median_ms(entry_fn) / args.layers,
                }
                graph, separate = _graphed(separate_fn)
                variants = [("separate", None, graph)]
                grouped_outputs = {}
                for config in (None, *configs):
                    graph, outs = _graphed(
                        lambda x=x, layers=layers, config=config: [
                            gpu_linear.matmul_grouped(x, weights, config=config)
                            for weights in layers
                        ]
                    )
                    label = f"grouped {config or 'default'}"
                    variants.append((label, config, graph))
                    grouped_outputs[label] = outs
            times = {label: _median_ms(g.replay) / args.layers for label, _, g in variants}
            torch.cuda.synchronize()
            equal = {
                label: all(
                    bitwise_equal(list(out.split(list(out_features), dim=1)), expected)
                    for out, expected in zip(outs, separate, strict=True)
                )
                for label, outs in grouped_outputs.items()
            }
            all_equal &= all(equal.values())
            chosen = gpu_linear.choose_small_m_config(m)
            for label, ms in eager.items():
                results.append(
                    {"group": group, "M": m, "N": list(out_features), "K": K, "timing": "eager",
                     "variant": label, "ms_per_layer": ms, "copy_limit_ms": limit_ms,
                     "of_copy_rate": limit_ms / ms, "vs_separate": eager["separate"] / ms}
                )  # fmt: skip
                print(
                    f"{group:8s} M={m:2d} eager {label:28s} {ms * 1e3:8.2f} us/layer  "
                    f"{eager['separate'] / ms:5.2f}x separate (host launch costs included)"
                )
            for label, ms in times.items():
                row = {
                    "group": group,
                    "M": m,
                    "N": list(out_features),
                    "K": K,
                    "timing": "graph",
                    "variant": label,
                    "ms_per_layer": ms,
                    "copy_limit_ms": limit_ms,
                    "of_copy_rate": limit_ms / ms,
                    "vs_separate": times["separate"] / ms,
                    "bits_equal": equal.get(label),
                }
                if label == "grouped default":
                    row["config"] = str(chosen)
                results.append(row)
                print(
                    f"{group:8s} M={m:2d} {label:34s} {ms * 1e3:8.2f} us/layer  "
                    f"{limit_ms / ms:5.2f} of copy rate  {times['separate'] / ms:5.2f}x separate"
                    + ("" if label == "separate" else f"  bits equal: {equal[label]}")
                )
            del x, separate, grouped_outputs, variants, graph
        del layers
        torch.cuda.empty_cache()
    print("bits: every grouped output equals the separate linears" if all_equal else
          "BITS DIFFER: see bits_equal in the rows")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "copy_gb_per_s": rate,
                    "layers_per_graph": args.layers,
                    "dtype": "bfloat16",
                    "bits_equal": all_equal,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
