"""Session 29 call 3: which torch (non-Triton) kernels the op's forward + backward launches at
(8, 4096, 16, 128), bf16 (kernel_times lists a 0.007 ms `unrolled_elementwise_kernel<...CUD`),
with their full names and the Python stack of the torch op that launched each."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from kernel_times import inputs  # noqa: E402

import deltaflow  # noqa: E402

B, T, H, D = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8x4096x16x128").split("x"))
q, k, v, beta, ld = inputs(B, T, H, D, "cuda", grad=True)
do = torch.randn_like(v)


def fn():
    o, _ = deltaflow.delta_rule(q, k, v, beta, rule="delta", log_decay=ld, backend="triton",
                                check_values=False)  # fmt: skip
    torch.autograd.grad(o, (q, k, v, beta, ld), do)


for _ in range(3):
    fn()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    fn()
    torch.cuda.synchronize()
print("== every CUDA kernel (full names)")
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        print(f"{e.device_time_total:9.1f} us  {e.name[:200]}")
print("== torch ops with device time, their stacks")
for e in prof.key_averages(group_by_stack_n=12):
    if e.key.startswith("aten::") and e.device_time_total > 0:
        print(f"{e.key} count {e.count} device {e.device_time_total:.1f} us")
        for line in e.stack:
            print("    ", line)
