"""Generation benchmark and GPU check: CUDA-graph decoding vs eager decoding vs fla's generate.

Same run, same GPU, same architecture (default: Gated DeltaNet, 24 layers, hidden 1024, 8 heads
x 128, vocab 32000, bf16, random weights; fla's GatedDeltaNetForCausalLM built from the same
numbers). Measures, for deltaflow in each decode mode and for fla:

- ms per new token at batch 1 after a 512-token prompt: (t(1 + N new) - t(1 new)) / N, so the
  prefill is not counted; the median of ``--repeats`` wall-clock runs (host-driven loops:
  CUDA events or do_bench would not see the host side, which is what is being measured);
- tokens/s at batch 1, 16, 64 and 256 (same method, fewer new tokens at large batches);
- prefill time for 512 and 8192 prompt tokens (batch 1);
- the floor: the bytes one decode step must move (weights except the embedding table, which is
  read one row per token; the fp32 recurrent states read and written; conv windows), divided by
  the copy bandwidth measured in the same run, and the fraction of it each mode reaches.

``--check`` first verifies on the GPU what the CPU tests cannot: graph-replayed (and compiled)
greedy generation gives the tokens of eager static decoding and of transformers' loop in fp32
(pure Gated DeltaNet and a hybrid with softmax attention every 4th layer, left-padded batches),
and in bf16 the graphed step's logits agree with the dynamic-cache step's within bf16 tolerance.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # fla
    PYTHONPATH=/tmp/site:. python3 benchmarks/generation.py --check --out benchmarks/results
    python3 benchmarks/generation.py --smoke   # CPU, tiny model, checks + eager decoding, no fla

Writes ``generation_<device>.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from _common import copy_bandwidth, git_commit, output_dir, smoke_env, smoke_requested

# before torch/triton are imported; --warm-only traces Triton's launches (its JIT intercepted),
# which the interpreter would run instead, so its smoke run leaves the interpreter off
if smoke_requested() and not any(a.startswith("--warm-only") for a in sys.argv[1:]):
    smoke_env()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from _models import (  # noqa: E402
    add_architecture_args,
    build_deltaflow,
    build_fla,
    shared_architecture,
)

# --smoke's defaults (flags still override): a tiny model on the CPU, the checks included
SMOKE = dict(
    device="cpu",
    dtype="fp32",
    layers=2,
    hidden=32,
    heads=2,
    head_dim=16,
    vocab=256,
    prompt=16,
    new=4,
    new_large=2,
    batches="1,2",
    prefill="16",
    repeats=1,
    modes="eager",  # graph/compile need CUDA; transformers' loop is in the checks
    skip_fla=True,
    check=True,
)


# ------------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall-clock seconds of ``fn`` (synchronized before and after each run)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_bytes(model: nn.Module, batch: int) -> int:
    """Bytes one decode step must move: weights (embedding: one row per sequence), recurrent
    states read and written (fp32), conv windows read and written."""
    from deltaflow.layers import DeltaAttention

    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    weights += batch * embed.shape[1] * embed.element_size()
    state = 0
    for m in model.modules():
        if isinstance(m, DeltaAttention):
            state += 2 * batch * m.num_v_heads * m.head_dim * m.head_v_dim * 4
            if m.use_short_conv:
                channels = 2 * m.key_dim + m.value_dim
                state += 2 * batch * channels * (m.conv_size - 1) * embed.element_size()
    return weights + state


def prompt(batch: int, length: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 100003 + length)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


def left_padded(batch: int, length: int, vocab: int, device: torch.device):
    ids = prompt(batch, length, vocab, device)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : 7 * row] = 0  # rows of different true lengths
    return ids, mask


# ------------------------------------------------------------------------------- models


def build(name: str, arch: dict[str, Any], dtype: torch.dtype, device: torch.device, **extra):
    torch.manual_seed(0)
    if name == "deltaflow":  # the training benchmark's Gated DeltaNet (+ e.g. attn_every)
        model, _ = build_deltaflow({**arch, **extra})
    else:
        model, _ = build_fla(arch, linear_ce=False)
    return model.to(device=device, dtype=dtype).eval()


def generator_for(model: nn.Module, mode: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``gen(ids, n_new)`` for a decode mode ('fla' = fla's model through transformers)."""

    def gen(ids: torch.Tensor, n_new: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        kw: dict[str, Any] = dict(max_new_tokens=n_new, do_sample=False, eos_token_id=None)
        if mask is not None:
            kw["attention_mask"] = mask
        if mode != "fla":
            kw["decode_mode"] = mode
        with torch.no_grad():
            return model.generate(ids, **kw)

    return gen


def per_token_ms(gen, ids: torch.Tensor, n_new: int, device, repeats: int) -> float:
    gen(ids, n_new + 1)  # warm-up: kernels compiled, graph captured, decoder cached
    t_one = wall(lambda: gen(ids, 1), device, repeats)
    t_all = wall(lambda: gen(ids, n_new + 1), device, repeats)
    return (t_all - t_one) / n_new * 1e3


# ------------------------------------------------------------------------------- checks


# The checks' sizes: left-padded fp32 batch, its prompt and new tokens; the bf16 teacher-forced
# prompt and forced tokens (--smoke: smaller, the same paths); and the layers of the checked
# models: the benchmark's architecture but 2 layers deep, the hybrid's second one softmax
# attention. What the checks compare (tokens and logits of one model across decode paths) is
# per-layer code run once per layer; two layers still cover what crosses layers (each layer's
# own state buffers in the static cache, one layer's output feeding the next, a delta layer
# feeding an attention layer). The "compile" path compiles one graph per model (fp32 pure, fp32
# hybrid, bf16: three, no recompiles beyond them: TORCH_LOGS=recompiles on a CPU), and
# torch.compile's time grows with the layers it traces (24 layers took the check past 90 s on
# an H100; on a CPU a 2-layer graph compiles in about half the time of a 4-layer one,
# benchmarks/NOTES.md, issue 30 session 13).
CHECK = dict(batch=4, prompt=96, new=64, bf16_prompt=128, forced=16, layers=2)
SMOKE_CHECK = dict(batch=2, prompt=24, new=8, bf16_prompt=16, forced=4, layers=2)


@torch.no_grad()
def run_checks(
    arch: dict[str, Any], device: torch.device, modes: list[str], sizes: dict[str, int]
) -> dict[str, Any]:
    from deltaflow.layers import DeltaFlowCache
    from deltaflow.models.generation import Sampling, StaticDecoder

    report: dict[str, Any] = {"layers": sizes["layers"]}
    arch = {**arch, "num_layers": sizes["layers"]}
    # fp32: identical greedy tokens across decode paths (pure and hybrid models)
    last = sizes["layers"]  # the hybrid: softmax attention in the last layer, delta before it
    for label, extra in (
        ("gated_deltanet", {}),
        (f"hybrid_attn_every_{last}", {"attn_every": last}),
    ):
        model = build("deltaflow", arch, torch.float32, device, **extra)
        ids, mask = left_padded(sizes["batch"], sizes["prompt"], arch["vocab_size"], device)
        want = generator_for(model, "transformers")(ids, sizes["new"], mask)
        row = {}
        for mode in ["eager"] + modes:
            got = generator_for(model, mode)(ids, sizes["new"], mask)
            row[mode] = bool(got.shape == want.shape and torch.equal(got, want))
        report[f"fp32_tokens_equal_{label}"] = row
        print(f"[check] fp32 {label}: tokens equal to transformers' loop: {row}")
        del model
        gc.collect()

    # bf16: teacher-forced logits of each decode path against the fp32 model with the same
    # weights; the static paths must be as close to it as the dynamic-cache step is (bf16
    # rounding differs between paths, e.g. the conv accumulates in fp32 in the static step).
    ids = prompt(2, sizes["bf16_prompt"], arch["vocab_size"], device)
    forced = prompt(2, sizes["forced"], arch["vocab_size"], device)

    def dynamic_logits(model: nn.Module) -> list[torch.Tensor]:
        cache = DeltaFlowCache(model.config.num_layers)
        out = [model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
        for t in range(forced.shape[1]):
            step = model(forced[:, t : t + 1], past_key_values=cache, use_cache=True)
            out.append(step.logits[:, -1])
        return [x.float() for x in out]

    def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
        return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))

    model = build("deltaflow", arch, torch.float32, device)
    ref = dynamic_logits(model)
    model = model.to(torch.bfloat16)
    dyn = dynamic_logits(model)
    report["bf16_dynamic_step_vs_fp32"] = rel_err(dyn, ref)
    for mode in modes:
        decoder = StaticDecoder(model, 2, 256, Sampling(), mode=mode)
        got = [decoder.prefill(ids).float()]
        for t in range(forced.shape[1]):
            decoder.position.zero_()
            decoder.ids.copy_(forced[:, t])
            decoder.step()
            got.append(decoder.logits.float().clone())
        err = rel_err(got, ref)
        report[f"bf16_{mode}_vs_fp32"] = {
            "max_abs_err_over_max_logit": err,
            "dynamic_step_err": report["bf16_dynamic_step_vs_fp32"],
            "ok": err <= 2 * report["bf16_dynamic_step_vs_fp32"],
        }
        print(f"[check] bf16 {mode}: {report[f'bf16_{mode}_vs_fp32']}")
        del decoder
    del model
    gc.collect()
    return report


