"""A small transformer language model trained with DDP over the "mrc" backend.

    torchrun --nproc-per-node 4 examples/ddp_train.py --steps 300
    torchrun --nproc-per-node 4 examples/ddp_train.py --fail-plane 1:0@100   # plane 0 of
                                                    # rank 1 goes down before step 100
    mrc-run -n 4 --fabric routing/4host-4plane.toml -- python examples/ddp_train.py  # fabric

The script is an ordinary DDP script: the only mrc line is `import mrc.torch`, which
registers the backend. The data is generated (a character-level corpus from a tiny
grammar, the same on every machine); everything is seeded, torch runs one thread, so the
same seed gives the same bits: the loss of every step and the final parameter checksum.
mrc reduces every element in rank order whatever paths the packets took, so a run with a
failed plane prints the same numbers as a healthy one.

Rank 0 prints `step N loss L` per step and `params sha256 HEX` at the end; --json writes
the losses, the checksum and the step and communication times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mrc.torch  # noqa: F401 - registers the "mrc" backend

WORDS = {
    "det": ["the", "a", "every", "one"],
    "noun": ["cat", "dog", "bird", "fish", "plane", "spine", "packet", "switch"],
    "verb": ["sees", "chases", "routes", "finds", "sends", "drops"],
    "adj": ["red", "fast", "quiet", "lost", "healthy"],
}


def corpus(n_sentences: int = 4000, seed: int = 1234) -> str:
    """Sentences `det [adj] noun verb det [adj] noun.` from a fixed seed: a learnable LM task."""
    rng = random.Random(seed)

    def phrase() -> str:
        adj = rng.choice(WORDS["adj"]) + " " if rng.random() < 0.5 else ""
        return f"{rng.choice(WORDS['det'])} {adj}{rng.choice(WORDS['noun'])}"

    return " ".join(
        f"{phrase()} {rng.choice(WORDS['verb'])} {phrase()}." for _ in range(n_sentences)
    )


class TinyLM(nn.Module):
    """A 2-layer causal transformer over characters."""

    def __init__(self, vocab: int, seq: int, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def say(line: str) -> None:
    """One write per line: ranks share a pipe under torchrun (unbuffered), and print's two
    writes (text, then newline) from two ranks interleave into one line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def param_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def parse_fail(spec: str) -> tuple[int, int, int]:
    """RANK:PLANE@STEP -> (rank, plane, step)."""
    try:
        who, step = spec.split("@")
        rank, plane = who.split(":")
        return int(rank), int(plane), int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--fail-plane {spec!r}: expected RANK:PLANE@STEP, e.g. 1:0@100"
        ) from None


class CommTimer:
    """A DDP comm hook (the default one's math: divide, then all-reduce) that records when
    each bucket's all-reduce was issued and completed, for the time spent communicating."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    # no annotations on bucket and the result: DDP compares them with dist.GradBucket and
    # Future, and `from __future__ import annotations` turns them into strings
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            self.spans.append((t0, time.perf_counter()))
            return f.value()[0]

        return fut.then(done)

    def take(self) -> float:
        """Seconds covered by at least one all-reduce since the last take (overlaps once)."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.spans):
            if b > end:
                total += b - max(a, end)
                end = b
        self.spans.clear()
        return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="mrc", help="torch.distributed backend (mrc, gloo)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--width", type=int, default=64, help="model width d")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fail-plane",
        type=parse_fail,
        action="append",
        default=[],
        metavar="RANK:PLANE@STEP",
        help="take PLANE of RANK down before STEP (mrc only; repeatable)",
    )
    ap.add_argument("--json", type=Path, help="rank 0 writes losses, checksum and timings here")
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    ap.add_argument(
        "--init-method", default="env://", help="env:// (torchrun, mrc-run) or file://PATH"
    )
    ap.add_argument("--timeout", type=float, help="process group timeout, seconds")
    ap.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"],
        help="where the model and gradients live (cuda: every rank on GPU LOCAL_RANK %% count)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.device == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (torch's deterministic mode)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

    torch.set_num_threads(1)  # one thread: the same reduction order inside every matmul
    torch.use_deterministic_algorithms(True)
    kw: dict[str, object] = {}
    if args.timeout:
        kw["timeout"] = timedelta(seconds=args.timeout)
    if args.init_method != "env://":  # file:// takes the rank and size from the launcher's env
        kw.update(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(args.backend, init_method=args.init_method, **kw)  # type: ignore[arg-type]
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.fail_plane and args.backend != "mrc":
        raise SystemExit("--fail-plane takes an mrc plane down: it needs --backend mrc")

    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.int64).to(args.device)

    torch.manual_seed(args.seed)
    # DDP broadcasts rank 0's weights
    model = DDP(TinyLM(len(chars), args.seq, d=args.width).to(args.device))
    timer = CommTimer()
    model.register_comm_hook(None, timer.hook)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches

    losses: list[float] = []
    step_s: list[float] = []
    comm_s: list[float] = []
    for step in range(args.steps):
        for r, plane, at in args.fail_plane:
            if r == rank and at == step:
                mrc.torch.communicator().endpoint.inject(plane, down=True)
                say(f"rank {rank}: plane {plane} down before step {step}")
        t0 = time.perf_counter()
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts.tolist()])
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, len(chars)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradient buckets here, overlapped
        opt.step()
        # the mean loss over ranks, so every rank prints the same number
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        step_s.append(time.perf_counter() - t0)
        comm_s.append(timer.take())
        losses.append(mean.item())
        if rank == 0 and not args.quiet:
            say(f"step {step} loss {losses[-1]:.6f}")

    sha = param_sha256(model.module)
    say(f"rank {rank} params sha256 {sha}")
    if rank == 0 and args.json:
        args.json.write_text(
            json.dumps(
                {
                    "backend": args.backend,
                    "device": args.device,
                    "world": world,
                    "steps": args.steps,
                    "fail_plane": args.fail_plane,
                    "losses": losses,
                    "loss_bits": [np.float32(v).view(np.uint32).item() for v in losses],
                    "sha256": sha,
                    "step_s": step_s,
                    "comm_s": comm_s,
                    "pid": os.getpid(),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
