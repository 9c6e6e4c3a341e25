"""N-D fusions as users write them, which fuser runs with inputs read repeated over some row
axes (one kernel: adaLN, a masked softmax, a per-channel scale), in another order of their
axes or as segments of segments (fuser/reorder.py): fuser against PyTorch eager (the ATen
ops users call) and torch.compile of the same formula, and a device copy of the same bytes.

    PYTHONPATH=. python3 bench/nd.py [--case batchnorm_nchw,...] [--dtype bf16]
        [--no-compile] [--breakdown] [--out DIR]

Each case at its shape: median time (bench/run.py's timer), GB/s of the minimal bytes (each
input read once, each output written once) and its fraction of the copy's; for fuser also the
moves (permutes and expands between kernels, their bytes) and the fraction of the chain's
bound (its kernels' inputs and outputs, so the moves' copies included:
fraction_of_segments_bound); max relative error of fuser and torch.compile against eager.
--breakdown also records the device time of each kernel a call runs (torch.profiler,
bench/breakdown.py) for fuser and torch.compile, and the table gives the fraction of the
copy their kernels alone reach: where it is far above the call's, the call is host-bound
(its launches and Python, not its kernels, set the figure).
Writes OUT/<date>-nd.json (bench/run.py's report format, a case per result) and its plot,
OUT/<date>-nd.png (bench/plot.py's plot_cases: each case's fraction of the copy), and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from dataclasses import dataclass

import numpy as np

from bench.run import (
    TOLERANCE,
    add_case_options,
    breakdown,
    check_cases,
    environment,
    error_record,
    finish_entry,
    make_timer,
    max_rel_err,
    minimal_bytes,
    output_paths,
    segment_bytes,
    sync,
    to_device,
    write_report,
)
from fuser import DataType, FusionDefinition

F = DataType.Float
EPS = 1e-5


def broadcast_like(fd, t, like, dims):
    """`t` broadcast to `like`'s shape, its axes at `dims`."""
    return fd.ops.broadcast_in_dim(t, shape=like.shape(), broadcast_dims=dims)


def batchnorm_nchw(fd, dtype):
    """BatchNorm2d's training forward over NCHW: per-channel statistics over N, H and W."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    w, b = fd.define_tensor([-1]), fd.define_tensor([-1])
    xf = fd.ops.cast(x, F)
    var, mean = fd.ops.var_mean(xf, [0, 2, 3], correction=0, keepdim=False)
    y = fd.ops.mul(fd.ops.sub(xf, broadcast_like(fd, mean, x, [1])),
                   broadcast_like(fd, fd.ops.rsqrt(fd.ops.add(var, EPS)), x, [1]))
    y = fd.ops.add(fd.ops.mul(y, broadcast_like(fd, w, x, [1])), broadcast_like(fd, b, x, [1]))
    fd.add_output(fd.ops.cast(y, dtype))


def batchnorm_nchw_backward(fd, dtype):
    """BatchNorm2d's backward over NCHW from the saved mean and 1 / std: grad_input, and the
    weight's and bias' gradients (sums over N, H and W per channel)."""
    x, dy = fd.define_tensor([-1, -1, -1, -1], dtype=dtype), fd.define_tensor([-1, -1, -1, -1],
                                                                             dtype=dtype)
    mean, invstd, w = fd.define_tensor([-1]), fd.define_tensor([-1]), fd.define_tensor([-1])
    xf, dyf = fd.ops.cast(x, F), fd.ops.cast(dy, F)
    xhat = fd.ops.mul(fd.ops.sub(xf, broadcast_like(fd, mean, x, [1])),
                      broadcast_like(fd, invstd, x, [1]))
    count = fd.ops.mul(fd.ops.mul(x.size(0), x.size(2)), x.size(3))
    dbias = fd.ops.sum(dyf, [0, 2, 3])
    dweight = fd.ops.sum(fd.ops.mul(dyf, xhat), [0, 2, 3])
    centered = fd.ops.sub(
        fd.ops.sub(dyf, broadcast_like(fd, fd.ops.div(dbias, count), x, [1])),
        fd.ops.mul(xhat, broadcast_like(fd, fd.ops.div(dweight, count), x, [1])))
    scale = fd.ops.mul(w, invstd)
    fd.add_output(fd.ops.cast(fd.ops.mul(centered, broadcast_like(fd, scale, x, [1])), dtype))
    fd.add_output(dweight)
    fd.add_output(dbias)


def group_norm_affine(fd, dtype, groups=32):
    """GroupNorm over NCHW with its per-channel weight and bias."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    w, b = fd.define_tensor([-1]), fd.define_tensor([-1])
    rows = fd.ops.reshape(fd.ops.cast(x, F), [x.size(0), groups, -1])
    var, mean = fd.ops.var_mean(rows, [2], correction=0, keepdim=True)
    y = fd.ops.mul(fd.ops.sub(rows, mean), fd.ops.rsqrt(fd.ops.add(var, EPS)))
    y = fd.ops.reshape(y, x.shape())
    y = fd.ops.add(fd.ops.mul(y, broadcast_like(fd, w, x, [1])), broadcast_like(fd, b, x, [1]))
    fd.add_output(fd.ops.cast(y, dtype))


