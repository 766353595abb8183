"""The reference for the estimator's ``framework="torchtitan"`` recipe: torchtitan's own Llama 3
model, its own activation-checkpointing and FSDP2 code, one rank of the job on torch's fake
process group, one training step profiled under fake tensors (``gpumem.profile``).

What is torchtitan's (0.3.0, read in site-packages):

- the model: ``torchtitan.models.llama3`` (``Llama3Model``, fused ``wqkv``, complex RoPE,
  ``nn.RMSNorm``, SwiGLU ``w2(silu(w1 x) * w3 x)``), built from the same config as ``_8b`` /
  ``_70b`` (``models/llama3/__init__.py``) with ``rope.max_seq_len`` set to the training
  sequence, as ``Decoder.Config.update_from_config`` does;
- activation checkpointing: ``SelectiveAC`` (per-op SAC: save the outputs of the partitioner's
  compute-intensive ops and its extra list, recompute every second mm) and ``FullAC``
  (``distributed/activation_checkpoint.py``); layer SAC (``selective_ac_option`` = N in
  torchtitan before 0.3) as that code did: ``FullAC`` on every N-th block;
- FSDP2: ``apply_fsdp_to_decoder`` (``distributed/fsdp.py``): bf16 params, fp32 reduce, the
  embedding and each block resharded after forward, ``[norm, lm_head]`` not, the root;
- the step: ``Trainer._forward_backward_body`` (``trainer.py``): ``pred = model(tokens)``,
  ``cross_entropy_loss`` (``components/loss.py``: ``pred.flatten(0, 1).float()``, sum) over
  the global token count, ``del pred``, ``loss.backward()``, then ``clip_grad_norm_`` and the
  fused AdamW (``OptimizersContainer``'s default ``implementation="fused"``).

Deviations, each to make a CPU fake run save what the CUDA run saves:

- attention: torchtitan 0.3.0's language models use FlexAttention (compiled; it cannot run on
  fake CPU tensors). The published runs used SDPA, whose CUDA flash kernel saves q, k, v, the
  output and the fp32 log-sum-exp, as Flex does (plus its small block mask). The reference
  calls ``aten._scaled_dot_product_flash_attention`` (the op CUDA SDPA dispatches to; it is in
  the SAC save list through ``compute_intensive_ops``) directly on the fake tensors, with the
  un-repeated K/V heads (flash supports GQA). On CPU SDPA would pick
  ``_scaled_dot_product_flash_attention_for_cpu``, which is not in the save list.
- the loss: 0.3.0's llama3 recipes wrap it in ``ChunkedLossWrapper``; the published runs (and
  the default ``CrossEntropyLoss``) compute it on the whole logits. The reference does the
  latter.
- float8 (``float8=``): torchtitan's ``Float8LinearConverter`` for its rowwise recipes with its
  CUDA-capability check patched (``emulate=True`` would compute in high precision and save
  other tensors; nothing is computed here), torchao's ``convert_to_float8_training`` for
  tensorwise (0.3.0's converter never wraps the weight for FSDP's float8 all-gather). torchao's
  eager casts run as on CUDA; ``_scaled_mm`` runs on fake CPU tensors through its meta kernel.
- no torch.compile: under ``gpumem.profile`` Dynamo skips frames (the profiler's dispatch mode),
  see docs/estimator.md, "torch.compile".

    python benchmarks/published/torchtitan_reference.py --flavor 8B --world 8 --batch 2 \
        --seq 8192 --ac selective
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import gpumem

FLAVORS = {
    # dim, layers, heads, kv heads, ffn multiplier, multiple_of (models/llama3/__init__.py)
    "8B": (4096, 32, 32, 8, 1.3, 1024),
    "70B": (8192, 80, 64, 8, 1.3, 4096),
}
VOCAB = 128256


def flash_forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
    """torchtitan's ``ScaledDotProductAttention.forward`` (causal, ``(B, L, N, H)`` in and out)
    as the CUDA run executes it: the flash kernel on the transposed views, GQA without repeating
    K/V. It replaces the inner attention's forward before ``parallelize``, so that torchtitan's
    own sharding (``local_map`` of the inner attention under TP) wraps it."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False, scale=scale
    )[0]
    return out.transpose(1, 2)


