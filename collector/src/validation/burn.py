# perch's built-in GPU burn and memory check (run by `perch __validate-gpus` as
# `python3 -c <this> SECONDS DEVICE`). Per GPU: matrix multiplications for SECONDS, each
# result compared with the first (a GPU that computes the same product differently is
# faulty) and with a float64 reference on the CPU; then a pattern written over a share of
# the free memory and read back. One line per GPU; exit 1 when any GPU fails.
import sys, time
import torch

secs = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
kind = sys.argv[2] if len(sys.argv) > 2 else "cuda"
devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if kind == "cuda" else [torch.device("cpu")]
if not devices:
    print("GPU burn: torch sees no CUDA device")
    sys.exit(1)
failed = False
for dev in devices:
    try:
        g = torch.Generator(device="cpu").manual_seed(7)
        n = 4096 if dev.type == "cuda" else 256
        a = torch.randn(n, n, generator=g).to(dev)
        b = torch.randn(n, n, generator=g).to(dev)
        first = a @ b
        ref = (a[:64].double().cpu() @ b.double().cpu())
        err = (first[:64].double().cpu() - ref).abs().max().item()
        if not err < 1e-1 * n ** 0.5:
            raise RuntimeError(f"matmul differs from the float64 reference by {err:.3g}")
        rounds, flops = 0, 0
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline:
            c = a @ b
            rounds += 1
            flops += 2 * n ** 3
            if rounds % 20 == 0:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if not torch.equal(c, first):
                    raise RuntimeError(f"round {rounds}: the same product came out different")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            free, total = torch.cuda.mem_get_info(dev)
            size = int(free * 0.5) // 8 * 8
        else:
            total, size = 0, 64 << 20
        words = size // 8
        buf = torch.empty(words, dtype=torch.int64, device=dev)
        for pattern in (0x5555555555555555, -0x5555555555555556, 0):
            buf.fill_(pattern)
            bad = (buf != pattern).sum().item()
            if bad:
                raise RuntimeError(f"memory check: {bad} words of {words} read back wrong (pattern {pattern:#x})")
        idx = torch.arange(words, device=dev, dtype=torch.int64)
        buf.copy_(idx * 2654435761)
        bad = (buf != idx * 2654435761).sum().item()
        if bad:
            raise RuntimeError(f"memory check: {bad} words read back wrong (address pattern)")
        del buf, idx
        label = f"GPU {dev.index}" if dev.type == "cuda" else "CPU (test run)"
        secs_run = max(secs, 1e-9)
        print(f"{label}: burn {rounds} matmuls ({flops / secs_run / 1e12:.1f} TFLOP/s) and {size >> 20} MiB memory check passed")
    except Exception as e:  # one line per failing GPU, then the next
        failed = True
        label = f"GPU {dev.index}" if dev.type == "cuda" else "CPU"
        print(f"{label}: {e}")
sys.exit(1 if failed else 0)
