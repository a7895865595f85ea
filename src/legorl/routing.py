"""Mixture-of-experts routing as recorded beside the Turns: the top-k expert ids each MoE layer
chose for each token, in a compact binary sidecar per session, referenced and checksummed from
the records that use it.

    from legorl.routing import RoutingWriter, read_chunk
    with RoutingWriter("runs/turns/sess-1.routing", layout) as w:
        ref = w.append(rows, start=17)        # rows: uint8/uint16 array [n, layers, k]
    rows = read_chunk("runs/turns/sess-1.routing", ref.row, ref.rows, ref.sha256, layout)

A sidecar is a 16-byte header then rows, appended and never rewritten:

    bytes 0-7    b"LGRROUT1"       magic and format version
    bytes 8-9    layers            MoE layers, in model order (uint16, little-endian)
    byte  10     k                 experts chosen per token and layer
    byte  11     width             bytes per expert id: 1 (uint8) or 2 (uint16, > 256 experts)
    bytes 12-15  experts           experts per layer (uint32)
    then         rows              [n, layers, k] expert ids, row p = one token position

A Turn's ``routing`` (``records.RoutingRef``) names its sidecar (relative to the Turn file),
the rows it appended and the position of its first row in the call's tokens, and the SHA-256
of exactly those rows' bytes. A Sample's ``routing`` (``records.RoutingSpan`` list) places parts
of such chunks at positions of its ``input_ids``. At the paper's scale (48 layers, top-8) a row
is 384 bytes; here it is ``layers * k`` bytes. Numpy is imported inside the functions.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from legorl.records import Sample

MAGIC = b"LGRROUT1"
HEADER = struct.Struct("<8sHBBI")  # 16 bytes
SUFFIX = ".routing"


class RoutingError(ValueError):
    """A sidecar is missing, corrupt or does not fit the model; the message names the file."""


@dataclass(frozen=True, slots=True)
class RoutingLayout:
    """What one row of routing holds: ``layers`` MoE layers × ``k`` ids among ``experts``."""

    layers: int
    k: int
    experts: int

    @property
    def width(self) -> int:
        return 1 if self.experts <= 256 else 2

    @property
    def row_bytes(self) -> int:
        return self.layers * self.k * self.width

    def dtype(self) -> Any:
        import numpy as np

        return np.uint8 if self.width == 1 else np.uint16

    def describe(self) -> str:
        return f"{self.layers} layers x top-{self.k} of {self.experts} experts"


def router_modules(model: Any) -> list[Any]:
    """The MoE router of each sparse layer of ``model``, in layer order; [] for a dense model.

    A router is a module with ``top_k`` and ``num_experts`` whose forward returns
    ``(router_logits, scores, indices)``: transformers' ``*TopKRouter`` (Qwen3-MoE, Qwen2-MoE,
    OLMoE, …). Other MoE layouts are not recognised, and so count as dense here."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter")
        and hasattr(m, "top_k")
        and hasattr(m, "num_experts")
    ]


def layout_of(model: Any) -> RoutingLayout | None:
    """The routing layout of ``model``'s MoE layers, or None for a dense model."""
    routers = router_modules(model)
    if not routers:
        return None
    ks = {int(r.top_k) for r in routers}
    es = {int(r.num_experts) for r in routers}
    if len(ks) != 1 or len(es) != 1:
        raise RoutingError(f"MoE layers differ in top-k {sorted(ks)} or experts {sorted(es)}")
    return RoutingLayout(len(routers), ks.pop(), es.pop())


