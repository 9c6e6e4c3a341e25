"""Permute copies between kernels, by a kernel of fuser's own: a user's permute, and the moves
fuser/reorder.py makes (BatchNorm over NCHW as rows of one channel, a mean over a sequence
as rows along it).

PyTorch's and CuPy's copies of a permuted view index every element through its strides and
read or write across rows: on the H200 a transposing copy of [8, 1024, 4096] bf16 ([0, 2, 1],
64 MB) took 222 us (0.6 TB/s) and a copy of [32, 64, 3136] in runs of 3136 ([1, 0, 2]) ran at
1.5 TB/s, where a plain copy of the same bytes runs at 3-4 TB/s. A permute here first merges
the axes that stay neighbours (and drops those of extent 1), then takes one of two forms:

- runs: the input's innermost axis stays the output's innermost, so each output run is a
  run of the input: threads copy words of up to 16 bytes (the widest the run's length and the
  input's alignment allow), the run's input offset from its index by constant divisions;
- tiles: the innermost axis moves, so a block reads a tile along the input's innermost
  axis, stages it in shared memory (its plan: smem.py) and writes it along the output's
  innermost, each side in whole sectors. Where both extents are multiples of a 16-byte word
  and the input is 16-byte aligned (1-, 2- and 4-byte elements), a thread reads 16-byte
  words of 4 / itemsize neighbouring rows, transposes them in registers into 4-byte words of
  that many elements along the output's innermost axis, and the block writes the tile in
  16-byte words too (tiles of 8 words a side, the staged tile swizzled so that neither side
  conflicts on banks); otherwise 64 x 64 tiles move elements, or 2-byte elements in pairs
  where both extents are even.

On the H200 (bench/permute.py, bench/results/2026-12-03-permute.json) runs copy at 0.89-0.96
of a plain copy of the same bytes and tiles at 0.52-0.64, where PyTorch's copies of the same
views ran at 0.15-0.50. The extents are compile-time constants, so every division by an
extent is a multiply and a shift; each new merged shape compiles once (30-140 ms of NVRTC
offline) and is kept in the kernel cache on disk. The kernel copies bits: one kernel per
element size, whatever the dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from fuser.compile import CompiledModule, template_dir
from fuser.device import DeviceSpec
from fuser.driver import driver
from fuser.launch import POINTER, EntryLauncher
from fuser.loader import check_static_smem
from fuser.once import OncePerKey
from fuser.smem import SmemPlan

if TYPE_CHECKING:
    from fuser.cache import KernelCache

# Elements on a side of a tile: 64 x 64, a warp's row of 2-byte pairs (128 bytes). Element by
# element, a transposing copy of [8, 1024, 4096] bf16 ran at 1.5 TB/s on the H200 in tiles of
# 32 x 32 and of 64 x 64 alike, fp32 at 2.5 TB/s: bound by the accesses, 64 bytes a warp.
TILE = 64
TILE_PITCH = TILE + 1  # staged elements a tile row takes (+1 column against bank conflicts)
TILE_COLUMNS, TILE_ROWS = 32, 8  # a block's threads: a warp along a tile's row, 8 rows apart
# Tiles of 16-byte words: a tile's row is WIDE_LANES words (128 bytes, one sector run a side),
# staged as STAGED_ROW words of STAGED_BYTES; a thread per word lane and staged column reads
# the input, so each thread's rows (4 / itemsize of them) and the columns cover the tile.
WORD_BYTES = 16
WIDE_LANES = 8
STAGED_BYTES = 4
STAGED_ROW = WIDE_LANES * WORD_BYTES // STAGED_BYTES
WIDE_THREADS = WIDE_LANES * STAGED_ROW
RUN_THREADS = 256
RUN_UNROLL = 4  # words in flight per thread
MAX_GRID = 2**31 - 1
_WORDS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long",
          16: "uint4"}


@dataclass(frozen=True)
class PermutePlan:
    """One permute copy: the input's axes merged (`shape`, contiguous), the output's axes as
    input axes (`dims`), the element size, the form and the word a run copies."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]
    itemsize: int
    vector: int  # elements per word a thread moves (tiles: a 16-byte word, a pair or one)

    @property
    def form(self) -> str:
        return "runs" if self.dims[-1] == len(self.shape) - 1 else "tiles"

    @property
    def wide(self) -> bool:
        """Tiles moved in 16-byte words on both sides."""
        return self.form == "tiles" and self.vector * self.itemsize == WORD_BYTES

    @property
    def tile(self) -> int:
        """Elements on a side of a tile."""
        return WIDE_LANES * self.vector if self.wide else TILE

    @property
    def pack(self) -> int:
        """Elements of neighbouring input rows a wide tile's 4-byte staged word holds."""
        return STAGED_BYTES // self.itemsize

    @property
    def total(self) -> int:
        return math.prod(self.shape)

    @property
    def run(self) -> int:
        """Elements in a run of the output that is a run of the input (the innermost
        extent), where the form is runs."""
        return self.shape[-1]

    @property
    def strides(self) -> tuple[int, ...]:
        """Elements between neighbours along each input axis."""
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

    @property
    def out_strides(self) -> tuple[int, ...]:
        """Elements between neighbours along each input axis, in the output."""
        out_shape = [self.shape[d] for d in self.dims]
        by_position = [math.prod(out_shape[j + 1:]) for j in range(len(out_shape))]
        return tuple(by_position[self.dims.index(i)] for i in range(len(self.shape)))

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1]

    @property
    def block(self) -> tuple[int, int]:
        if self.form == "runs":
            return (RUN_THREADS, 1)
        return (WIDE_THREADS, 1) if self.wide else (TILE_COLUMNS, TILE_ROWS)

    @property
    def tiles(self) -> tuple[int, int, int]:
        """Tiles along the output's innermost axis, along the input's, and in all."""
        a, b = self.shape[self.dims[-1]], self.shape[-1]
        batch = self.total // (a * b)
        along_a, along_b = -(-a // self.tile), -(-b // self.tile)
        return along_a, along_b, batch * along_a * along_b

    @property
    def grid(self) -> int:
        if self.form == "runs":
            words = self.total // self.vector
            return max(min(-(-words // (RUN_THREADS * RUN_UNROLL)), MAX_GRID), 1)
        return max(min(self.tiles[2], MAX_GRID), 1)

    @property
    def staged_bytes(self) -> int:
        """Bytes of a tile's element in shared memory: 4-byte words at least, so that a
        column of the tile (TILE_PITCH apart) falls in distinct banks."""
        return max(self.itemsize, 4)

    def smem(self, limit: int) -> SmemPlan:
        if self.form == "runs":
            return SmemPlan.build([], limit)
        if self.wide:
            return SmemPlan.build([("s_tile", self.tile * STAGED_ROW * STAGED_BYTES,
                                    f"a {self.tile} x {self.tile} tile, transposed and swizzled")],
                                  limit)
        return SmemPlan.build([("s_tile", TILE * TILE_PITCH * self.staged_bytes,
                                f"a {TILE} x {TILE} tile (+1 column against bank conflicts)")],
                              limit)

    def describe(self) -> str:
        if self.form == "runs":
            return (f"runs of {self.run} elements in {self.vector * self.itemsize}-byte words "
                    f"({self.grid} blocks of {RUN_THREADS} threads)")
        words = f"{self.vector * self.itemsize}-byte words"
        x, y = self.block
        threads = f"{x} threads" if y == 1 else f"{x} x {y} threads"
        return (f"tiles of {self.tile} x {self.tile} through shared memory in {words} "
                f"({self.tiles[2]} tiles, blocks of {threads})")


def merged(shape: tuple[int, ...], dims: tuple[int, ...]
           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`shape` and `dims` with the axes of extent 1 dropped and the input axes that stay
    neighbours in the output merged: the same copy over the fewest axes ((1,), (0,) where
    every extent is 1)."""
    kept = [d for d in range(len(shape)) if shape[d] != 1]
    if not kept:
        return (1,), (0,)
    rank = {d: i for i, d in enumerate(kept)}
    groups: list[list[int]] = []
    for d in dims:
        if shape[d] == 1:
            continue
        if groups and rank[d] == rank[groups[-1][-1]] + 1:
            groups[-1].append(d)
        else:
            groups.append([d])
    by_input = sorted(range(len(groups)), key=lambda g: rank[groups[g][0]])
    position = {g: i for i, g in enumerate(by_input)}
    return (tuple(math.prod(shape[d] for d in groups[g]) for g in by_input),
            tuple(position[g] for g in range(len(groups))))


@cache
def plan(shape: tuple[int, ...], dims: tuple[int, ...], itemsize: int, align: int
         ) -> PermutePlan:
    """The copy of a contiguous array of `shape` and `itemsize`-byte elements into the order
    `dims` (numpy's transpose axes), its input at an address that is a multiple of `align`."""
    shape, dims = merged(shape, dims)
    vector = 1
    if dims[-1] == len(shape) - 1:
        while (vector * 2 * itemsize <= WORD_BYTES and shape[-1] % (vector * 2) == 0
               and align % (vector * 2 * itemsize) == 0):
            vector *= 2
    elif _wide_tiles(shape, dims, itemsize, align):
        vector = WORD_BYTES // itemsize
    elif itemsize == 2 and shape[-1] % 2 == 0 and shape[dims[-1]] % 2 == 0 and align % 4 == 0:
        vector = 2  # pairs along both tile axes: 4-byte accesses, a warp's row of 128 bytes
    return PermutePlan(shape, dims, itemsize, vector)


def _wide_tiles(shape: tuple[int, ...], dims: tuple[int, ...], itemsize: int, align: int
                ) -> bool:
    """Whether a transposing copy moves 16-byte words on both sides: elements of at most 4
    bytes (staged in 4-byte words), both tile axes' extents whole words (every word of an
    edge tile is in or out), the input at a word's address (the output is new memory)."""
    word = WORD_BYTES // itemsize
    return (itemsize <= STAGED_BYTES and align % WORD_BYTES == 0 and shape[-1] % word == 0
            and shape[dims[-1]] % word == 0)


def entry_name(p: PermutePlan) -> str:
    """The kernel's name: its form, merged shape, order and element size (and _w16 for tiles
    of 16-byte words)."""
    shape, dims = "x".join(map(str, p.shape)), "".join(map(str, p.dims))
    return f"permute_{p.form}_{shape}_{dims}_{p.itemsize}" + ("_w16" if p.wide else "")


def render(p: PermutePlan, limit: int) -> str:
    """The CUDA source of `p`'s kernel (deterministic: the plan and the templates decide it).
    Jinja and codegen load here, not with `import fuser` (tests/test_packaging.py)."""
    from fuser.codegen import render_template, templates_hash

    smem = p.smem(limit)
    header = [f"fuser permute kernel (templates {templates_hash()})",
              f"input [{', '.join(map(str, p.shape))}] (axes merged), output axes "
              f"{list(p.dims)}, {p.itemsize}-byte elements: {p.describe()}"]
    if p.form == "tiles":
        header += ["shared memory plan:", *smem.table().splitlines()]
    wide = p.total >= 2**30  # 32-bit indices leave room for a grid-stride step past the end
    context: dict = {"header": header, "p": p, "entry": entry_name(p), "tile": TILE,
                     "tile_rows": TILE_ROWS, "tile_columns": TILE_COLUMNS,
                     "per_thread": TILE * TILE // (TILE_COLUMNS * TILE_ROWS), "pitch": TILE_PITCH,
                     "index": "long long" if wide else "int", "suffix": "LL" if wide else ""}
    strides, out_strides = p.strides, p.out_strides
    if p.form == "runs":
        words = p.vector * p.itemsize
        context.update(
            word=_WORDS[words], unroll=RUN_UNROLL, words=p.total // p.vector,
            run_words=p.run // p.vector,
            run_axes=[{"axis": a, "extent": p.shape[a], "stride": strides[a] // p.vector}
                      for a in reversed(p.dims[:-1])])
    else:
        a, b = p.dims[-1], len(p.shape) - 1
        along_a, along_b, tiles = p.tiles
        context.update(
            a_axis=a, b_axis=b, a_extent=p.shape[a], b_extent=p.shape[b], tiles_a=along_a,
            tiles_b=along_b, tiles=tiles, a_stride=strides[a], b_out_stride=out_strides[b],
            tile_offset=smem.offset("s_tile"), bits=8 * p.itemsize,
            mask=f"{(1 << 8 * p.itemsize) - 1}u",
            batch_axes=[{"axis": i, "extent": p.shape[i], "stride": strides[i],
                         "out_stride": out_strides[i]}
                        for i in reversed(range(len(p.shape))) if i not in (a, b)])
    if p.wide:
        context.update(
            tile=p.tile, vector=p.vector, pack=p.pack, lanes=WIDE_LANES,
            staged_row=STAGED_ROW, staged_per_word=WORD_BYTES // STAGED_BYTES,
            rows_per_round=WIDE_THREADS // WIDE_LANES,
            rounds=p.tile * WIDE_LANES // WIDE_THREADS)
    elif p.form == "tiles":
        context.update(
            word=_WORDS[p.itemsize], pack=p.vector, packed=_WORDS[p.vector * p.itemsize],
            words_across=TILE // p.vector, staged=_WORDS[p.staged_bytes])
    return render_template("permute.cu.j2", context)


def compiled(p: PermutePlan, spec: DeviceSpec, cache: KernelCache | None = None
             ) -> tuple[str, CompiledModule]:
    """`p`'s source for `spec` and its module, from the kernel cache (`cache`, else the
    process's) or NVRTC: what a launch loads and what explain() shows."""
    from fuser.cache import default_cache

    source = render(p, spec.smem_per_block_optin)
    return source, (cache or default_cache()).get_or_compile(
        source, entry_name(p), spec.arch, (str(template_dir()),))


@dataclass(frozen=True, eq=False)
class PermuteKernel:
    """A loaded permute kernel: its plan, source, launcher and launch sizes (one per plan and
    device in a process, so compared by identity)."""

    plan: PermutePlan
    source: str
    launcher: EntryLauncher
    dynamic_smem: int
    grid: int  # the plan's, computed once
    block: tuple[int, int]


_loaded: OncePerKey[PermuteKernel] = OncePerKey()


def kernel(p: PermutePlan, device_id: int) -> PermuteKernel:
    """`p`'s kernel, compiled (or read from the kernel cache) and loaded into device
    `device_id`'s primary context once per process."""
    return _loaded.get((p, device_id), lambda: _load(p, device_id))


def _load(p: PermutePlan, device_id: int) -> PermuteKernel:
    spec = DeviceSpec.from_gpu(device_id)
    smem = p.smem(spec.smem_per_block_optin)
    source, module_image = compiled(p, spec)
    entry = entry_name(p)
    gpu = driver()
    with gpu.on_device(device_id):
        module = gpu.load_module(module_image.cubin, f"the permute kernel {entry}")
        fn = gpu.function(module, entry)
        check_static_smem(entry, fn, smem, spec)
        fn = gpu.allow_dynamic_smem(fn, smem.dynamic_bytes)
    return PermuteKernel(p, source, EntryLauncher(entry, fn.handle, [POINTER, POINTER],
                                                  fn.num_regs),
                         smem.dynamic_bytes, p.grid, p.block)


def launch(k: PermuteKernel, source: int, destination: int, stream: int) -> None:
    """Copy the array at `source` into `destination` in `k`'s order, on `stream`."""
    k.launcher(k.grid, k.block, k.dynamic_smem, stream, (source, destination))