@contextlib.contextmanager
def fake_job(dp: int, tp: int = 1, cp: int = 1, pp: int = 1, pp_rank: int = 0) -> Iterator[Any]:
    """torchtitan's ``ParallelDims`` (legacy ``partial_dtensor`` backend) over a fake process
    group of ``pp · dp · tp · cp`` ranks, this process the first rank of pipeline rank
    ``pp_rank`` (``pp`` is the mesh's outermost dimension).

    A ``DeviceMesh`` holds real rank tensors: FSDP builds new meshes (the dp × tp mesh of a
    TP-sharded parameter) inside the fake region, so mesh construction runs outside fake mode.
    """
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    world = pp * dp * tp * cp
    init, mesh_fget = DeviceMesh.__init__, DeviceMesh.mesh.fget
    device_type, backend = parallel_dims.device_type, get_spmd_backend()

    def real_init(self, *a, **kw):
        with unset_fake_temporarily():
            init(self, *a, **kw)

    def real_mesh(self):
        with unset_fake_temporarily():
            return mesh_fget(self)

    DeviceMesh.__init__ = real_init  # type: ignore[method-assign]
    DeviceMesh.mesh = property(real_mesh)  # type: ignore[method-assign,assignment]
    parallel_dims.device_type = "cpu"  # torchtitan defaults to "cuda" without a device
    set_spmd_backend("partial_dtensor")
    with unset_fake_temporarily():
        dist.init_process_group("fake", rank=pp_rank * dp * tp * cp, world_size=world)
    try:
        dims = parallel_dims.ParallelDims(
            dp_replicate=1,
            dp_shard=dp,
            cp=cp,
            tp=tp,
            pp=pp,
            ep=1,
            world_size=world,
            spmd_backend="partial_dtensor",
        )
        dims.build_mesh()
        yield dims
    finally:
        dist.destroy_process_group()
        DeviceMesh.__init__ = init  # type: ignore[method-assign]
        DeviceMesh.mesh = property(mesh_fget)  # type: ignore[method-assign,assignment]
        parallel_dims.device_type = device_type
        set_spmd_backend(backend)


def model_config(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim_multiplier: float | None,
    multiple_of: int,
    vocab: int,
    seq_len: int,
) -> Any:
    """A ``Llama3Model.Config`` built as torchtitan's ``_8b`` builds its own."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(
                dim, multiple_of=multiple_of, ffn_dim_multiplier=ffn_dim_multiplier
            ),
            # the trainer sets the RoPE cache to the training sequence (update_from_config)
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=seq_len, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )


FLOAT8 = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""The float8 recipes the reference runs: torchtitan 0.3.0's own (``rowwise``,
``rowwise_with_gw_hp``: ``Float8LinearConverter``) and torchao's ``tensorwise``, the recipe of
the published Dec-2024 runs (with ``enable_fsdp_float8_all_gather``)."""


def _float8_filter(fqn: str, in_features: int, out_features: int) -> bool:
    """torchtitan's ``module_filter_fn`` with ``filter_fqns=["lm_head"]`` (0.3.0's 405B recipe;
    torchtitan before 0.3 skipped its ``output`` projection always): a Linear is converted
    unless it is the head or a dim is not a multiple of 16."""
    return "lm_head" not in fqn and in_features % 16 == 0 and out_features % 16 == 0


def _float8_rowwise_config(cfg: Any, recipe: str) -> Any:
    """torchtitan's ``Float8LinearConverter`` applied to the model config, as the trainer does.
    Its hardware check (``has_cuda_capability(8, 9)``) is patched to pass: the fake run computes
    nothing, and ``emulate=True`` would compute in high precision (other saved tensors)."""
    from torchtitan.components.quantization import float8 as tt_float8

    check = tt_float8.has_cuda_capability
    tt_float8.has_cuda_capability = lambda *a: True  # type: ignore[assignment]
    try:
        conv = tt_float8.Float8LinearConverter(
            tt_float8.Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=["lm_head"])
        )
    finally:
        tt_float8.has_cuda_capability = check  # type: ignore[assignment]
    return conv.convert(cfg)


def _float8_tensorwise(model: nn.Module, all_gather: bool) -> None:
    """torchao's tensorwise Float8Linear swapped into the built model, as torchtitan before 0.3
    did (``convert_to_float8_training``; 0.3.0's converter builds the Float8Linear from the config
    and never wraps the weight for FSDP's float8 all-gather)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(
        model,
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather),
        module_filter_fn=lambda m, fqn: _float8_filter(fqn, m.in_features, m.out_features),
    )


def ac_and_fsdp(model: nn.Module, mesh, ac: str, *, pp_enabled: bool = False) -> None:
    """torchtitan's activation checkpointing, then ``apply_fsdp_to_decoder`` as its recipes call
    it (bf16 parameters, fp32 reduce); ``pp_enabled``: a pipeline stage's part."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    _apply_ac(model, ac)
    apply_fsdp_to_decoder(
        model,
        mesh,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        pp_enabled=pp_enabled,
    )