def modulated_layernorm(fd, dtype):
    """A diffusion transformer's adaLN: LayerNorm of [batch, seq, hidden] without affine,
    then * (1 + scale) + shift, scale and shift [batch, hidden]."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    scale, shift = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])
    xf = fd.ops.cast(x, F)
    var, mean = fd.ops.var_mean(xf, [2], correction=0, keepdim=True)
    y = fd.ops.mul(fd.ops.sub(xf, mean), fd.ops.rsqrt(fd.ops.add(var, EPS)))
    y = fd.ops.add(fd.ops.mul(y, fd.ops.add(broadcast_like(fd, scale, x, [0, 2]), 1.0)),
                   broadcast_like(fd, shift, x, [0, 2]))
    fd.add_output(fd.ops.cast(y, dtype))


def masked_softmax(fd, dtype):
    """Softmax of attention scores [batch, heads, q, k] along k where a [q, k] mask holds."""
    s = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    m = fd.define_tensor([-1, -1], dtype=DataType.Bool)
    masked = fd.ops.where(broadcast_like(fd, m, s, [2, 3]), fd.ops.cast(s, F), float("-inf"))
    e = fd.ops.exp(fd.ops.sub(masked, fd.ops.max(masked, [3], keepdim=True)))
    fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, [3], keepdim=True)), dtype))


def mean_over_sequence(fd, dtype):
    """Mean pooling of [batch, seq, hidden] over the sequence."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    s = fd.ops.sum(fd.ops.cast(x, F), [1])
    fd.add_output(fd.ops.cast(fd.ops.div(s, x.size(1)), dtype))


def masked_mean_pooling(fd, dtype):
    """Mean pooling of [batch, seq, hidden] over the positions a [batch, seq, 1] mask holds:
    the masked sum over the count (fuser.lowering spreads the count along hidden)."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    m = fd.ops.cast(fd.define_tensor([-1, -1, 1], dtype=DataType.Bool), F)
    pooled = fd.ops.div(fd.ops.sum(fd.ops.mul(fd.ops.cast(x, F), m), [1]), fd.ops.sum(m, [1]))
    fd.add_output(fd.ops.cast(pooled, dtype))


def bias_gradient(fd, dtype):
    """A linear layer's bias gradient: grad_out [tokens, hidden] summed over the tokens."""
    dy = fd.define_tensor([-1, -1], dtype=dtype)
    fd.add_output(fd.ops.cast(fd.ops.sum(fd.ops.cast(dy, F), [0]), dtype))