# ------------------------------------------------------------------------------- warm-up


def _prefills(arch: dict[str, Any], sizes: dict[str, int]) -> list[Callable[[], Any]]:
    """The chunked forwards the checks run (every decode path prefills through them; the
    one-token steps run the decode kernel), on CPU tensors with the Triton backend forced:
    what :func:`warm` traces. fp32 pure and hybrid models on the left-padded batch, the bf16
    check's prompt in fp32 and bf16."""
    from deltaflow.layers import DeltaFlowCache

    arch = {**arch, "num_layers": sizes["layers"]}
    cpu = torch.device("cpu")

    def forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> Callable:
        for m in model.modules():
            if hasattr(m, "step_rule") and hasattr(m, "backend"):
                m.backend = "triton"  # 'auto' picks torch for CPU tensors
        cache = DeltaFlowCache(model.config.num_layers)
        return lambda: model(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1)

    ids, mask = left_padded(sizes["batch"], sizes["prompt"], arch["vocab_size"], cpu)
    bf16_ids = prompt(2, sizes["bf16_prompt"], arch["vocab_size"], cpu)
    last = sizes["layers"]
    return [
        lambda: forward(build("deltaflow", arch, torch.float32, cpu), ids, mask)(),
        lambda: forward(build("deltaflow", arch, torch.float32, cpu, attn_every=last), ids, mask)(),
        lambda: forward(build("deltaflow", arch, torch.float32, cpu), bf16_ids, None)(),
        lambda: forward(build("deltaflow", arch, torch.bfloat16, cpu), bf16_ids, None)(),
    ]


