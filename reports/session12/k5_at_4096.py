# ruff: noqa
# fmt: off
# Hidden 4096 bf16 on the t128k5 entries (K = 5 holds the row's 4 chunks; same T, same trees)
# against t128k4 (staged ring), one process, interleaved rounds: the first level alone (two-group
# entries) and the whole op with the host's geometry swapped; bits compared.
import torch
from triton.testing import do_bench
from batchinv.gpu import rms_norm as g
dev = torch.device("cuda")
print(torch.cuda.get_device_name(0), flush=True)
orig = g.backward_geometry
def k5(d, dtype):
    name = orig(d, dtype)
    return ("t128k5", 128, 128) if name[0] == "t128k4" else name
for rows, d, dt in ((16384, 4096, torch.bfloat16), (32768, 4096, torch.bfloat16), (8192, 4096, torch.bfloat16),
                    (16384, 3072, torch.bfloat16)):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    w = torch.randn(d, device=dev, generator=gen).to(dt)
    dy = torch.randn(rows, d, device=dev, generator=gen).to(dt)
    rstd = g.forward(x, w, 1e-6)[1]
    nbytes = x.numel() * x.element_size()
    src = torch.empty(3 * nbytes // 2, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    blocks = -(-rows // 32)
    outs = {}
    def level1(name):
        gx = torch.empty_like(x); p = torch.empty(blocks, d, device=dev)
        def run():
            g.launch_fused_backward(name, dt, dev, blocks, 256, (gx, p, dy, x, w, rstd, 0, rows, d, d), shape=(2, 16))
        run(); outs[name] = (gx.clone(), p.clone())
        return run
    fns = {"L1 k4": level1("t128k4"), "L1 k5": level1("t128k5")}
    same_l1 = torch.equal(outs["t128k4"][0], outs["t128k5"][0]) and torch.equal(outs["t128k4"][1], outs["t128k5"][1])
    a = g.backward(dy, x, w, rstd)
    g.backward_geometry = k5; b = g.backward(dy, x, w, rstd); g.backward_geometry = orig
    same_op = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    def op_k4(): g.backward(dy, x, w, rstd)
    def op_k5():
        g.backward_geometry = k5
        try: g.backward(dy, x, w, rstd)
        finally: g.backward_geometry = orig
    fns["op k4"] = op_k4; fns["op k5"] = op_k5
    res = {k: [] for k in fns}; copies = []
    for rnd in range(4):
        copies.append(do_bench(lambda: dst.copy_(src), warmup=20, rep=60, return_mode="median"))
        for k, f in fns.items():
            res[k].append(do_bench(f, warmup=20, rep=60, return_mode="median"))
    copy = sorted(copies)[2]
    line = f"{rows}x{d} {str(dt)[6:]} bits L1 {same_l1} op {same_op} copy {copy*1e3:.1f}"
    for k, ts in res.items():
        line += f" | {k} " + "/".join(f"{t*1e3:.1f}" for t in ts) + f" ({copy/sorted(ts)[2]:.3f})"
    print(line, flush=True)
