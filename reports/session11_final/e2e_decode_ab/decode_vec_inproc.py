# ruff: noqa
# fmt: off
# One process: the e2e decode step (bench_qwen3_e2e's setup) timed in alternating rounds with the
# RMSNorm forward's *_vec entries on and off (VECTOR_ENTRIES emptied = main's kernels), plus the
# summed CUDA kernel time of one step in each mode (torch.profiler).
import sys, statistics, torch
sys.path.insert(0, "benchmarks")
import bench_qwen3_e2e as b
import batchinv.gpu.rms_norm as r
from _common import median_ms
from batchinv.models.qwen3 import Qwen3, Qwen3Config

device = torch.device("cuda")
config = Qwen3Config(num_hidden_layers=2, **b.QWEN3_8B)
model = Qwen3(config, b.random_weights(config, device, 0))
gen = torch.Generator(device=device).manual_seed(1)
ids = torch.randint(0, config.vocab_size, (64, 1), device=device, generator=gen)
caches = b.filled_caches(model, 64, 4096, 2)
def step(path):
    for c in caches:
        c.set_lengths(4096)
    return model.final_hidden(ids, caches=caches, ops=path)
VEC = r.VECTOR_ENTRIES
modes = {"vec": VEC, "novec": frozenset()}
res = {(m, p): [] for m in modes for p in ("batchinv", "stock")}
with torch.no_grad():
    for rnd in range(5):
        for m, entries in modes.items():
            r.VECTOR_ENTRIES = entries
            for p in ("batchinv", "stock"):
                res[(m, p)].append(median_ms(lambda: step(p)))
    for k, v in res.items():
        print(k, " ".join(f"{x:.3f}" for x in v), "median", f"{statistics.median(v):.3f}")
    from torch.profiler import profile, ProfilerActivity
    for m, entries in modes.items():
        r.VECTOR_ENTRIES = entries
        for _ in range(3):
            step("batchinv")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step("batchinv")
            torch.cuda.synchronize()
        total = sum(e.device_time_total for e in prof.key_averages()) / 10 / 1000
        print(m, f"kernel time per step {total:.3f} ms")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=12))