def adamw(params) -> torch.optim.Optimizer:
    """torchtitan's default optimizer (``OptimizersContainer``: fused AdamW, its defaults)."""
    return torch.optim.AdamW(
        params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )


def _apply_ac(model: nn.Module, ac: str) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if ac == "none":
        return
    if ac == "full":
        FullAC.Config().build(dump_folder="").apply(model)
    elif ac == "selective":
        SelectiveAC.Config().build(dump_folder="").apply(model)
    else:  # layer SAC every N blocks (torchtitan < 0.3: ptd_checkpoint_wrapper on every N-th)
        n = int(ac)
        policy = FullAC.Config().build(dump_folder="")
        layers = model.get_submodule("layers")
        for i, (name, block) in enumerate(list(layers.named_children())):
            if (i + 1) % n == 0:
                layers.register_module(name, policy._wrap_block(block))


@dataclasses.dataclass
class Result:
    peak_bytes: int
    at_peak: dict[str, int | None]
    peak_phase: str
    steps: list[int]
    reserved_bytes: int = 0
    """The recorded allocations and frees, each on the stream FSDP2 made it on, replayed
    through gpumem's caching-allocator simulator (default settings): peak reserved."""
    reserved_one_stream_bytes: int = 0
    """The same replay with every allocation on one stream (the profiler's own figure)."""


class _StreamLog(list):
    """The profiler's allocation log, with the stream current at each entry beside it."""

    def __init__(self, entries: list, current: list[int]) -> None:
        super().__init__(entries)
        self.current = current
        self.streams = [0] * len(entries)

    def append(self, entry: Any) -> None:
        super().append(entry)
        self.streams.append(self.current[0])


@contextlib.contextmanager
def fsdp_streams() -> Iterator[list[int]]:
    """Which stream FSDP2 allocates on: it enters ``device_handle.stream(s)`` (``torch.cpu``'s
    on a CPU device) around its all-gather copy-in and its reduce-scatter; each stream object
    gets an id (0: the current stream), kept in the yielded one-element list while inside."""
    current, ids = [0], {}
    original = torch.cpu.stream

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        prev = current[0]
        current[0] = 0 if s is torch.cpu.current_stream() else ids.setdefault(id(s), len(ids) + 1)
        try:
            yield
        finally:
            current[0] = prev

    torch.cpu.stream = stream  # type: ignore[assignment]
    try:
        yield current
    finally:
        torch.cpu.stream = original  # type: ignore[assignment]


def replay_reserved(log: _StreamLog, streams: bool = True) -> int:
    """Peak reserved of the recorded log replayed through gpumem's simulator."""
    from gpumem.allocator.caching import simulate

    live: set[int] = set()
    events: list[Any] = []
    for (hid, n, _dev), st in zip(log, log.streams, strict=True):
        if n > 0:
            live.add(hid)
            events.append(("alloc", hid, n, st if streams else 0))
        elif n < 0 and hid in live:
            live.remove(hid)
            events.append(("free", hid))
    return simulate(events, "").peak_reserved


