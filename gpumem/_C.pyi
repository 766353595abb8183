# Generated with `python -m nanobind.stubgen -m gpumem._C -o gpumem/_C.pyi`
# (then __version__ added); regenerate after changing csrc/module.cpp.
"""gpumem native core (private; use the gpumem Python modules)"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray

__version__: str

class UnexpectedFileError(OSError):
    """The file is not what the caller asked for (a symbolic link, not a regular file, another
    size); it was not read."""

def num_threads() -> int:
    """Threads the native core uses by default."""

def set_num_threads(n: int) -> None:
    """Set the default thread count (<= 0: hardware concurrency)."""

def crc32c(
    data: Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu", writable=False)],
    value: int = 0,
    impl: str = "auto",
    threads: int = 0,
) -> int:
    """CRC32C of a 1-D uint8 buffer, extending the running CRC `value`."""

def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of a + b from crc(a), crc(b) and len(b)."""

def chunk_crc32c(
    data: Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu", writable=False)],
    chunk_bytes: int,
    out: Annotated[NDArray[numpy.int64], dict(shape=(None,), device="cpu")],
    impl: str = "auto",
    threads: int = 0,
) -> None:
    """Write one CRC32C per chunk_bytes-sized chunk of data into out (int64)."""

def crc32c_hardware() -> str:
    """'sse4.2', 'armv8-crc' or 'table': the CRC32C path this CPU uses."""

def crc32c_fold() -> str:
    """'vpclmulqdq', 'pclmulqdq' or 'none': how the hardware CRC32C path folds long buffers."""

def write_file(
    path: bytes,
    offsets: Sequence[int],
    buffers: Sequence[
        Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu", writable=False)]
    ],
    size: int = -1,
    threads: int = 0,
    fsync: bool = True,
    direct: bool = False,
    dir_fd: int = -1,
    exclusive: bool = False,
) -> tuple[int, int]:
    """Write pieces in parallel (path relative to dir_fd when >= 0; exclusive: create a new file,
    never through a symlink); returns (bytes written, bytes via O_DIRECT)."""

def fsync_dir(path: bytes) -> None:
    """fsync a directory."""