def centered_over_sequence(fd, dtype):
    """[batch, seq, hidden] minus its mean over the sequence (per sample and feature), and
    that mean: a normalization by column sums per group."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    mean = fd.ops.div(fd.ops.sum(xf, [1], keepdim=True), x.size(1))
    fd.add_output(fd.ops.cast(fd.ops.sub(xf, mean), dtype))
    fd.add_output(fd.ops.cast(fd.ops.squeeze(mean, [1]), dtype))


def channel_scale(fd, dtype):
    """x * w over NCHW with a [C] weight (an inference BatchNorm folded to a scale)."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    w = fd.define_tensor([-1])
    fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.cast(x, F), broadcast_like(fd, w, x, [1])), dtype))


# ----- what PyTorch runs for each: eager (ATen's ops), and the formula torch.compile sees ---

def _eager_batchnorm(x, w, b):
    import torch.nn.functional as nnf

    return (nnf.batch_norm(x.float(), None, None, w, b, training=True, eps=EPS).to(x.dtype),)


def _eager_batchnorm_backward(x, dy, mean, invstd, w):
    import torch

    grad_input, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, mean, invstd, True, EPS, [True, True, True])
    return grad_input, grad_weight, grad_bias


def _eager_group_norm(x, w, b):
    import torch.nn.functional as nnf

    return (nnf.group_norm(x.float(), 32, w, b, eps=EPS).to(x.dtype),)


def _eager_modulated(x, scale, shift):
    import torch.nn.functional as nnf

    y = nnf.layer_norm(x.float(), x.shape[-1:], eps=EPS)
    return ((y * (1 + scale[:, None]) + shift[:, None]).to(x.dtype),)


def _eager_masked_softmax(s, m):
    return (s.float().masked_fill(~m, float("-inf")).softmax(-1).to(s.dtype),)


def _eager_mean(x):
    return (x.float().mean(1).to(x.dtype),)


def _eager_masked_mean(x, m):
    held = m.float()
    return (((x.float() * held).sum(1) / held.sum(1)).to(x.dtype),)


def _eager_bias_gradient(dy):
    return (dy.float().sum(0).to(dy.dtype),)


def _eager_centered(x):
    mean = x.float().mean(1, keepdim=True)
    return ((x.float() - mean).to(x.dtype), mean.squeeze(1).to(x.dtype))


def _eager_channel_scale(x, w):
    return ((x.float() * w[None, :, None, None]).to(x.dtype),)


@dataclass(frozen=True)
class Case:
    build: object  # (fd, dtype) -> None
    shape: tuple[tuple[int, ...], ...]  # per input
    eager: object  # PyTorch on the same inputs, a tuple of outputs like fuser's
    mask: bool = False  # the second input is a Bool mask


CASES = {
    "batchnorm_nchw": Case(batchnorm_nchw, ((32, 64, 56, 56), (64,), (64,)), _eager_batchnorm),
    # a late ResNet layer's: many channels, rows of 49
    "batchnorm_nchw_7x7": Case(batchnorm_nchw, ((256, 512, 7, 7), (512,), (512,)),
                               _eager_batchnorm),
    "batchnorm_nchw_backward": Case(batchnorm_nchw_backward,
                                    ((32, 64, 56, 56),) * 2 + ((64,),) * 3,
                                    _eager_batchnorm_backward),
    "batchnorm_nchw_backward_7x7": Case(batchnorm_nchw_backward,
                                        ((256, 512, 7, 7),) * 2 + ((512,),) * 3,
                                        _eager_batchnorm_backward),
    "group_norm_affine": Case(group_norm_affine, ((8, 256, 32, 32), (256,), (256,)),
                              _eager_group_norm),
    "modulated_layernorm": Case(modulated_layernorm, ((8, 1024, 4096), (8, 4096), (8, 4096)),
                                _eager_modulated),
    "masked_softmax": Case(masked_softmax, ((4, 16, 1024, 1024), (1024, 1024)),
                           _eager_masked_softmax, mask=True),
    "mean_over_sequence": Case(mean_over_sequence, ((8, 1024, 4096),), _eager_mean),
    # many groups of few slabs each: their slabs together fill the SMs
    "mean_over_many_sequences": Case(mean_over_sequence, ((64, 2048, 1024),), _eager_mean),
    "mean_over_short_sequences": Case(mean_over_sequence, ((256, 256, 1024),), _eager_mean),
    "masked_mean_pooling": Case(masked_mean_pooling, ((8, 1024, 4096), (8, 1024, 1)),
                                _eager_masked_mean, mask=True),
    "centered_over_sequence": Case(centered_over_sequence, ((8, 1024, 4096),), _eager_centered),
    "bias_gradient": Case(bias_gradient, ((16384, 4096),), _eager_bias_gradient),
    "channel_scale": Case(channel_scale, ((32, 64, 56, 56), (64,)), _eager_channel_scale),
    # rows of 7 elements: vectors of one element where a row bounds them
    "channel_scale_7x7": Case(channel_scale, ((256, 512, 7, 7), (512,)), _eager_channel_scale),
}
DTYPES = {"bf16": DataType.BFloat16, "fp16": DataType.Half, "fp32": DataType.Float}


