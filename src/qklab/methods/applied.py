"""What a controller did, per head: the change it applied to each logit-path matrix, kept on the device.

``MeasuredUpdate`` is ``HeadScaledUpdate`` that also keeps, after every ``apply``, each matrix's per-head
sum of squares of the change p_new - p_old it made (optimizer step and rescale together), on the rows held
here (FSDP2 shards: a partial sum). Nothing is read on the host during the step; ``head_norms`` turns the
sums into norms when a controller's ``metrics()`` asks (at the logging cadence), adding the partial sums
over the ranks with the controller's reduce function (every rank calls ``metrics()`` at the same steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qklab.methods.headwise import HeadMatrix, HeadScaledUpdate
from qklab.methods.shards import is_sharded, local_rows


def rows_head_sq(m: HeadMatrix, rows: torch.Tensor) -> torch.Tensor:
    """(n_heads,) sum of squares of ``rows``, laid out as the rows of ``m`` held here (local_rows), per head."""
    rows = rows.detach().float()
    if rows.dim() == 3:  # a (n_heads, rows, C) view (strided head blocks)
        return rows.pow(2).sum(dim=(1, 2))
    _, start = local_rows(m.weight)
    per_head = m.weight.shape[0] // m.n_heads
    head = (torch.arange(rows.shape[0], device=rows.device) + start) // per_head
    return torch.zeros(m.n_heads, device=rows.device).index_add_(0, head, rows.pow(2).sum(dim=1))


class MeasuredUpdate(HeadScaledUpdate):
    def __init__(self, mats: list[HeadMatrix]) -> None:
        super().__init__(mats)
        self.sq: list[torch.Tensor] = []  # per matrix (n_heads,): squared change of the last apply, rows held here

    @torch.no_grad()
    def apply(self, factors: list[torch.Tensor], decay: list[float] | None = None) -> None:
        before = self._before
        super().apply(factors, decay)
        assert before is not None
        self.sq = [rows_head_sq(m, local_rows(m.weight)[0] - old) for m, old in zip(self.mats, before, strict=True)]


def head_norms(sq: list[torch.Tensor], mats: list[HeadMatrix],
               reduce: Callable[[torch.Tensor, str], torch.Tensor] | None) -> list[torch.Tensor]:
    """Per-head norms from per-head sums of squares of the rows held here, summed over the ranks first when
    any matrix is sharded (one all-reduce of them all)."""
    if not sq:
        return []
    packed = torch.cat([s.to(sq[0].device) for s in sq])
    if reduce is not None and any(is_sharded(m.weight) for m in mats):
        packed = reduce(packed.clone(), "sum")
    return list(packed.sqrt().split([len(s) for s in sq]))


def per_layer(prefix: str, values: list[torch.Tensor], names: list[list[str]]) -> dict[str, list[list[float]]]:
    """Flat per-matrix values (in the order of ``names``, layer by layer) as metrics: ``{prefix}_{name}`` ->
    per layer, per head."""
    out: dict[str, list[list[float]]] = {}
    if not values:  # no step applied yet
        return out
    it = iter(values)
    for layer in names:
        for k in layer:
            out.setdefault(f"{prefix}_{k}", []).append(next(it).tolist())
    return out
