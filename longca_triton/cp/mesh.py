"""Process-group layout of the CP schemes.

Ranks of the CP group are arranged as ``[O, W, U]`` (row-major, Ulysses innermost, so that
Ulysses groups and inner-ring windows sit on neighbouring ranks, i.e. inside a node):

* ``U``  Ulysses (head-parallel) degree;
* ``W``  inner ring (LoongTrain's window) size;
* ``O``  outer ring size (windows).

Scheme by scheme: ``ulysses`` = ``(1, 1, N)``; ``ring_p2p``, ``ring_allgather`` and ``group_cast`` = ``(1, N, 1)``;
``usp`` = ``(1, N / U, U)`` (a 2-D ``ring x ulysses`` mesh); ``loongtrain`` = ``(N / (U W), W, U)``.
The groups come from a ``DeviceMesh`` (``torch.distributed.device_mesh``) when the CP group is
the default group, otherwise from ``new_group`` over the CP group's ranks. Separate groups for the
inner and outer rings give them separate communicators, so their transfers overlap.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

SCHEMES = ("ulysses", "ring_p2p", "ring_allgather", "usp", "loongtrain", "group_cast")

__all__ = ["resolve_dims", "CPMesh", "get_mesh"]


def _square_divisor(n: int, ok=lambda d: True) -> int:
    """Largest divisor ``d`` of ``n`` with ``d * d <= n`` and ``ok(d)``."""
    best = 1
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0 and ok(d):
            best = d
    return best


def resolve_dims(scheme: str, world: int, heads_q: int, ulysses_degree: int | None = None, window: int | None = None) -> tuple[int, int, int]:
    """``(U, W, O)`` for a scheme (defaults: usp takes the most square ``U <= R``; loongtrain
    ``U = 1`` and the most square window ``W <= O``). Raises ``ValueError`` on sizes that do not divide."""
    N = int(world)
    if scheme in ("ring_p2p", "ring_allgather", "group_cast"):
        if ulysses_degree not in (None, 1):
            raise ValueError(f"{scheme} has no Ulysses dimension (ulysses_degree must be 1)")
        return 1, N, 1
    if scheme == "ulysses":
        if ulysses_degree not in (None, N):
            raise ValueError(f"ulysses uses the whole group as its degree ({N}); use usp for a 2-D layout")
        U = N
        W = O = 1
    elif scheme == "usp":
        U = ulysses_degree if ulysses_degree is not None else _square_divisor(N, lambda d: heads_q % d == 0)
        if U < 1 or N % U:
            raise ValueError(f"usp: ulysses_degree {U} must divide the world size {N}")
        W, O = N // U, 1
    elif scheme == "loongtrain":
        U = ulysses_degree if ulysses_degree is not None else 1
        if U < 1 or N % U:
            raise ValueError(f"loongtrain: ulysses_degree {U} must divide the world size {N}")
        R = N // U
        W = window if window is not None else _square_divisor(R)
        if W < 1 or R % W:
            raise ValueError(f"loongtrain: window {W} must divide the ring size {R} (= world {N} / ulysses {U})")
        O = R // W
    else:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    if heads_q % U:
        raise ValueError(
            f"{scheme}: the {heads_q} query heads do not divide over the Ulysses degree {U}; "
            f"choose a degree that divides the heads (or a ring scheme)"
        )
    return U, W, O


class CPMesh:
    """Coordinates and groups of this rank in the ``[O, W, U]`` layout."""

    def __init__(self, group, U: int, W: int, O: int):
        self.group = group
        self.size = dist.get_world_size(group)
        if U * W * O != self.size:
            raise ValueError(f"mesh {O}x{W}x{U} does not match the group of {self.size} ranks")
        self.U, self.W, self.O = U, W, O
        self.rank = dist.get_rank(group)
        self.o, rem = divmod(self.rank, W * U)
        self.w, self.u = divmod(rem, U)
        ranks = list(range(self.size)) if group is None else dist.get_process_group_ranks(group)
        grid = torch.tensor(ranks).view(O, W, U)
        self.device_mesh = None
        if group is None or self.size == dist.get_world_size():
            from torch.distributed.device_mesh import DeviceMesh

            backend = dist.get_backend(group)
            device = "cuda" if backend == "nccl" else "cpu"
            self.device_mesh = DeviceMesh(device, grid, mesh_dim_names=("outer", "inner", "ulysses"))
            self.outer_group = self.device_mesh.get_group("outer")
            self.inner_group = self.device_mesh.get_group("inner")
            self.ulysses_group = self.device_mesh.get_group("ulysses")
        else:
            self.outer_group = self._subgroup(grid[:, self.w, self.u])
            self.inner_group = self._subgroup(grid[self.o, :, self.u])
            self.ulysses_group = self._subgroup(grid[self.o, self.w, :])

    @staticmethod
    def _subgroup(ranks: torch.Tensor):
        return dist.new_group(ranks.tolist(), use_local_synchronization=True)

    def ring_position(self, o: int, w: int) -> int:
        return o * self.W + w

    def shard_ranks(self, o: int, w: int) -> tuple[int, ...]:
        """Group ranks whose local tokens form the super-shard of ring member ``(o, w)``."""
        base = (o * self.W + w) * self.U
        return tuple(range(base, base + self.U))


_MESHES: dict = {}


def get_mesh(group, U: int, W: int, O: int) -> CPMesh:
    """A cached :class:`CPMesh` (built once per group and shape; every rank must ask in the same order)."""
    key = (id(group) if group is not None else None, U, W, O)
    if key not in _MESHES:
        _MESHES[key] = CPMesh(group, U, W, O)
    return _MESHES[key]