def copy_many(
    srcs: Sequence[
        Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu", writable=False)]
    ],
    dsts: Sequence[Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu")]],
    threads: int = 0,
) -> None:
    """Copy each source's bytes into its destination of the same size, 8 MiB pieces on the
    pool."""

def read_file(
    path: bytes,
    offsets: Sequence[int],
    buffers: Sequence[Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu")]],
    crc_index: Sequence[int],
    chunk_bytes: int,
    crc_out: Annotated[NDArray[numpy.int64], dict(shape=(None,), device="cpu")],
    threads: int = 0,
    direct: bool = False,
    dir_fd: int = -1,
    expect_size: int = -1,
) -> tuple[int, int, int]:
    """Read pieces in parallel (O_DIRECT for aligned middles), optionally CRC32C each chunk (CRC
    index -2: the piece must be all zero); path relative to dir_fd when >= 0; expect_size >= 0:
    only a regular file of that size, never through a symlink. Returns (bytes read, bytes via
    O_DIRECT, lowest file offset of a nonzero byte in a must-be-zero piece or -1)."""

def read_spans(
    path: bytes,
    buffer: Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu")],
    file_offsets: Annotated[
        NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    buffer_offsets: Annotated[
        NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    lengths: Annotated[
        NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    crc_index: Annotated[
        NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    chunk_bytes: int,
    crc_out: Annotated[NDArray[numpy.int64], dict(shape=(None,), device="cpu")],
    threads: int = 0,
    direct: bool = False,
    dir_fd: int = -1,
    expect_size: int = -1,
) -> tuple[int, int, int]:
    """read_file for spans of one buffer given as int64 arrays (file offset, buffer offset,
    length, CRC index); spans adjacent in the file and the buffer are read by one pread. Same
    returns."""

def read_into(
    path: bytes,
    offset: int,
    out: Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu")],
    threads: int = 0,
) -> int:
    """Read exactly len(out) bytes at offset into out."""

def cuda_load(disabled: bool, library: str) -> dict:
    """Load the CUDA runtime once; returns its status dict."""

def cuda_status() -> dict:
    """Status of the CUDA runtime."""

def cuda_get_device() -> int:
    """
    The calling thread's current CUDA device (cudaGetDevice); -1 without a usable runtime.
    """

PIN_CHUNK_BYTES: int = 1073741824

class HostBuffer:
    """Page-aligned host memory, optionally pinned."""

    def __init__(self, nbytes: int, alignment: int = 4096) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def pinning(self) -> bool: ...
    @property
    def pinned_bytes(self) -> int: ...
    def array(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """The whole buffer as a writable 1-D uint8 numpy array (no copy)."""

    def start_pinning(self, device: int = -1) -> None:
        """
        Register with cudaHostRegister in PIN_CHUNK_BYTES chunks, in a background thread, on
        `device` (< 0: the calling thread's current device).
        """

    def wait_pinned(self, timeout_s: float = -1.0) -> bool:
        """Wait for pinning; True when done."""

    def start_faulting(self, lock: bool, chunk: int, populate: bool = True) -> None:
        """
        Fault in (and with `lock`, mlock) the buffer in `chunk`-byte chunks from the end, in a
        background thread, without the GIL; contents are kept.
        """

    def wait_faulted(self, timeout_s: float = -1.0) -> bool:
        """Wait for faulting; True when done."""

    def unlock(self) -> None:
        """Stop faulting and munlock what was locked."""

    @property
    def faulting(self) -> bool: ...
    @property
    def ready_from(self) -> int: ...
    @property
    def locked(self) -> int: ...
    def copy_in(
        self,
        sources: Sequence[
            Annotated[NDArray[numpy.uint8], dict(shape=(None,), device="cpu", writable=False)]
        ],
        offsets: Sequence[int],
        threads: int = 0,
        chunk_bytes: int = 0,
        crc_index: Sequence[int] | None = None,
        crc_out: Annotated[NDArray[numpy.int64], dict(shape=(None,), device="cpu")] | None = None,
    ) -> None:
        """
        Copy each 1-D uint8 source into the buffer at its offset, in parallel.

        With crc_index and crc_out, also each chunk's CRC32C of the copied bytes:
        source i's chunk k goes to crc_out[crc_index[i] + k] (index -1: none).
        """

    def enqueue_d2h(
        self,
        copies: Annotated[
            NDArray[numpy.uint64],
            dict(shape=(None, 3), order="C", device="cpu", writable=False),
        ],
        stream: int,
    ) -> int:
        """Enqueue cudaMemcpyAsync device-to-host of every row (device address, bytes, buffer
        offset) of a C-contiguous (n, 3) uint64 array on `stream`, cut at PIN_CHUNK_BYTES; returns
        the number of cudaMemcpyAsync calls."""

def alloc_sim(
    max_split: int, max_non_split_rounding: int, large_segment: int, divisions: Sequence[int]
) -> PlainSim:
    """A caching allocator simulator without expandable segments, capacity or record_stream."""

class PlainSim:
    """CachingAllocatorSim's plain case, compiled."""

    def malloc(self, handle: int, size: int, stream: int = 0) -> None: ...
    def free(self, handle: int) -> None: ...
    def take(self, size: int, handle: int | None = None, stream: int = 0) -> int:
        """malloc, keeping the requested bytes alive, their peak and the unreleasable peak;
        returns the handle (the next of a counter when none is given)."""

    def give(self, handle: int) -> None: ...
    def fork(self) -> PlainSim: ...
    def empty_cache(self) -> int: ...
    def would_reserve(self, size: int, stream: int = 0) -> int: ...
    def largest_free_block(self) -> int: ...
    def releasable(self) -> int: ...
    def round_size(self, size: int) -> int: ...
    def segments(self) -> list:
        """The segment map by address: (address, size, stream, small, [(size, allocated,
        requested)])."""

    @property
    def reserved(self) -> int: ...
    @property
    def reserved_peak(self) -> int: ...
    @property
    def allocated(self) -> int: ...
    @property
    def allocated_peak(self) -> int: ...
    @property
    def requested(self) -> int: ...
    @property
    def requested_peak(self) -> int: ...
    @property
    def segments_count(self) -> int: ...
    @property
    def num_device_alloc(self) -> int: ...
    @property
    def num_device_free(self) -> int: ...
    @property
    def mallocs(self) -> int: ...
    @property
    def live(self) -> int: ...
    @property
    def peak(self) -> int: ...
    @property
    def pinned(self) -> int: ...