def definition(name: str, dtype: DataType) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        CASES[name].build(fd, dtype)
    return fd


def host_inputs(name: str, dtype: DataType, shape=None, seed: int = 0) -> list[np.ndarray]:
    """Standard normal data in `dtype` (each input of the first one's shape: BatchNorm
    backward's x and grad_out), parameters in float32 (weights near 1), a mask with most
    entries held and its first column always (no row wholly masked)."""
    case, rng = CASES[name], np.random.default_rng(seed)
    shapes = shape or case.shape
    arrays = [rng.standard_normal(shapes[0]).astype(np.float32).astype(dtype.numpy)]
    for i, s in enumerate(shapes[1:], 1):
        if case.mask and i == 1:
            arrays.append(mask(rng, s))
        elif tuple(s) == tuple(shapes[0]):
            arrays.append(rng.standard_normal(s).astype(np.float32).astype(dtype.numpy))
        else:
            arrays.append((1 + 0.1 * rng.standard_normal(s)).astype(np.float32))
    return arrays


def mask(rng: np.random.Generator, shape) -> np.ndarray:
    """A Bool mask with most entries held and its first column always (no row wholly
    masked, so a masked softmax stays finite); of one column ([batch, seq, 1]), each
    sample's first position (no sample wholly masked, so a masked mean stays finite)."""
    held = rng.random(shape) < 0.8
    if shape[-1] == 1:
        held[..., 0, :] = True
    else:
        held[..., 0] = True
    return held


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_options(p, CASES)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--breakdown", action="store_true",
                   help="also record each kernel's device time per call (torch.profiler)")
    args = p.parse_args(argv)
    check_cases(p, args, CASES)
    return args


def moves(fd) -> list[str]:
    """The layout ops fuser makes between kernels for `fd` (nested segmentations' too)."""
    from fuser import layouts
    from fuser.executor import segments_of

    segmentation = segments_of(fd)
    if segmentation is None:
        return []
    found = [layouts.describe(e) for e in segmentation.layouts]
    for s in segmentation.segments:
        found += moves(s.definition)
    return found


def bench_case(name: str, args, timer) -> dict:
    """Every implementation of one case; failures become {"error": ...}."""
    import torch

    from bench.baselines import device_copy

    dtype = DTYPES[args.dtype]
    inputs = [to_device(a, 0) for a in host_inputs(name, dtype)]
    case = CASES[name]
    entry: dict = {"case": name, "shape": "x".join(map(str, case.shape[0])), "impls": {}}
    impls = entry["impls"]

    def timed(fn) -> dict:
        return {"time_us": timer(fn) * 1e3}

    ref = case.eager(*inputs)
    sync()
    entry["bytes"] = minimal_bytes(inputs, ref)
    copy_fn, copy_bytes = device_copy(entry["bytes"])
    impls["copy"] = {"bytes": copy_bytes, **timed(copy_fn)}
    impls["eager"] = timed(lambda: case.eager(*inputs))
    fd = definition(name, dtype)
    try:
        outs = fd.execute(inputs)
        sync()
        m = {"max_rel_err": max_rel_err(outs, ref)}
        m["correct"] = m["max_rel_err"] <= TOLERANCE
        m.update(timed(lambda: fd.execute(inputs)))
        if args.breakdown:
            m["kernels_us"] = breakdown(lambda: fd.execute(inputs))
        m["moves"] = moves(fd)
        segments = segment_bytes(fd, inputs)
        if segments is not None:
            m["segment_bytes"] = segments
        impls["fuser"] = m
    except Exception as exc:
        impls["fuser"] = error_record(exc)
    if args.no_compile:
        impls["compile"] = {"skipped": "--no-compile"}
    else:
        try:
            fn = torch.compile(case.eager, dynamic=False)
            outs = fn(*inputs)
            sync()
            m = {"max_rel_err": max_rel_err(outs, ref)}
            m["correct"] = m["max_rel_err"] <= TOLERANCE
            m.update(timed(lambda: fn(*inputs)))
            if args.breakdown:
                m["kernels_us"] = breakdown(lambda: fn(*inputs))
            impls["compile"] = m
        except Exception as exc:
            impls["compile"] = error_record(exc)
    return finish_entry(entry)


