"""Unpack / pack launch variants, one rank, decode (T=128, H=7168, E=288, K=8): per variant, CUDA graphs of two
pairs each (facade fp8, AllToAll with DeepEP-layout scales, AllToAll plain), replayed interleaved round by round."""
import json, os, socket, statistics, sys
import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 288, 8
V = {}

def patch():
    import moe_a2a.triton_kernels.dispatch as D
    from moe_a2a.triton_kernels import _launch as launch
    from moe_a2a.config import ceil_div
    ou, op = D._UNPACK.launch, D._PACK.launch
    def unpack(key, grid, *a, **kw):
        if V.get("EL") and (kw.get("SCALES_BY_EXPERT") or kw.get("QSCALES_BY_EXPERT")):
            kw["EXPERT_LOOP"] = True
            kw["BLOCK_S"] = V.get("ELS", 32)
        return ou(key, grid, *a, **kw)
    def pack(key, grid, *a, **kw):
        if V.get("PACK") and kw.get("QUANT"):
            bw = max(kw["Q_BLOCK"], V["PACK"])
            grid = (grid[0], ceil_div(kw["X_WORDS"], bw) * (2 if kw.get("REMOTE_FIRST") else 1))
            kw["BLOCK_W"], kw["num_warps"] = bw, launch.num_warps(kw["BLOCK_T"] * bw, 2)
        return op(key, grid, *a, **kw)
    D._UNPACK.launch, D._PACK.launch = unpack, pack
    return D

def main():
    rounds, reps = int(sys.argv[1]), int(sys.argv[2])
    variants = {"base": {}, "EL32": {"EL": 1}, "EL8": {"EL": 1, "ELS": 8}, "EL32_P2048": {"EL": 1, "PACK": 2048},
                "EL8_P2048": {"EL": 1, "ELS": 8, "PACK": 2048}, "P2048": {"PACK": 2048}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    D = patch()
    from moe_a2a import A2AConfig, AllToAll
    from moe_a2a.compat import Buffer
    from moe_a2a.compat._slots import column_major_scales
    from moe_a2a.triton_kernels.quant import quantize_fp8
    dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    buf = Buffer(None, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
    y_f = torch.zeros(E, T, H, dtype=torch.bfloat16, device=dev)
    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H, in_dtype=torch.float8_e4m3fn,
                    scale_block=128, out_dtype=torch.bfloat16, expert_capacity=T)
    a2a = AllToAll(cfg, transport="shm", device=dev, gpu_wait="kernel", timeout_s=60.0)
    xq, xs = quantize_fp8(x, 128)
    num, ex, exs = a2a.empty_dispatch_outputs()
    exs_d = column_major_scales(E, T, cfg.num_scales, torch.float32, dev)
    y = torch.zeros(ex.shape[0], H, dtype=torch.bfloat16, device=dev)
    def facade():
        _, _, h, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        buf.low_latency_combine(y_f, idx, w, h, out=out)
    def deep():
        a2a.dispatch(num, ex, exs_d, xq, xs, idx); a2a.combine(out, idx, w, y)
    def plain():
        a2a.dispatch(num, ex, exs, xq, xs, idx); a2a.combine(out, idx, w, y)
    graphs, outs = {}, {}
    for name, v in variants.items():
        V.clear(); V.update(v); D._UNPACK.clear(); D._PACK.clear()
        for pname, pair in (("facade", facade), ("deep", deep)) + ((("plain", plain),) if name == "base" else ()):
            for _ in range(3):
                pair()
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                pair(); pair()
            graphs[(name, pname)] = gr
            gr.replay(); torch.cuda.synchronize()
            outs[(name, pname)] = (out.clone(), exs_d.clone() if pname == "deep" else None, ex.clone())
    # the same results from every variant (bitwise)
    same = {f"{n}/{p}": all(torch.equal(a, b) for a, b in zip(outs[(n, p)], outs[("base", p)]) if a is not None)
            for (n, p) in outs}
    times = {f"{n}/{p}": [] for (n, p) in graphs}
    keys = list(graphs)
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            gr = graphs[key]
            for _ in range(5):
                gr.replay()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); gr.replay(); b.record(); b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / 2)
            times[f"{key[0]}/{key[1]}"].append(statistics.median(ts))
    res = {"gpu": torch.cuda.get_device_name(0), "rounds": rounds, "reps": reps, "same_as_base": same,
           "median_us_per_pair": {k: round(statistics.median(v), 2) for k, v in times.items()},
           "per_round": {k: [round(t, 2) for t in v] for k, v in times.items()}}
    plain_us = res["median_us_per_pair"]["base/plain"]
    res["gap_over_plain"] = {k: round(v - plain_us, 2) for k, v in res["median_us_per_pair"].items()}
    print(json.dumps(res, indent=1))
    a2a.close(); buf.close()

if __name__ == "__main__":
    main()
