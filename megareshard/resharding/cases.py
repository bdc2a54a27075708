"""The paper's benchmark cases as data (MLSys'23 §5.1, Table 2), for tests and benchmarks.

Meshes are `HxD` grids (H hosts x D devices); the source mesh sits on the first hosts
and ranks, the destination on the following ones, so they never overlap.
"""

from __future__ import annotations

from typing import NamedTuple

from .mesh import Mesh
from .spec import ShardingSpec

DEFAULT_SHAPE = (1024, 1024, 512)

# n -> (src hosts, dst hosts, src spec, dst spec, shape); source mesh 1xD for cases 7, 8
_PAPER_CASES: dict[int, tuple[int, int, str, str, tuple[int, ...]]] = {
    1: (2, 2, "S0,R,R", "S0,R,R", DEFAULT_SHAPE),
    2: (2, 2, "R,R,R", "S0,R,R", DEFAULT_SHAPE),
    3: (2, 2, "R,S0,R", "S0,R,R", DEFAULT_SHAPE),
    4: (2, 2, "R,S01,R", "S01,R,R", DEFAULT_SHAPE),
    5: (2, 2, "S1,R,R", "S0,R,R", DEFAULT_SHAPE),
    6: (2, 3, "S0,R,R", "S0,R,R", (3072, 1024, 170)),
    7: (1, 2, "S1,R,R", "R,R,R", DEFAULT_SHAPE),
    8: (1, 3, "S1,R,R", "R,R,R", DEFAULT_SHAPE),
    9: (2, 2, "R,S0,R", "R,R,S0", DEFAULT_SHAPE),
}

PAPER_CASE_IDS = tuple(sorted(_PAPER_CASES))


class Case(NamedTuple):
    shape: tuple[int, ...]
    src_mesh: Mesh
    src_spec: ShardingSpec
    dst_mesh: Mesh
    dst_spec: ShardingSpec


class NamedCase(NamedTuple):
    name: str
    shape: tuple[int, ...]
    src_mesh: Mesh
    src_spec: ShardingSpec
    dst_mesh: Mesh
    dst_spec: ShardingSpec


def _scaled(shape: tuple[int, ...], src: ShardingSpec, dst: ShardingSpec, scale: float) -> tuple[int, ...]:
    """Scale the last dim replicated in both specs, so shard boundaries keep their meaning."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if scale == 1.0:
        return shape
    dims = [d for d in range(len(shape)) if not src.entries[d] and not dst.entries[d]]
    d = dims[-1] if dims else len(shape) - 1
    out = list(shape)
    out[d] = max(1, round(shape[d] * scale))
    return tuple(out)


def paper_case(n: int, scale: float = 1.0, devices_per_host: int = 4) -> Case:
    """Case n (1..9) of the paper's many-to-many benchmark: (shape, src mesh/spec, dst mesh/spec).

    `scale` multiplies the tensor's size (through one dim replicated in both specs);
    `devices_per_host` replaces the paper's 4 GPUs per host.
    """
    if n not in _PAPER_CASES:
        raise ValueError(f"paper case {n} does not exist; cases are {PAPER_CASE_IDS[0]}..{PAPER_CASE_IDS[-1]}")
    src_hosts, dst_hosts, src_txt, dst_txt, shape = _PAPER_CASES[n]
    d = devices_per_host
    src_spec, dst_spec = ShardingSpec.parse(src_txt), ShardingSpec.parse(dst_txt)
    src_mesh = Mesh.grid(src_hosts, d)
    dst_mesh = Mesh.grid(dst_hosts, d, first_rank=src_hosts * d, first_host=src_hosts)
    return Case(_scaled(shape, src_spec, dst_spec, scale), src_mesh, src_spec, dst_mesh, dst_spec)


def one_to_many_cases(scale: float = 1.0, max_devices: int = 4, max_hosts: int = 4,
                      devices_per_host: int = 2) -> list[NamedCase]:
    """Paper §5.1.1: one source device (host 0) sends a 1 GiB fp32 tensor, replicated,
    to 1..max_devices devices of one host, then to 1..max_hosts hosts of
    `devices_per_host` devices each. Names: `intra:1->1xK` and `inter:1->HxD`."""
    shape = (1024, 1024, 256)  # 2^28 fp32 = 1 GiB
    spec = ShardingSpec.parse("R,R,R")
    shp = _scaled(shape, spec, spec, scale)
    src = Mesh.grid(1, 1)
    out = []
    for k in range(1, max_devices + 1):
        out.append(NamedCase(f"intra:1->1x{k}", shp, src, spec, Mesh.grid(1, k, first_rank=1, first_host=1), spec))
    for h in range(1, max_hosts + 1):
        dst = Mesh.grid(h, devices_per_host, first_rank=1, first_host=1)
        out.append(NamedCase(f"inter:1->{h}x{devices_per_host}", shp, src, spec, dst, spec))
    return out