def _compile_warm(kind: str, args: tuple, key: Any) -> tuple[float, dict]:
    """A compile task: specialization ``key`` of prefill ``args[0]`` compiled into Triton's
    disk cache (traced on CPU tensors, nothing launched on the GPU)."""
    from _launches import compile_task, intercepted

    index, sms, arch, sizes = args

    def traced(handler: Any) -> None:
        with torch.no_grad(), intercepted(handler, sms):
            _prefills(arch, sizes)[index]()

    return compile_task(key, traced)


def warm(arch: dict[str, Any], sizes: dict[str, int], workers: int, smoke: bool) -> int:
    """Compile the Triton kernels the checks' prefills launch (6: the chunked forward's three
    kernels in fp32 and in bf16; fp32's prepare, tf32x3 dots, is the longest compile), each once
    on ``workers`` processes, on the CPU: check_triton's compile phase over these traces.
    Compiled in the check's own process they are ~40 s of its time, one after another;
    gpu_check.sh runs this beside check_triton instead. Smoke: trace only."""
    from _check_schedule import warm_up
    from _launches import record

    start = time.perf_counter()
    sms = 132 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
    with torch.no_grad():
        keys = [record(fn, sms) for fn in _prefills(arch, sizes)]
    cases = [("prefill", (i, sms, arch, sizes)) for i in range(len(keys))]
    if not warm_up(cases, keys, _compile_warm, workers, smoke, start):
        return 1
    done = (
        "traced, nothing compiled" if smoke else f"warm-up in {time.perf_counter() - start:.0f} s"
    )
    print(f"generation: done ({done})")
    return 0


# ------------------------------------------------------------------------------- benchmark


