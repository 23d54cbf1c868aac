"""FLoRA (Wang, Shen, He, Sun, Wang, Lyu, Li, NeurIPS 2024): stack the clients' adapters; docs/algorithms.md (28.2)."""

from __future__ import annotations

import math

import torch

from .base import LayerUpdate, LoRAAggregation


class Stacked(LoRAAggregation):
    """B_s = [B_1 ... B_n], A_s = [w_1 A_1; ...; w_n A_n], so B_s A_s = sum_i w_i B_i A_i exactly (28.2) at
    any ranks; B_s A_s is folded into W0 and the adapter starts afresh (A random as peft draws it, B = 0),
    so the server holds one adapter and the base, never a stack that grows with the rounds."""

    name = "stacked"
    folds = True

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        b_stack = torch.cat(list(b), dim=1)
        a_stack = torch.cat([float(wi) * ai for ai, wi in zip(a, w)])
        fresh_a = torch.empty(ctx.rank, a[0].shape[1], dtype=a[0].dtype)
        torch.nn.init.kaiming_uniform_(fresh_a, a=math.sqrt(5), generator=ctx.generator)  # peft's init of A
        return LayerUpdate(a=fresh_a.to(a[0].device), b=b[0].new_zeros(b[0].shape[0], ctx.rank), fold=b_stack @ a_stack)
