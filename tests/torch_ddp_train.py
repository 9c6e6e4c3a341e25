"""A small decoder-only transformer, and its training under torch.distributed with fuser.torch.

    torchrun --standalone --nproc-per-node 2 tests/torch_ddp_train.py

trains the model with every norm swapped by fuser.torch.patch, on a global batch split over
the ranks, under DistributedDataParallel and then under FSDP2 (fully_shard per block and at
the root), and each against a single-GPU run of the same model on the whole global batch. In
float32 with SGD, so that what differs is the order of sums only: the per-step global losses
and every parameter at the end must agree within TOLERANCE (relative). Rank 0 prints one JSON
line ({"mode": {"loss": ..., "params": ...}}, the largest relative differences); the exit
status is 1 on a mismatch. tests/test_gpu_torch.py runs it, and uses the model and data below
for its own training tests (LlamaRMSNorm is written as Hugging Face writes it, so that patch
has its three kinds of norm to swap: that one, torch.nn.RMSNorm and torch.nn.LayerNorm).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, FFN, LAYERS, SEQ = 256, 128, 4, 352, 2, 64
STEPS, GLOBAL_BATCH, LR = 10, 8, 0.1
TOLERANCE = 1e-4


class LlamaRMSNorm(nn.Module):
    """Hugging Face transformers' LlamaRMSNorm, as written there."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Block(nn.Module):
    """Pre-norm attention (causal, SDPA) and a SwiGLU MLP, each with a residual."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(DIM, eps=1e-6)
        self.gate_up = nn.Linear(DIM, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, h):
        batch, seq, _ = h.shape
        q, k, v = self.qkv(self.input_layernorm(h)).view(batch, seq, 3, HEADS, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        h = h + self.o_proj(a.transpose(1, 2).reshape(batch, seq, DIM))
        gate, up = self.gate_up(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_model(device, dtype=torch.float32, seed=0) -> TinyLlama:
    """The model, the same for a seed; its norms' weights away from 1 (a weight of ones
    would hide a wrong weight gradient)."""
    torch.manual_seed(seed)
    model = TinyLlama()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.uniform_(-0.2, 0.2)
    return model.to(device=device, dtype=dtype)


def batches(steps: int, batch: int, device, seed=1) -> list[torch.Tensor]:
    """Token batches [batch, SEQ + 1] drawn from a few sequences, so that the loss falls."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, VOCAB, (2 * batch, SEQ + 1), generator=generator)
    picks = [torch.randint(0, 2 * batch, (batch,), generator=generator) for _ in range(steps)]
    return [pool[p].to(device) for p in picks]


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    logits = getattr(logits, "logits", logits)  # a Hugging Face model's output
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def train(model, data: list[torch.Tensor], optimizer) -> list[torch.Tensor]:
    """One optimizer step per batch; the losses, detached (no host synchronization)."""
    losses = []
    for tokens in data:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _distributed(mode: str, device, shards: list[torch.Tensor]):
    """Train a patched model under DDP or FSDP2 on this rank's shard; (losses, parameters)."""
    import fuser.torch

    model = make_model(device)
    replaced = fuser.torch.patch(model)
    assert len(replaced) == 2 * LAYERS + 1, [r.name for r in replaced]
    if mode == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, device_ids=[device])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    losses = train(wrapped, shards, torch.optim.SGD(model.parameters(), lr=LR))
    global_losses = torch.stack(losses)
    torch.distributed.all_reduce(global_losses, op=torch.distributed.ReduceOp.AVG)
    return global_losses, {name: _full(p.detach()) for name, p in model.named_parameters()}


def main() -> int:
    import fuser.torch

    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    data = batches(STEPS, GLOBAL_BATCH, device)
    shards = [tokens.chunk(world)[rank] for tokens in data]
    reference = make_model(device)
    fuser.torch.patch(reference)
    ref_losses = torch.stack(train(reference, data, torch.optim.SGD(reference.parameters(),
                                                                   lr=LR)))
    ref_params = dict(reference.named_parameters())
    report = {}
    for mode in ("ddp", "fsdp2"):
        losses, params = _distributed(mode, device, shards)
        report[mode] = {"loss": _relative(losses, ref_losses),
                        "params": max(_relative(p, ref_params[n].detach())
                                      for n, p in params.items())}
    if rank == 0:
        print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()
    return int(any(v > TOLERANCE for r in report.values() for v in r.values()))


if __name__ == "__main__":
    sys.exit(main())
