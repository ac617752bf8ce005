#!/usr/bin/env python
"""Narrow moment storage (`moment_dtype`): the measurements behind codec.py's choices, on CPU.

Two parts, both printed as markdown tables (docs/benchmarks.md holds a copy):

  train  (default) A small transformer LM trained from the same seed with each moment format, its
         optimizer state streamed through the real store (masters + moments on disk). Reports final
         held-out loss, deviation from the fp32 run, bytes streamed per param per step, NaN/Inf.
  study  Moment tracking without a model: the same gradient stream feeds an fp32 Adam and one whose
         moments round-trip through a candidate encoding every step; reports the relative error of the
         update m_hat / (sqrt(v_hat) + eps) against fp32 and its largest element. This is where the
         block size, sqrt-vs-not for exp_avg_sq, and stochastic-vs-nearest rounding were decided.

    python scripts/compare_moment_dtypes.py                  # train, 200 steps (~3 min on 2 cores)
    python scripts/compare_moment_dtypes.py study            # ~4 min
    python scripts/compare_moment_dtypes.py train study --steps 300
    python scripts/compare_moment_dtypes.py device           # codec throughput + streamed steps on CUDA

The study's unscaled fp8 row is a plain round-to-nearest cast with no scale (the seed's fp8; its training
run diverged, docs/benchmarks.md); the ablation rows swap one segment's codec for a same-size variant
after the store is built. Neither is a user-facing option.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam  # noqa: E402
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state  # noqa: E402
from miles_plugins.optimizers.streaming.codec import (  # noqa: E402
    FORMATS, BlockScaledCodec, CastCodec, Fp32Codec)
from miles_plugins.optimizers.streaming.io.stager import as_bytes  # noqa: E402


# ==== part 1: training ==============================================================================
class Data:
    """A synthetic language with structure at three depths: Zipfian unigrams (rare tokens get rare,
    tiny embedding gradients: the regime where unscaled 8-bit exp_avg_sq underflows), a sparse sharp
    bigram table, and with probability 1/4 a copy of the token COPY_LAG positions back (attention has
    to find it). Deterministic from `seed`."""

    COPY_LAG, COPY_P = 12, 0.25

    def __init__(self, vocab=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
        self.unigram = zipf / zipf.sum()
        bias = torch.zeros(vocab, vocab, dtype=torch.float64)
        for row in range(vocab):
            idx = torch.multinomial(self.unigram, 6, generator=g)
            bias[row, idx] = 3.0 * torch.rand(6, generator=g, dtype=torch.float64) + 2.0
        self.bigram = torch.softmax(self.unigram.log()[None, :] + bias, dim=-1)

    def sequences(self, count, seq, seed):
        """`count` sequences of seq + 1 tokens, all sampled at once (one vectorized loop over time)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.empty(count, seq + 1, dtype=torch.long)
        x[:, 0] = torch.multinomial(self.unigram, count, replacement=True, generator=g)
        for t in range(1, seq + 1):
            x[:, t] = torch.multinomial(self.bigram[x[:, t - 1]], 1, generator=g)[:, 0]
            if t >= self.COPY_LAG:
                copy = torch.rand(count, generator=g) < self.COPY_P
                x[:, t] = torch.where(copy, x[:, t - self.COPY_LAG], x[:, t])
        return x


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab, d=64, layers=2, heads=4, seq=32):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(0.02 * torch.randn(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x, y):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1), y.flatten())


def _swap(store, **codecs):
    """Replace segment codecs after construction (ablations only): same file size, before any step."""
    for name, codec in codecs.items():
        old = store.codecs[name]
        assert codec.encoded_nbytes(12345) == old.encoded_nbytes(12345), (name, codec, old)
        store.codecs[name] = codec  # the buckets share this dict


def _ablation(variant):
    f = FORMATS
    if variant == "e4m3-v-as-is":  # exp_avg_sq stored as is, not as its square root
        return {"exp_avg_sq": BlockScaledCodec("fp8e4m3", f["fp8e4m3"], floor_nonzero=True, seed=2)}
    if variant == "e4m3-nearest":  # round-to-nearest instead of stochastic rounding, both moments
        return {"exp_avg": BlockScaledCodec("fp8e4m3", f["fp8e4m3"], stochastic=False),
                "exp_avg_sq": BlockScaledCodec("fp8e4m3", f["fp8e4m3"], sqrt=True, stochastic=False,
                                               floor_nonzero=True)}
    if variant == "bf16-nearest":
        return {"exp_avg": CastCodec("bf16", f["bf16"], stochastic=False),
                "exp_avg_sq": CastCodec("bf16", f["bf16"], stochastic=False)}
    raise KeyError(variant)