def bench_model(name: str, modes: list[str], arch, args, device, floor) -> dict[str, Any]:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    try:
        model = build(name, arch, dtype, device)
    except Exception as err:  # noqa: BLE001 - fla is optional
        print(f"[{name}] not built: {err!r}")
        return {"error": repr(err)}
    out: dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "modes": {},
        "prefill_ms": {},
    }
    for mode in modes:
        gen = generator_for(model, mode)
        row: dict[str, Any] = {"tokens_per_s": {}, "floor_fraction": {}}
        try:
            ids = prompt(1, args.prompt, arch["vocab_size"], device)
            t0 = time.perf_counter()
            gen(ids, 2)  # first call: compilation / capture time, reported separately
            row["first_call_s"] = time.perf_counter() - t0
            ms = per_token_ms(gen, ids, args.new, device, args.repeats)
            row["ms_per_token_b1"] = ms
            print(f"[{name}/{mode}] batch 1: {ms:.3f} ms/token")
            for batch in args.batches:
                n_new = args.new if batch == 1 else args.new_large
                ids = prompt(batch, args.prompt, arch["vocab_size"], device)
                ms_b = per_token_ms(gen, ids, n_new, device, max(1, args.repeats // 2))
                row["tokens_per_s"][batch] = batch / ms_b * 1e3
                row["floor_fraction"][batch] = floor(model, batch) / (ms_b / 1e3)
                print(
                    f"[{name}/{mode}] batch {batch}: {batch / ms_b * 1e3:,.0f} tokens/s "
                    f"({ms_b:.3f} ms/step, {row['floor_fraction'][batch]:.1%} of floor)"
                )
        except Exception as err:  # noqa: BLE001 - report and go on with the other modes
            traceback.print_exc()
            row["error"] = repr(err)
        out["modes"][mode] = row
        if name == "deltaflow":
            model.__dict__.pop("_static_decoder", None)  # free the decoder's buffers
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    for length in args.prefill:
        ids = prompt(1, length, arch["vocab_size"], device)
        with torch.no_grad():

            def fill(ids: torch.Tensor = ids, model: nn.Module = model) -> None:
                if name == "deltaflow":
                    from deltaflow.layers import DeltaFlowCache

                    cache = DeltaFlowCache(model.config.num_layers)
                    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                else:
                    model(ids, use_cache=True, logits_to_keep=1)

            try:
                fill()
                out["prefill_ms"][length] = wall(fill, device, args.repeats) * 1e3
                print(f"[{name}] prefill {length}: {out['prefill_ms'][length]:.2f} ms")
            except Exception as err:  # noqa: BLE001
                out["prefill_ms"][length] = repr(err)
    del model
    gc.collect()
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Generation: {report['device']}",
        "",
        f"commit {report['commit']}, torch {report['torch']}, {report['dtype']}, "
        f"architecture {json.dumps(report['architecture'])}, prompt {report['prompt']} tokens, "
        f"{report['new']} new tokens at batch 1 ({report['new_large']} at larger batches), "
        f"greedy, median of {report['repeats']} runs. Copy bandwidth "
        f"{report['bandwidth_gbs']:.0f} GB/s; floor = bytes per step / bandwidth.",
        "",
        "| model / mode | ms/token b1 | "
        + " | ".join(f"tok/s b{b}" for b in report["batches"])
        + " | "
        + " | ".join(f"floor b{b}" for b in report["batches"])
        + " | first call s |",
        "| --- " * (3 + 2 * len(report["batches"])) + "|",
    ]
    for name, res in report["results"].items():
        for mode, row in res.get("modes", {}).items():
            if "error" in row and "ms_per_token_b1" not in row:
                lines.append(f"| {name} / {mode} | error: {row['error'][:80]} |")
                continue
            tps = [row["tokens_per_s"].get(b) for b in report["batches"]]
            fr = [row["floor_fraction"].get(b) for b in report["batches"]]
            lines.append(
                f"| {name} / {mode} | {row['ms_per_token_b1']:.3f} | "
                + " | ".join("-" if x is None else f"{x:,.0f}" for x in tps)
                + " | "
                + " | ".join("-" if x is None else f"{x:.1%}" for x in fr)
                + f" | {row.get('first_call_s', float('nan')):.1f} |"
            )
    lines += [
        "",
        "Prefill (batch 1, ms):",
        "",
        "| model | " + " | ".join(f"{n} tokens" for n in report["prefill"]) + " |",
        "| --- " * (1 + len(report["prefill"])) + "|",
    ]
    for name, res in report["results"].items():
        cells = [res.get("prefill_ms", {}).get(n, "-") for n in report["prefill"]]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c)[:60] for c in cells)
            + " |"
        )
    if report.get("checks"):
        lines += ["", "Checks:", "", "```", json.dumps(report["checks"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None, help="default benchmarks/results (smoke: a temp dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    add_architecture_args(p)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128, help="new tokens timed at batch 1")
    p.add_argument("--new-large", type=int, default=32, help="new tokens at batch > 1")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prefill", default="512,8192")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="graph,compile,eager,transformers")
    p.add_argument("--skip-fla", action="store_true")
    p.add_argument("--check", action="store_true", help="run the GPU checks first")
    p.add_argument("--check-only", action="store_true")
    p.add_argument(
        "--warm-only",
        type=int,
        default=0,
        metavar="WORKERS",
        help="only compile the checks' Triton kernels on this many processes (CPU only), exit",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, --check, no fla")
    if smoke_requested(argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.out = output_dir(args.out, args.smoke)
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    device = torch.device(args.device)
    arch = shared_architecture(args)
    if args.warm_only < 0:
        p.error(f"--warm-only must be a number of processes >= 1, got {args.warm_only}")
    if args.warm_only:
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("error: --warm-only compiles for this machine's GPU: none found")
        code = warm(arch, SMOKE_CHECK if args.smoke else CHECK, args.warm_only, args.smoke)
        raise SystemExit(code)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {
        "device": name,
        "commit": git_commit(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "architecture": arch,
        "prompt": args.prompt,
        "new": args.new,
        "new_large": args.new_large,
        "repeats": args.repeats,
        "batches": args.batches,
        "prefill": args.prefill,
        "results": {},
    }
    stem = "generation_" + name.replace(" ", "_").replace("/", "_")

    def save() -> None:  # after every stage: a run cut off by a time limit keeps what it has
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / f"{stem}.md").write_text(markdown(report))

    report["bandwidth_gbs"] = float("nan")
    if args.check or args.check_only:
        graph_modes = [m for m in modes if m in ("graph", "compile")]
        modes_checked = graph_modes if device.type == "cuda" else []
        sizes = SMOKE_CHECK if args.smoke else CHECK
        report["checks"] = run_checks(arch, device, modes_checked, sizes)
        save()
    if not args.check_only:
        bandwidth = copy_bandwidth(device.type)
        report["bandwidth_gbs"] = bandwidth / 1e9

        def floor(model: nn.Module, batch: int) -> float:
            return step_bytes(model, batch) / bandwidth

        if device.type != "cuda":
            modes = [m for m in modes if m not in ("graph", "compile")]
        report["results"]["deltaflow"] = bench_model("deltaflow", modes, arch, args, device, floor)
        save()
        if args.skip_fla:
            print("fla skipped (--skip-fla)")
        else:
            report["results"]["fla"] = bench_model("fla", ["fla"], arch, args, device, floor)
    save()
    print(markdown(report))
    print(f"wrote {args.out / stem}.md")
    failed = failures(report)
    if failed:  # the report is written; the exit status says something is wrong
        raise SystemExit(f"generation: failed: {'; '.join(failed)}")
    print("generation: done")
    return report


def failures(report: dict[str, Any]) -> list[str]:
    """What went wrong in deltaflow's part (fla is optional): a decode mode or prefill that
    raised, a check that did not hold."""
    found = []
    ours = report["results"].get("deltaflow", {})
    if "error" in ours:
        found.append(f"deltaflow not built: {ours['error']}")
    for mode, row in ours.get("modes", {}).items():
        if "error" in row:
            found.append(f"{mode}: {row['error']}")
    for length, ms in ours.get("prefill_ms", {}).items():
        if not isinstance(ms, float):
            found.append(f"prefill {length}: {ms}")
    for name, value in (report.get("checks") or {}).items():
        if not isinstance(value, dict):  # a number reported beside the checks
            continue
        if not (value["ok"] if name.startswith("bf16_") else all(value.values())):
            found.append(f"check {name}: {value}")
    return found


if __name__ == "__main__":
    main()
