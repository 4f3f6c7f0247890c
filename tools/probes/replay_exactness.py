"""Can a buddy replay its owner's optimizer step bit for bit, and where?
(--deadpool-mirror-mode grad; needs a GPU.)

    python -m tools.probes.replay_exactness

An owner steps torch's AdamW (foreach, fused, single-tensor; Adam foreach)
on the GPU, three steps with a changing learning rate and two parameter
groups; a replica made of views into one flat buffer replays the same steps
from the same gradients, once on the GPU and once on the host. Prints, per
kernel and replica device, whether every parameter and moment is equal bit
for bit, and the costs that decide the mode on a GPU: device-to-host copies
of 12 and 4 bytes per element, and one Adam step, for 10^8 elements.
"""

import json
import time

import torch

SIZES = [4096 * 1024, 1024, 4096 * 4096, 4096, 333333]
STEPS = 3
KERNELS = {
    "adamw-foreach": (torch.optim.AdamW, {"foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}),
    "adamw-single": (torch.optim.AdamW, {"foreach": False}),
    "adam-foreach": (torch.optim.Adam, {"foreach": True}),
}


def initial(device):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=generator).to(device) for n in SIZES]


def gradients(step, device):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=generator).to(device) * 1e-2 for n in SIZES]


def groups(params, step):
    lr = 3e-4 * (step + 1) / STEPS
    half = len(params) // 2
    return [
        {"params": params[:half], "weight_decay": 0.1, "lr": lr},
        {"params": params[half:], "weight_decay": 0.0, "lr": lr},
    ]


def owner(cls, options):
    params = initial("cuda")
    optimizer = cls(groups(params, 0), **options)
    for step in range(STEPS):
        for group, fresh in zip(optimizer.param_groups, groups(params, step)):
            group["lr"] = fresh["lr"]
        for param, grad in zip(params, gradients(step, "cuda")):
            param.grad = grad
        optimizer.step()
    return [(p, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in params]


def replica(cls, options, device):
    """What replay.apply does: a fresh optimizer each step over views."""
    flat = torch.zeros(3, sum(SIZES), device=device)
    views, offset = [], 0
    for n, start in zip(SIZES, initial(device)):
        views.append(tuple(flat[i, offset : offset + n] for i in range(3)))
        views[-1][0].copy_(start)
        offset += n
    steps = [0.0] * len(SIZES)
    on_device = options.get("fused") or options.get("capturable")
    for step in range(STEPS):
        params = [v[0] for v in views]
        optimizer = cls(groups(params, step), **options)
        for i, ((param, exp_avg, exp_avg_sq), grad) in enumerate(
            zip(views, gradients(step, device))
        ):
            count = torch.tensor(steps[i])
            optimizer.state[param] = {
                "step": count.to(device) if on_device else count,
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
            }
            param.grad = grad
        optimizer.step()
        steps = [s + 1 for s in steps]
    return views


def compare(a, b) -> dict:
    pairs = [(x.cpu(), y.cpu()) for ta, tb in zip(a, b) for x, y in zip(ta, tb)]
    return {
        "bit_equal": all(torch.equal(x, y) for x, y in pairs),
        "max_abs_difference": max(float((x - y).abs().max()) for x, y in pairs),
    }


def timed_ms(function, repeats=5) -> float:
    function()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def costs(n=100_000_000) -> dict:
    state, grad = torch.randn(3, n, device="cuda"), torch.randn(n, device="cuda")
    host12, host4 = torch.empty(3, n, pin_memory=True), torch.empty(n, pin_memory=True)
    out = {
        "elements": n,
        "d2h_12_bytes_per_element_ms": timed_ms(lambda: host12.copy_(state, non_blocking=True)),
        "d2h_4_bytes_per_element_ms": timed_ms(lambda: host4.copy_(grad, non_blocking=True)),
    }
    param = state[0].clone()
    param.grad = grad
    for name in ("foreach", "fused"):
        optimizer = torch.optim.AdamW([param], lr=1e-4, **{name: True})
        out[f"adamw_{name}_step_ms"] = timed_ms(optimizer.step)
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "tools.probes.replay_exactness needs a GPU"
            " (on CPU: tests/unit_tests/state/test_replay.py)"
        )
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for name, (cls, options) in KERNELS.items():
        reference = owner(cls, options)
        report[f"{name}, replica on the GPU"] = compare(reference, replica(cls, options, "cuda"))
        host = {k: v for k, v in options.items() if k != "fused"} or {"foreach": False}
        report[f"{name}, replica on the host"] = compare(reference, replica(cls, host, "cpu"))
    report.update(costs())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
