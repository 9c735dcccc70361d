"""The model a training benchmark trains: a GPT with AdamW, sharded with FSDP2 over every rank
under torchrun (``fully_shard`` per block and on the whole model, on a mesh of every rank)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    """Pre-norm transformer block: causal SDPA attention and a 4x GELU MLP, no biases."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, LM head tied to the embedding."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.embed.weight)


def training_mesh(device: str, world: int) -> DeviceMesh:
    """The mesh FSDP2 shards over: every rank. On GPUs that is the default group's (its NCCL
    part); on CPU a gloo group of its own, which keeps the training's collectives apart from
    those a checkpoint runs on the default group (gloo) in the background, as NCCL does."""
    if device == "cuda":
        return init_device_mesh(device, (world,))
    return DeviceMesh.from_group(dist.new_group(backend="gloo"), device)


class Trainer:
    """The model and its optimizer on ``device`` (``"cuda"``: the current GPU), sharded over
    ``world`` ranks with FSDP2 when there are several; ``step`` trains on a random batch."""

    def __init__(self, args: argparse.Namespace, device: str, world: int = 1) -> None:
        self.args, self.device = args, device
        torch.manual_seed(0)  # the same weights on every rank before sharding
        with torch.device(device):  # initialise on the GPU: 1B parameters are slow on CPU
            self.model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
        if not args.fp32:
            self.model.to(torch.bfloat16)
        if world > 1:
            mesh = training_mesh(device, world)
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        cuda = device == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda or None)
        self.n_params = sum(p.numel() for p in self.model.parameters())  # DTensors: global

    def step(self, before_step=None) -> None:
        a = self.args
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=self.device)
        with torch.autocast(self.device, torch.bfloat16, enabled=a.fp32 and self.device == "cuda"):
            logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if before_step is not None:
            before_step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self, step: int) -> dict:
        """What a checkpoint holds, as users build it: ``get_state_dict``'s model and optimizer
        state dicts (DTensors under FSDP2) and the step."""
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "step": step}