def markdown(report: dict) -> str:
    """case | shape | copy GB/s | fuser (of copy, of its chain's bound) | compile | eager."""
    def cell(m: dict) -> str:
        if "error" in m or "skipped" in m or "gbps" not in m:
            return "error" if "error" in m else "-"
        text = f"{m['gbps']:.0f} ({m['fraction_of_copy']:.2f})"
        if m.get("fraction_of_segments_bound") is not None:
            text += f" [{m['fraction_of_segments_bound']:.2f} of its chain]"
        kernels = kernels_fraction(m)
        if kernels is not None:
            text += f" {{kernels {kernels:.2f}}}"
        return text + (" WRONG" if m.get("correct") is False else "")

    lines = [f"N-D fusions, {report['dtype']}, {report.get('device', '?')}, GB/s (fraction of "
             "the copy; {kernels: the fraction its kernels' device time alone reaches}):", "",
             "| case | shape | copy | fuser | torch.compile | eager |",
             "| --- | --- | --- | --- | --- | --- |"]
    for e in report["results"]:
        i = e.get("impls", {})
        copy = i.get("copy", {})
        lines.append(f"| {e['case']} | {e.get('shape', '')} | {copy.get('gbps', 0):.0f} | "
                     f"{cell(i.get('fuser', {}))} | {cell(i.get('compile', {}))} | "
                     f"{cell(i.get('eager', {}))} |")
    return "\n".join(lines)


def kernels_fraction(m: dict) -> float | None:
    """The fraction of the copy an implementation's kernels reach on their device time alone
    (the sum of its kernels_us per call), or None without a breakdown."""
    kernels = m.get("kernels_us")
    if not kernels or "error" in kernels or not m.get("fraction_of_copy"):
        return None
    return m["fraction_of_copy"] * m["time_us"] / sum(kernels.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    timer_desc, timer = make_timer(args.timer)
    env = environment()
    report = {"fusion": "nd", "dtype": args.dtype, "timer": timer_desc,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": "PYTHONPATH=. python3 bench/nd.py " + shlex.join(
                  sys.argv[1:] if argv is None else argv),
              **env, "results": []}
    for name in args.case:
        try:
            report["results"].append(bench_case(name, args, timer))
        except Exception as exc:
            report["results"].append({"case": name, **error_record(exc)})
        write_report(report, args.out)
    try:
        from bench.plot import plot_cases

        plot_cases(report, output_paths(args.out, report["date"], report["fusion"])[1])
    except Exception as exc:  # matplotlib missing or failing: the json and table stand
        print(f"[bench] plot failed: {exc}", flush=True)
    print(markdown(report))
    return 1 if any(_failed(e) for e in report["results"]) else 0


def _failed(entry: dict) -> bool:
    """An entry that errored, or whose fuser result is wrong or missing."""
    fuser_result = entry.get("impls", {}).get("fuser", {})
    return "error" in entry or "error" in fuser_result or fuser_result.get("correct") is False


if __name__ == "__main__":
    sys.exit(main())