# (label, moment_dtype or None for the in-memory optimizer, ablation, init seed)
RUNS = [
    ("fp32, in memory (no store)", None, None, 0),
    ("fp32", "fp32", None, 0),
    ("bf16", "bf16", None, 0),
    ("fp16", "fp16", None, 0),
    ("fp8e4m3", "fp8e4m3", None, 0),
    ("fp8e5m2", "fp8e5m2", None, 0),
    ("ablation: fp8e4m3, exp_avg_sq as is (no sqrt)", "fp8e4m3", "e4m3-v-as-is", 0),
    ("ablation: fp8e4m3, round-to-nearest", "fp8e4m3", "e4m3-nearest", 0),
    ("ablation: bf16, round-to-nearest", "bf16", "bf16-nearest", 0),
    ("noise floor: fp32, another init seed", "fp32", None, 1),
]


def train_one(moment_dtype, ablation, init_seed, steps, args, root):
    torch.manual_seed(1000 + init_seed)
    data = Data(seed=0)
    model = TinyLM(data.vocab, seq=args.seq)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = ShardedMixedPrecisionAdam([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                    lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    store = None
    if moment_dtype is not None:
        store = stream_optimizer_state(opt, dir=root, moment_dtype=moment_dtype, bucket_numel=args.bucket_numel)
        if ablation:
            _swap(store, **_ablation(ablation))
    numel = sum(p.numel() for p in params)
    train, held_out = _batches(data, steps, args)
    losses, bytes_per_param, finite = [], None, True
    for step in range(steps):
        warm = min(1.0, (step + 1) / 20)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * cosine
        x, y = train[step]
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        finite &= math.isfinite(losses[-1])
        if store is not None and step == 2:  # steady state: every segment is read and written
            last = store.stats.last_step
            bytes_per_param = (last.bytes_read / numel, last.bytes_written / numel)
    with torch.no_grad():
        eval_loss = sum(model(x, y).item() for x, y in held_out) / len(held_out)
    finite &= all(torch.isfinite(p).all().item() for p in params)
    if store is not None:
        finite &= _moments_finite(store)
        store.close()
    return {"losses": losses, "eval": eval_loss, "params": [p.detach().clone() for p in params],
            "bytes": bytes_per_param, "finite": finite}


_BATCHES = {}


def _batches(data, steps, args):
    """The same training batches (one per step) and held-out batches for every run."""
    key = (steps, args.batch, args.seq, args.eval_batches)
    if key not in _BATCHES:
        def split(x):
            return [(b[:, :-1], b[:, 1:]) for b in x.split(args.batch)]
        _BATCHES[key] = (split(data.sequences(steps * args.batch, args.seq, seed=1)),
                         split(data.sequences(args.eval_batches * args.batch, args.seq, seed=2)))
    return _BATCHES[key]


def _moments_finite(store):
    ok = True
    for bucket in store.buckets:
        names = bucket.segments_to_fetch()
        bucket.fetch(store.stager, names)
        ok &= all(torch.isfinite(bucket.flat[n]).all().item() for n in names)
        bucket.release()
    return ok


def run_training(args):
    torch.set_num_threads(args.threads)
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as root:
        for label, moment_dtype, ablation, seed in RUNS:
            t0 = time.time()
            results[label] = r = train_one(moment_dtype, ablation, seed, args.steps, args, root)
            print(f"  {label}: eval loss {r['eval']:.4f}, last train loss {r['losses'][-1]:.4f} "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    ref = results["fp32"]
    mem = results["fp32, in memory (no store)"]
    bit_identical = all(torch.equal(a, b) for a, b in zip(ref["params"], mem["params"]))
    lines = [f"Training: TinyLM ({sum(p.numel() for p in ref['params']):,} params, 2 layers, d=64, vocab 256), "
             f"{args.steps} steps, batch {args.batch}x{args.seq}, AdamW lr {args.lr} (warmup 20, cosine to 10%), "
             f"betas (0.9, 0.999), wd 0.1; masters + moments streamed (bucket_numel {args.bucket_numel}). "
             f"fp32 store vs in-memory optimizer bit-identical: {bit_identical}.", "",
             "| moment storage | final eval loss | vs fp32 | max abs(train loss - fp32) over the run | "
             "final max abs(param - fp32) | B/param/step read + written | diverged | NaN/Inf |",
             "|---|---|---|---|---|---|---|---|"]
    for label, _, _, seed in RUNS:
        r = results[label]
        rel = (r["eval"] - ref["eval"]) / ref["eval"] * 100
        dloss = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        dparam = max((a - b).abs().max().item() for a, b in zip(r["params"], ref["params"]))
        dparam = f"{dparam:.2e}" if seed == 0 else "n/a (other init)"
        bpp = f"{r['bytes'][0]:.3f} + {r['bytes'][1]:.3f}" if r["bytes"] else "-"
        diverged = not r["finite"] or r["eval"] > r["losses"][0]  # ends worse than it started
        lines.append(f"| {label} | {r['eval']:.4f} | {rel:+.2f}% | {dloss:.4f} | {dparam} | {bpp} | "
                     f"{'YES' if diverged else 'no'} | {'none' if r['finite'] else 'YES'} |")
    return "\n".join(lines)


# ==== part 2: moment-tracking study =================================================================
def _roundtrip(codec, x):
    if isinstance(codec, Fp32Codec):
        return x.clone()
    raw = torch.cat([as_bytes(e) for e in codec.encode([x])])
    encoded, offset = codec.empty_encoded(x.numel(), x.device), 0
    for part in encoded:
        as_bytes(part).copy_(raw[offset:offset + part.nbytes])
        offset += part.nbytes
    out = torch.empty_like(x)
    codec.decode(encoded, out)
    return out


def _gradients(kind, n, steps, seed=0):
    """rows: a scale per 512-element row (log-uniform 1e-7..1e-1) times a lognormal spread (sigma 1.5)
    inside it, like the rows of a weight matrix. elem: every element its own scale, log-uniform
    1e-8..1 (8 decades inside every block: adversarial). Half way through, 20% of the elements stop
    receiving gradient and 20% get 10x larger ones (v must decay / grow)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "rows":
        scale = (10 ** (torch.rand(n // 512, 1, generator=g) * 6 - 7)).expand(n // 512, 512).reshape(-1)
        scale = scale * torch.exp(1.5 * torch.randn(n, generator=g))
    else:
        scale = 10 ** (torch.rand(n, generator=g) * 8 - 8)
    mean = 0.3 * torch.randn(n, generator=g)
    which = torch.rand(n, generator=g)
    shifted = torch.where(which < 0.2, torch.zeros_like(scale), torch.where(which > 0.8, 10 * scale, scale))
    for t in range(steps):
        yield t, (scale if t < steps // 2 else shifted) * (mean + torch.randn(n, generator=g))


def track(kind, codec_m, codec_v, n, steps, checks=None, b1=0.9, b2=0.999, eps=1e-8):
    """At each step in `checks` (default: the last): relative error of the quantized run's update
    against fp32's, its largest element, and fp32's largest element."""
    checks = set(checks or [steps])
    m_ref, v_ref, m, v = (torch.zeros(n) for _ in range(4))
    out = []
    for t, grad in _gradients(kind, n, steps):
        for mm, vv in ((m_ref, v_ref), (m, v)):
            mm.mul_(b1).add_(grad, alpha=1 - b1)
            vv.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m, v = _roundtrip(codec_m, m), _roundtrip(codec_v, v)
        if t + 1 in checks:
            bc1, bc2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
            u_ref = (m_ref / bc1) / ((v_ref / bc2).sqrt() + eps)
            u = (m / bc1) / ((v / bc2).sqrt() + eps)
            out.append((((u - u_ref).norm() / u_ref.norm()).item(), u.abs().max().item(), u_ref.abs().max().item()))
    return out if len(out) > 1 else out[0]


def _study_configs():
    f = FORMATS

    def blk(fmt, **kw):
        return BlockScaledCodec(fmt, f[fmt], **kw)

    sq = dict(sqrt=True, floor_nonzero=True, seed=2)
    return [
        ("fp8e4m3 unscaled (seed)", CastCodec("u", f["fp8e4m3"], stochastic=False),
         CastCodec("u", f["fp8e4m3"], stochastic=False)),
        ("e4m3 B256 SR, v as is", blk("fp8e4m3"), blk("fp8e4m3", seed=2)),
        ("e4m3 B256 SR, v as is, floor", blk("fp8e4m3"), blk("fp8e4m3", floor_nonzero=True, seed=2)),
        ("e4m3 B256 nearest, sqrt v, floor", blk("fp8e4m3", stochastic=False),
         blk("fp8e4m3", stochastic=False, sqrt=True, floor_nonzero=True)),
        ("e4m3 B256 SR, sqrt v (no floor)", blk("fp8e4m3"), blk("fp8e4m3", sqrt=True, seed=2)),
        ("**e4m3 B256 SR, sqrt v, floor** (fp8e4m3)", blk("fp8e4m3"), blk("fp8e4m3", **sq)),
        ("m fp32, v e4m3 B256 SR sqrt floor", Fp32Codec(), blk("fp8e4m3", **sq)),
        ("m e4m3 B256 SR, v fp32", blk("fp8e4m3"), Fp32Codec()),
        *[(f"e4m3 B{b} SR, sqrt v, floor", blk("fp8e4m3", block_size=b), blk("fp8e4m3", block_size=b, **sq))
          for b in (32, 128, 512, 2048)],
        ("e5m2 B256 nearest, v as is, floor", blk("fp8e5m2", stochastic=False),
         blk("fp8e5m2", stochastic=False, floor_nonzero=True)),
        ("**e5m2 B256 SR, v as is, floor** (fp8e5m2)", blk("fp8e5m2"), blk("fp8e5m2", floor_nonzero=True, seed=2)),
        ("e5m2 B256 SR, sqrt v, floor", blk("fp8e5m2"), blk("fp8e5m2", **sq)),
        ("fp16 B256 nearest, v as is", blk("fp16", stochastic=False), blk("fp16", stochastic=False)),
        ("**fp16 B256 nearest, sqrt v, floor** (fp16)", blk("fp16", stochastic=False),
         blk("fp16", stochastic=False, sqrt=True, floor_nonzero=True)),
        ("fp16 B256 SR, sqrt v, floor", blk("fp16"), blk("fp16", **sq)),
        ("bf16 nearest", CastCodec("b", f["bf16"], stochastic=False), CastCodec("b", f["bf16"], stochastic=False)),
        ("**bf16 SR** (bf16)", CastCodec("b", f["bf16"]), CastCodec("b", f["bf16"], floor_nonzero=True, seed=2)),
    ]


def run_study(args):
    torch.set_num_threads(args.threads)
    n, steps = args.study_numel, args.study_steps
    lines = [f"Moment tracking: {n:,} elements, {steps} Adam steps (betas 0.9/0.999, eps 1e-8), regime change at "
             f"step {steps // 2}. err = norm(u - u_fp32) / norm(u_fp32) of the update at the last step; "
             "max abs(u): the quantized run's largest update element (fp32's in parentheses). Bold: the shipped "
             "encoding.", "",
             "| encoding (m / v) | rows: err | rows: max abs(u) | elem: err | elem: max abs(u) |",
             "|---|---|---|---|---|"]
    for label, cm, cv in _study_configs():
        t0 = time.time()
        cells = []
        for kind in ("rows", "elem"):
            err, umax, uref = track(kind, cm, cv, n, steps)
            cells += [f"{err:.3g}", f"{umax:.3g} ({uref:.2f})"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(f"  {label}: {cells} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    long_steps = args.study_long_steps
    lines += ["", f"Long horizon, 16-bit formats ('rows', {n // 2:,} elements, regime change at step "
              f"{long_steps // 2}): "
              "err at steps 1000 / 2000 / 4000 (nearest rounding lets the bf16 EMA drift; fp16's 10-bit "
              "mantissa does not need stochastic rounding).", "",
              "| encoding | " + " | ".join(f"step {s}" for s in _LONG_CHECKS(long_steps)) + " |",
              "|---|" + "---|" * len(_LONG_CHECKS(long_steps))]
    f = FORMATS
    for label, cm, cv in [
            ("bf16 nearest", CastCodec("b", f["bf16"], stochastic=False), CastCodec("b", f["bf16"], stochastic=False)),
            ("bf16 SR", CastCodec("b", f["bf16"]), CastCodec("b", f["bf16"], floor_nonzero=True, seed=2)),
            ("fp16 B256 nearest, sqrt v", BlockScaledCodec("fp16", f["fp16"], stochastic=False),
             BlockScaledCodec("fp16", f["fp16"], stochastic=False, sqrt=True, floor_nonzero=True)),
            ("fp16 B256 SR, sqrt v", BlockScaledCodec("fp16", f["fp16"]),
             BlockScaledCodec("fp16", f["fp16"], sqrt=True, floor_nonzero=True, seed=2))]:
        errs = [e for e, _, _ in track("rows", cm, cv, n // 2, long_steps, checks=_LONG_CHECKS(long_steps))]
        lines.append(f"| {label} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
        print(f"  long {label}: {errs}", file=sys.stderr, flush=True)
    return "\n".join(lines)


def _LONG_CHECKS(long_steps):
    return [long_steps // 4, long_steps // 2, long_steps]


# ==== part 3: on an accelerator ======================================================================
def run_device(args):
    """Codec throughput on the device and a few streamed steps there (encoded tensors never leave it)."""
    from miles_plugins.optimizers.streaming.codec import make_moment_codecs
    from miles_plugins.optimizers.streaming.config import MOMENT_DTYPES
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    n = args.device_numel
    x = torch.randn(n, device=device) * 1e-3
    lines = [f"Codecs on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}: one segment of "
             f"{n / 1e6:.0f}M elements, best of 5.", "",
             "| moment_dtype | segment | encode ms | decode ms | encode GB/s of fp32 |", "|---|---|---|---|---|"]
    for dtype in MOMENT_DTYPES[1:]:
        for segment, codec in make_moment_codecs(dtype).items():
            v = x.abs() if segment == "exp_avg_sq" else x
            times = {"enc": [], "dec": []}
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                parts = codec.encode([v])
                sync()
                times["enc"].append(time.perf_counter() - t0)
                assert all(p.device == device for p in parts), "encoded bytes must stay on the device"
                encoded, offset = codec.empty_encoded(n, device), 0
                flat = torch.cat([as_bytes(p) for p in parts])
                for part in encoded:
                    as_bytes(part).copy_(flat[offset:offset + part.nbytes])
                    offset += part.nbytes
                out = torch.empty(n, device=device)
                sync()
                t0 = time.perf_counter()
                codec.decode(encoded, out)
                sync()
                times["dec"].append(time.perf_counter() - t0)
                assert torch.isfinite(out).all()
            enc, dec = min(times["enc"]), min(times["dec"])
            lines.append(f"| {dtype} | {segment} | {enc * 1e3:.2f} | {dec * 1e3:.2f} | {4 * n / enc / 1e9:.1f} |")
    sizes = (3_000_001, 1_000_003, 257, 2_000_000)
    lines += ["", f"Streamed AdamW on {device} ({sum(sizes):,} params, gradient scales 1e-8..1 per element, 5 "
              "steps, bucket_numel 1,500,000) vs the same optimizer in memory, distance in units of lr:", "",
              "| moment_dtype | max abs(param - in memory) | rms | B/param/step read | finite |",
              "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as root:
        for dtype in MOMENT_DTYPES:
            g = torch.Generator(device=device).manual_seed(0)
            ref = [torch.nn.Parameter(torch.randn(k, device=device, generator=g)) for k in sizes]
            params = [torch.nn.Parameter(p.detach().clone()) for p in ref]
            opts = [torch.optim.AdamW(ref, lr=1e-3), torch.optim.AdamW(params, lr=1e-3)]
            store = stream_optimizer_state(opts[1], dir=root, moment_dtype=dtype, bucket_numel=1_500_000)
            for _ in range(5):
                grads = [torch.randn(k, device=device, generator=g) * 10 ** torch.empty(k, device=device).uniform_(
                    -8, 0, generator=g) for k in sizes]
                for ps, opt in zip((ref, params), opts):
                    for p, grad in zip(ps, grads):
                        p.grad = grad.clone()
                    opt.step()
            diff = torch.cat([(a - b).view(-1) for a, b in zip(ref, params)]) / 1e-3
            dev, rms = diff.abs().max().item(), diff.pow(2).mean().sqrt().item()
            bpp = store.stats.last_step.bytes_read / sum(sizes)
            ok = all(torch.isfinite(p).all().item() for p in params)
            if dtype == "fp32":
                assert dev == 0.0, "fp32 must be bit-identical"
            store.close()
            lines.append(f"| {dtype} | {dev:.3g} | {rms:.3g} | {bpp:.3f} | {ok} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["train"], choices=["train", "study", "device"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--bucket-numel", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--study-numel", type=int, default=1 << 15)
    ap.add_argument("--study-steps", type=int, default=1000)
    ap.add_argument("--study-long-steps", type=int, default=4000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--device-numel", type=int, default=1 << 26)
    args = ap.parse_args()
    out = []
    if "train" in args.parts:
        out.append(run_training(args))
    if "study" in args.parts:
        out.append(run_study(args))
    if "device" in args.parts:
        out.append(run_device(args))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