def profile_step(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim_multiplier: float | None,
    multiple_of: int,
    vocab: int = VOCAB,
    world: int,
    batch: int,
    seq: int,
    ac: str,
    tp: int = 1,
    cp: int = 1,
    steps: int = 2,
    set_to_none: bool = True,
    loss_chunks: int = 0,
    float8: str = "",
    float8_all_gather: bool = False,
) -> Result:
    """Per-rank peak allocated bytes of ``steps`` torchtitan training steps (rank 0 of
    ``world`` FSDP ranks, each a group of ``tp`` tensor-parallel ranks with sequence
    parallelism) and ``cp`` context-parallel ranks (torchtitan's FlexAttention CP: K and V
    all-gathered along the sequence; FSDP then shards over ``world · cp``), on fake CPU tensors;
    ``batch`` is the local batch of an FSDP rank, ``seq`` the whole sequence.

    ``set_to_none``: the trainer's ``zero_grad(set_to_none=disable_cuda_graphs)``; 0.3.0 captures
    forward and backward in a CUDA graph by default and so keeps the gradients (False); the
    published runs, and 0.3.0 with ``--training.disable_cuda_graphs``, free them (True).
    ``loss_chunks``: 0 for ``CrossEntropyLoss`` on the whole logits (the published runs), N for
    0.3.0's llama3 recipes' ``ChunkedLossWrapper(num_chunks=N)`` (default 8): lm_head and the
    loss run per sequence chunk, each chunk's backward before the decoder's.
    ``float8``: one of ``FLOAT8`` (``""``: bf16); ``float8_all_gather``: tensorwise only,
    torchao's ``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``
    after each optimizer step (the 405B toml and Trainy's command line)."""
    if float8 not in ("", *FLOAT8):
        raise ValueError(f"float8={float8!r}: one of {', '.join(FLOAT8)} or ''")
    if float8_all_gather and float8 != "tensorwise":
        raise ValueError("float8_all_gather is torchao's tensorwise option")
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    if float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    cfg = model_config(
        dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, vocab, seq
    )
    if float8.startswith("rowwise"):  # the trainer converts the config before building
        cfg = _float8_rowwise_config(cfg, float8)
    set_llama3_sharding_config(cfg, enable_sp=True)  # Llama3Model.Config.update_from_config
    with fake_job(world, tp, cp) as dims, gpumem.fake():
        model = Llama3Model(cfg)
        if float8 == "tensorwise":
            _float8_tensorwise(model, float8_all_gather)
        inners = [block.attention.inner_attention for block in model.layers.values()]
        for inner in inners:
            inner.forward = types.MethodType(flash_forward, inner)
        if cp > 1:  # parallelize_llama: CP wraps the inner attention first
            apply_cp_to_forward(inners, dims.get_mesh("cp"))
        if tp > 1:  # parallelize_llama: TP (model.parallelize), then AC, then FSDP
            model.parallelize(dims)
        ac_and_fsdp(model, dims.get_mesh(["fsdp"]), ac)
        opt = adamw(model.parameters())
        if loss_chunks:  # Trainer.__init__: set_lm_head, _skip_lm_head
            loss_fn = ChunkedLossWrapper.Config(
                num_chunks=loss_chunks, loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)
            ).build()
            loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        else:
            loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab).build()
        # each CP rank holds seq / cp tokens of every sequence
        tokens = torch.randint(0, vocab, (batch, seq // cp))
        labels = torch.randint(0, vocab, (batch, seq // cp))
        n_tokens = torch.tensor(batch * seq * world)  # global valid tokens

        def step() -> None:
            opt.zero_grad(set_to_none=set_to_none)
            pred = model(tokens)
            loss, _ = loss_fn(pred, labels, n_tokens)
            del pred
            loss.backward()
            clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            opt.step()
            if float8_all_gather:  # torchtitan's Float8 converter's post-optimizer hook
                precompute_float8_dynamic_scale_for_fsdp(model)

        return run_profiled(model, opt, lambda _i: step(), steps)


def run_profiled(model: nn.Module, opt: Any, step: Any, steps: int) -> Result:
    """``step(i)`` for i in range(steps) under ``gpumem.profile(model, opt)``, each step's
    allocations tagged with FSDP2's stream: the peak and the replayed reserved bytes.

    torchtitan's GarbageCollection: automatic gc off during training, a collection every
    gc_freq steps; here before each step, so that every step starts as one after a collection
    (the chunked loss leaves reference cycles that gc would free at random)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with fsdp_streams() as current, gpumem.profile(model, opt) as prof:
            log = _StreamLog(prof.tracker.alloc_log, current)
            prof.tracker.alloc_log = log
            for i in range(steps):
                gc.collect()
                step(i)
    finally:
        if enabled:
            gc.enable()
    rep = prof.report()
    return Result(
        rep.peak_bytes,
        dict(rep.at_peak),
        rep.peak_phase,
        [s.peak for s in rep.steps],
        replay_reserved(log),
        replay_reserved(log, streams=False),
    )


def profile_flavor(flavor: str, **kw: Any) -> Result:
    dim, n_layers, n_heads, n_kv, mult, multiple_of = FLAVORS[flavor]
    return profile_step(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn_dim_multiplier=mult,
        multiple_of=multiple_of,
        **kw,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="8B", choices=sorted(FLAVORS))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ac", default="selective", help="none, selective, full or N (layer SAC)")
    args = ap.parse_args()
    r = profile_flavor(args.flavor, world=args.world, batch=args.batch, seq=args.seq, ac=args.ac)
    print(json.dumps(dataclasses.asdict(r), indent=1))


if __name__ == "__main__":
    main()
