"""The sampler's decode step: batchinv (graphed and eager) against stock PyTorch (graphed and
eager) and the copy-rate limit, Qwen3-8B shapes, random bf16 weights.

Goal: batchinv graphed >= 0.9x stock graphed at every batch size.

Each case (batch, context) builds a model of ``layers`` decoder layers (36, Qwen3-8B's count,
or fewer where the KV cache of both paths would not fit: the row says how many) and times one
decode step per token, in ms, each path in the same process:

- batchinv graphed: ``Qwen3DecodeRunner.step()`` replaying its CUDA graph (host time included:
  wall time of consecutive steps, one sync at the end);
- batchinv eager: the same runner with ``cuda_graph=False``;
- batchinv graphed, in order: a runner with ``prefetch_weights=False`` (every launch in stream
  order: what the weight prefetch of the small-M products buys, docs/decode.md);
- stock graphed / eager: cuBLAS (``F.linear``), ``F.rms_norm``, rotate-half RoPE, SDPA over a
  static ``[B, Hkv, capacity, d]`` cache with a key mask (what a PyTorch user writes for a
  static cache), captured in a CUDA graph, and eager;
- limit: the bytes a step must read (every weight but the embedding table, and the cached
  keys/values) over the rate of a device-to-device copy measured in the same run.

Both paths do the same work per step: embedding, the layers, final norm, lm_head, an fp32
log-softmax, the greedy pick, and the fp32 logprob of the picked token (batchinv computes it
with ``token_logprobs``, the trainer's fused path, which reads the lm_head a second time).
The cache starts filled with ``context`` random keys/values per sequence, as after a prefill.
Before timing, the runner's graphed steps are checked bitwise against its eager steps.
"""

from __future__ import annotations

import argparse
import gc
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from batchinv.shapes import QWEN3_8B_CONFIG as QWEN3_8B

GOAL = 0.9
CASES = ((1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 32768))
MAX_LAYERS = 36
STEPS = 30  # timed steps per path (the context grows by as many tokens)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--max-layers", type=int, default=MAX_LAYERS)
    parser.add_argument(
        "--cases", default=None, help="batch:context,... (default: 1:4096,8:4096,...)"
    )
    args = parser.parse_args(argv)
    if args.cases:
        args.cases = tuple(tuple(int(x) for x in c.split(":")) for c in args.cases.split(","))
    else:
        args.cases = CASES
    return args