def checksum(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def read_layout(path: str | os.PathLike[str]) -> RoutingLayout:
    """The header of the sidecar at ``path``."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(HEADER.size)
    except FileNotFoundError:
        raise RoutingError(f"{path}: routing sidecar not found") from None
    except OSError as exc:
        raise RoutingError(f"{path}: cannot read routing sidecar: {exc}") from None
    if len(head) < HEADER.size:
        raise RoutingError(f"{path}: routing sidecar is shorter than its header")
    magic, layers, k, width, experts = HEADER.unpack(head)
    if magic != MAGIC:
        raise RoutingError(f"{path}: not a legorl routing sidecar (magic {magic!r})")
    layout = RoutingLayout(layers, k, experts)
    if width != layout.width or layers < 1 or k < 1 or experts < k:
        raise RoutingError(f"{path}: bad header ({layers} layers, k {k}, {experts} experts)")
    return layout


def read_chunk(
    path: str | os.PathLike[str],
    row: int,
    rows: int,
    sha256: str,
    expect: RoutingLayout | None = None,
) -> np.ndarray:
    """Rows ``row .. row + rows`` of a sidecar as ``[rows, layers, k]``, after checking its
    header (against ``expect`` when given), its length and the chunk's checksum."""
    import numpy as np

    path = Path(path)
    layout = read_layout(path)
    if expect is not None and layout != expect:
        raise RoutingError(
            f"{path}: routing of {layout.describe()}, but the model has {expect.describe()}"
        )
    start = HEADER.size + row * layout.row_bytes
    size = rows * layout.row_bytes
    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read(size)
    if len(data) != size:
        raise RoutingError(
            f"{path}: rows {row}..{row + rows} are past the end of the sidecar "
            f"({(os.path.getsize(path) - HEADER.size) // layout.row_bytes} rows)"
        )
    if checksum(data) != sha256:
        raise RoutingError(f"{path}: checksum mismatch in rows {row}..{row + rows} (corrupt)")
    out = np.frombuffer(data, dtype=layout.dtype()).reshape(rows, layout.layers, layout.k)
    if rows and int(out.max()) >= layout.experts:
        raise RoutingError(f"{path}: an expert id is >= the {layout.experts} experts")
    return out


class RoutingWriter:
    """Append chunks of rows to one sidecar (creating it with its header); each ``append``
    returns where its rows landed and their checksum. A file that exists must have the same
    layout; one cut short by a killed writer is cut back to its last whole row."""

    def __init__(self, path: str | os.PathLike[str], layout: RoutingLayout) -> None:
        self.path = Path(path)
        self.layout = layout
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fh = os.fdopen(fd, "r+b")
        size = os.fstat(fd).st_size
        if size == 0:
            self._fh.write(
                HEADER.pack(MAGIC, layout.layers, layout.k, layout.width, layout.experts)
            )
            size = HEADER.size
        else:
            found = read_layout(self.path)
            if found != layout:
                self._fh.close()
                raise RoutingError(
                    f"{self.path}: holds routing of {found.describe()}, not {layout.describe()}"
                )
            whole = (size - HEADER.size) // layout.row_bytes
            size = HEADER.size + whole * layout.row_bytes
            self._fh.truncate(size)
        self._fh.seek(size)
        self.rows = (size - HEADER.size) // layout.row_bytes

    def append(self, rows: np.ndarray) -> tuple[int, str]:
        """Write ``rows`` [n, layers, k]; returns (index of its first row, SHA-256)."""
        lay = self.layout
        if rows.ndim != 3 or rows.shape[1:] != (lay.layers, lay.k):
            raise RoutingError(
                f"{self.path}: rows of shape {tuple(rows.shape)} for {lay.describe()}"
            )
        data = rows.astype(lay.dtype(), copy=False).tobytes()
        first = self.rows
        self._fh.write(data)
        self._fh.flush()
        self.rows += rows.shape[0]
        return first, checksum(data)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> RoutingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sidecar_of(turn_file: str | os.PathLike[str]) -> Path:
    """The routing sidecar beside a Turn file: ``sess-1.jsonl`` -> ``sess-1.routing``."""
    return Path(turn_file).with_suffix(SUFFIX)


class RoutingCapture:
    """What one generation call asks an engine to fill (``GenerationRequest.routing``): the
    routing of every token position the engine computes for it, from ``start`` (the first
    position not served from its prefix cache) on. An engine that cannot record routing, or
    serves a dense model, leaves ``layout`` None. The engine's thread appends rows before it
    hands out the token that follows them, so once a caller has seen a token, the rows of
    every position before it are here."""

    def __init__(self) -> None:
        self.layout: RoutingLayout | None = None
        self.start = 0
        self._chunks: list[np.ndarray] = []
        self._n = 0

    def begin(self, layout: RoutingLayout, start: int) -> None:
        self.layout, self.start, self._chunks, self._n = layout, start, [], 0

    def add(self, rows: np.ndarray) -> None:
        self._chunks.append(rows)
        self._n += rows.shape[0]

    @property
    def end(self) -> int:
        """One past the last position with a row."""
        return self.start + self._n

    def rows(self, upto: int) -> np.ndarray:
        """The rows of positions ``start .. upto`` (fewer if fewer were computed)."""
        import numpy as np

        assert self.layout is not None
        chunks = list(self._chunks)  # the engine may still append one
        got = (
            np.concatenate(chunks)
            if chunks
            else np.zeros((0, self.layout.layers, self.layout.k), self.layout.dtype())
        )
        return got[: max(upto - self.start, 0)]


class ChunkReader:
    """Reads the chunks that Samples' routing spans point at, each file's header and each
    chunk's checksum checked once (chunks cached: samples of one episode share them)."""

    def __init__(self, expect: RoutingLayout) -> None:
        self.expect = expect
        self._chunks: dict[tuple[str, int, int, str], np.ndarray] = {}
        self.bytes_read = 0

    def chunk(self, file: str, row: int, rows: int, sha256: str) -> np.ndarray:
        key = (file, row, rows, sha256)
        got = self._chunks.get(key)
        if got is None:
            got = self._chunks[key] = read_chunk(file, row, rows, sha256, self.expect)
            self.bytes_read += got.nbytes
        return got

    def sample_rows(self, sample: Sample) -> tuple[np.ndarray, np.ndarray]:
        """A Sample's routing as ``[T, layers, k]`` expert ids and a ``[T]`` bool of the
        positions recorded (ids are 0 where not)."""
        import numpy as np

        lay = self.expect
        n = len(sample.input_ids)
        rows = np.zeros((n, lay.layers, lay.k), dtype=lay.dtype())
        has = np.zeros(n, dtype=bool)
        for span in sample.routing or ():
            part = self.chunk(span.file, span.row, span.rows, span.sha256)
            rows[span.at : span.at + span.count] = part[span.skip : span.skip + span.count]
            has[span.at : span.at + span.count] = True
        return rows, has
