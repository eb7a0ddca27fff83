"""The LM head + loss alone, eager against compiled epilogue (`objective.head`), in the same run.

One forward (which also computes the gradients: train/loss.py) and the backward of `head_loss` over M
labelled positions, for the ce and kl losses. On a CUDA GPU: bf16 hidden states and head, the GPU's
LM-head chunk, Qwen3-8B shapes by default (M = 7,680: 512 anchors x 15 labelled slots; hidden 4096; vocab
151,936). On CPU: fp32, SmolLM2's shapes (M = 2,048, hidden 576, vocab 49,152), chunk 1024. Prints the
time of each, the compiled/eager ratio and the largest difference of the loss and the input gradient.

Usage: python bench/bench_head.py [--m M] [--hidden H] [--vocab V] [--steps 5] [--loss ce kl]
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_train.train.loss import auto_logits_chunk, head_loss


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(m: int, hidden: int, vocab: int, kind: str, steps: int, device: str) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(m, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (m,), generator=g).to(device)
    weights = torch.rand(m, generator=g).to(device)
    target = None
    if kind == "kl":
        target = (torch.randint(0, vocab, (m, 32), generator=g).to(device),
                  torch.softmax(torch.randn(m, 32, generator=g), -1).to(device))
    chunk = auto_logits_chunk(vocab, device)
    out = {}
    for compiled in (False, True):
        def step(compiled=compiled):
            h.grad = None
            loss, _ = head_loss(h, w, labels, weights, kind, target, chunk=chunk, compiled=compiled)
            loss.backward()
            return loss.detach(), h.grad.detach().clone()

        result = step()  # warm-up: compiles, allocator pools
        step()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        out[compiled] = ((time.perf_counter() - t0) / steps, result)
    (t_e, (loss_e, grad_e)), (t_c, (loss_c, grad_c)) = out[False], out[True]
    return {"loss": kind, "eager_ms": t_e * 1e3, "compiled_ms": t_c * 1e3, "ratio": t_c / t_e,
            "loss_rel_diff": float((loss_c - loss_e).abs() / loss_e.abs()),
            "grad_max_diff": float((grad_c.float() - grad_e.float()).abs().max()), "chunk": chunk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss", nargs="+", default=["ce", "kl"], choices=["ce", "kl"])
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, hidden, vocab = (7680, 4096, 151936) if device == "cuda" else (2048, 576, 49152)
    m, hidden, vocab = args.m or m, args.hidden or hidden, args.vocab or vocab
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: M={m}, hidden {hidden}, vocab {vocab}, "
          f"{'bf16' if device == 'cuda' else 'fp32'}, {args.steps} timed steps\n")
    print("| loss | chunk | eager ms | compiled ms | compiled / eager | loss rel. diff | grad max diff |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.loss:
        r = measure(m, hidden, vocab, kind, args.steps, device)
        print(f"| {kind} | {r['chunk']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['ratio']:.2f} | "
              f"{r['loss_rel_diff']:.1e} | {r['grad_max_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