def layers_that_fit(batch: int, context: int, capacity: int, max_layers: int) -> int:
    """Layers whose weights and one KV cache (the paths run one after the other, each freeing
    its cache) fit in 80% of free memory beside the embedding and lm_head."""
    free, _ = torch.cuda.mem_get_info()
    c = QWEN3_8B
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer_weights = 2 * (
        c["hidden_size"] * (c["num_attention_heads"] * c["head_dim"] + 2 * kv)
        + c["num_attention_heads"] * c["head_dim"] * c["hidden_size"]
        + 3 * c["hidden_size"] * c["intermediate_size"]
    )
    per_layer_cache = 2 * 2 * (batch + 1) * capacity * kv
    fixed = 2 * 2 * c["vocab_size"] * c["hidden_size"] + 4 * batch * c["vocab_size"] * 16
    layers = int((0.8 * free - fixed) // (per_layer_weights + per_layer_cache))
    return max(1, min(max_layers, layers))


def random_weights(config, device, seed):
    from batchinv.reference.qwen3_chain import qwen3_state_dict_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in qwen3_state_dict_shapes(config).items():
        w = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        if len(shape) == 1:
            w = (1.0 + 0.3 * w.float()).bfloat16()
        elif name != "model.embed_tokens.weight":
            w = w / math.sqrt(shape[1])
        weights[name] = w
    return weights


def wall_ms_per_step(step, steps: int = STEPS) -> float:
    """Wall time of ``steps`` consecutive calls, one sync at the end: host time included."""
    import time

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def copy_gb_per_s(device) -> float:
    from _common import median_ms

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # bytes read + written


class StockDecoder:
    """A stock PyTorch decode step over a static cache, graphable (no host reads)."""

    def __init__(self, weights, config, layers, batch, capacity, context, device):
        c = config
        self.w, self.c, self.layers, self.batch = weights, c, layers, batch
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        shape = (layers, batch, self.hkv, capacity, self.d)
        self.k = torch.randn(shape, device=device, dtype=torch.bfloat16)
        self.v = torch.randn(shape, device=device, dtype=torch.bfloat16)
        self.lengths = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.key_index = torch.arange(capacity, device=device)
        half = torch.arange(0, self.d, 2, device=device, dtype=torch.float32) / self.d
        self.inv_freq = 1.0 / (c.rope_theta**half)
        self.rows = torch.arange(batch, device=device)
        self.heads = torch.arange(self.hkv, device=device)
        self.context = context

    def reset(self):
        self.lengths.fill_(self.context)

    def step(self):
        w, c, B, d = self.w, self.c, self.batch, self.d
        eps = c.rms_norm_eps
        pos = self.lengths
        angle = pos[:, None].float() * self.inv_freq[None]
        emb = torch.cat([angle, angle], -1)
        cos, sin = emb.cos().bfloat16()[:, None], emb.sin().bfloat16()[:, None]
        mask = (self.key_index[None] <= pos[:, None])[:, None, None, :]
        h = F.embedding(self.ids, w["model.embed_tokens.weight"])

        def rotate(t):
            t1, t2 = t[..., : d // 2], t[..., d // 2 :]
            return t * cos + torch.cat([-t2, t1], -1) * sin

        for i in range(self.layers):
            p = f"model.layers.{i}."
            x = F.rms_norm(h, (h.shape[-1],), w[p + "input_layernorm.weight"], eps)
            q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(B, self.hq, d)
            k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(B, self.hkv, d)
            v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(B, self.hkv, d)
            q = rotate(F.rms_norm(q, (d,), w[p + "self_attn.q_norm.weight"], eps))
            k = rotate(F.rms_norm(k, (d,), w[p + "self_attn.k_norm.weight"], eps))
            where = (self.rows[:, None], self.heads[None], pos[:, None])
            self.k[i].index_put_(where, k)
            self.v[i].index_put_(where, v)
            a = F.scaled_dot_product_attention(
                q[:, :, None], self.k[i], self.v[i], attn_mask=mask, enable_gqa=True
            )
            h = h + F.linear(a.reshape(B, self.hq * d), w[p + "self_attn.o_proj.weight"])
            x = F.rms_norm(h, (h.shape[-1],), w[p + "post_attention_layernorm.weight"], eps)
            gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
            up = F.linear(x, w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        h = F.rms_norm(h, (h.shape[-1],), w["model.norm.weight"], eps)
        logp = torch.log_softmax(F.linear(h, w["lm_head.weight"]).float(), -1)
        token = logp.argmax(-1)
        self.logprob = logp.gather(-1, token[:, None])[:, 0]
        self.ids.copy_(token)
        self.lengths.add_(1)


def check_graph_equals_eager(runner, slots, steps: int = 3) -> bool:
    """Runs ``steps`` graphed steps, rewinds, runs them eagerly: same tokens and logprobs?"""
    lengths = runner.cache.lengths.clone()
    host = dict(runner._lengths)
    next_token = runner._next_token.clone()
    first = [runner._lengths[s] + 1 for s in slots]

    def sampled():
        rows = torch.tensor(slots, device=runner.device)
        cols = torch.tensor(first, device=runner.device)
        picks = [
            (runner._sampled[rows, cols + j], runner._logprobs[rows, cols + j])
            for j in range(steps)
        ]
        return [(t.clone(), lp.clone()) for t, lp in picks]

    for _ in range(steps):
        runner.step(slots)
    graphed = sampled()
    runner.cache.lengths.copy_(lengths)
    runner._lengths.update(host)
    runner._next_token.copy_(next_token)
    runner.cuda_graph = False
    for _ in range(steps):
        runner.step(slots)
    runner.cuda_graph = True
    eager = sampled()
    runner.sync()
    return all(
        torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
        for a, b in zip(graphed, eager, strict=True)
    )


def time_runner(model, batch, capacity, context, prefetch):
    """(graphed steps bitwise equal to eager ones, graphed ms, eager ms) of a runner whose cache
    starts as after a prefill of ``context`` tokens; eager ms only with ``prefetch``."""
    from batchinv.models.qwen3.decode import Qwen3DecodeRunner

    runner = Qwen3DecodeRunner(
        model, max_batch=batch, capacity=capacity, buckets=[batch], prefetch_weights=prefetch
    )
    slots = runner.add([[1]] * batch)
    with torch.no_grad():  # the cache as after a prefill of `context` tokens
        runner.cache.k.normal_()
        runner.cache.v.normal_()
        runner.cache.lengths[torch.tensor(slots, device=runner.device)] = context
    for s in slots:
        runner._lengths[s] = context
    bitwise = check_graph_equals_eager(runner, slots)
    graphed = wall_ms_per_step(runner.step)
    eager = None
    if prefetch:
        runner.cuda_graph = False
        eager = wall_ms_per_step(runner.step, steps=10)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return bitwise, graphed, eager


def main(argv=None) -> None:
    args = parse_args(argv)
    from _common import report, require_cuda, summary_row

    from batchinv.models.qwen3 import Qwen3, Qwen3Config

    device = require_cuda()
    rate = copy_gb_per_s(device)
    rows, summary = [], []
    for batch, context in args.cases:
        capacity = context + 2 * STEPS + 16
        layers = layers_that_fit(batch, context, capacity, args.max_layers)
        config = Qwen3Config(num_hidden_layers=layers, **QWEN3_8B)
        model = Qwen3(config, random_weights(config, device, seed=0))  # holds its own copy
        weights = model.hf_state_dict()
        in_order = time_runner(model, batch, capacity, context, prefetch=False)[1]
        bitwise, graphed, eager = time_runner(model, batch, capacity, context, prefetch=True)

        stock = StockDecoder(weights, config, layers, batch, capacity, context, device)
        with torch.no_grad():
            stock_eager = wall_ms_per_step(stock.step, steps=10)
            stock.reset()
            from _common import cuda_graph_replay

            replay = cuda_graph_replay(stock.step)
            stock.reset()
            stock_graphed = wall_ms_per_step(replay)
        del stock, replay
        gc.collect()
        torch.cuda.empty_cache()

        read_bytes = (
            sum(
                t.numel() * t.element_size()
                for name, t in weights.items()
                if name != "model.embed_tokens.weight"
            )
            + 2 * layers * batch * context * config.num_key_value_heads * config.head_dim * 2
        )
        limit = read_bytes / (rate * 1e9) * 1e3
        case = f"B={batch} ctx={context}, {layers} layers + lm_head (Qwen3-8B shapes)"
        rows.append(
            {
                "batch": batch,
                "context": context,
                "layers": layers,
                "limit_ms": limit,
                "batchinv_graphed_ms": graphed,
                "batchinv_eager_ms": eager,
                "batchinv_graphed_in_order_ms": in_order,
                "stock_graphed_ms": stock_graphed,
                "stock_eager_ms": stock_eager,
                "graphed_vs_stock_graphed": stock_graphed / graphed,
                "graphed_vs_limit": limit / graphed,
                "graphed_bitwise_eager": bitwise,
                "ms_per_layer_graphed": graphed / layers,
            }
        )
        summary.append(
            summary_row(
                "decode", case, "graphed step", graphed, "stock, CUDA graph", stock_graphed, GOAL
            )
        )
        summary.append(summary_row("decode", case, "eager step", eager, "stock eager", stock_eager))
        summary.append(
            summary_row("decode", case, "graphed step", graphed, "graphed, in order", in_order)
        )
        summary.append(
            summary_row("decode", case, "graphed step", graphed, "copy-rate limit", limit)
        )
        del model, weights
        gc.collect()
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    report(
        "decode",
        rows,
        [
            "batch",
            "context",
            "layers",
            "limit_ms",
            "batchinv_graphed_ms",
            "batchinv_eager_ms",
            "batchinv_graphed_in_order_ms",
            "stock_graphed_ms",
            "stock_eager_ms",
            "graphed_vs_stock_graphed",
            "graphed_bitwise_eager",
        ],
        args.json,
        summary,
    )
    print(f"goal: batchinv graphed >= {GOAL}x stock graphed; copy rate {rate:.0f} GB/s")


if __name__ == "__main__":
    main()
