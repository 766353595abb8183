"""``gpumem.estimate``: the per-GPU memory bill of a training job.

Example:
    >>> import gpumem
    >>> bill = gpumem.estimate("llama-2-70b", batch_size=1, seq_len=4096, precision="bf16-mixed",
    ...                        optimizer="adamw", gpu="H100-80GB",
    ...                        layout=gpumem.Layout(dp=8, tp=8, pp=1, zero=1), recompute="selective")
    >>> bill.fits, bill.per_gpu["total"]
    >>> print(bill.table())
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpumem.estimator import activations as act
from gpumem.estimator import backward as bwd
from gpumem.estimator import peak
from gpumem.estimator.gpus import GPU, find_gpu
from gpumem.estimator.layout import Layout
from gpumem.estimator.models import ModelSpec, param_groups, resolve_model
from gpumem.estimator.states import Training
from gpumem.units import format_bytes

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "temporary", "overhead", "total")
PHASES = ("backward start", "backward end", "optimizer step")
RECOMPUTE = ("none", "selective", "full")
DEEPSPEED_BUCKET = 500_000_000  # reduce_bucket_size / allgather_bucket_size default (elements)


@dataclass
class Bill:
    """The memory bill of the most loaded GPU, in integer bytes, and whether it fits.

    Attributes:
        n_params: parameters of the whole model.
        per_gpu: bytes by category at the peak of the most loaded rank (profiler categories).
        fits: ``per_gpu["total"] <= gpu.total_bytes``.
        headroom_bytes: capacity minus total (negative when it does not fit).
        cluster_model_state_bytes: unique weights + gradients + optimizer state of the job.
        model_states: per-GPU weights/gradients/optimizer outside any phase (steady state).
        phase: the moment of the peak (backward start / end, optimizer step).
        stage: the pipeline stage that is most loaded.
        items: the itemised activations of one layer (one micro-batch), for the table.
    """

    model: ModelSpec
    layout: Layout
    training: Training
    gpu: GPU
    n_params: int
    per_gpu: dict[str, int]
    fits: bool
    headroom_bytes: int
    cluster_model_state_bytes: int
    model_states: dict[str, int]
    phase: str
    stage: int
    inputs: dict[str, Any] = field(default_factory=dict)
    items: list[act.Item] = field(default_factory=list, repr=False)
    held_logits: int = 0
    """Bytes of ``per_gpu["activations"]`` that are logits the loop holds, not saved by autograd."""
    input_bytes: int = 0
    """Bytes of ``per_gpu["activations"]`` that are the model's input (token ids)."""

    def profiler_categories(self) -> dict[str, int]:
        """The peak in ``gpumem.profile``'s categories, to compare with ``rep.at_peak``.

        The bill follows the issue's convention (logits and inputs under activations); the
        profiler counts only what autograd saves as activations, the held logits as temporary
        and the model's input as inputs. Overhead (context, NCCL, fragmentation) is outside
        the profiler's count and left out of ``total`` here.
        """
        p = self.per_gpu
        out = {c: p[c] for c in ("weights", "gradients", "optimizer")}
        out["activations"] = p["activations"] - self.held_logits - self.input_bytes
        out["temporary"] = p["temporary"] + self.held_logits
        out["inputs"] = self.input_bytes
        out["total"] = sum(out.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        """Exactly the public keys: n_params, per_gpu, fits, headroom_bytes,
        cluster_model_state_bytes (what ``gpumem estimate --json`` prints)."""
        return {
            "n_params": self.n_params,
            "per_gpu": dict(self.per_gpu),
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "cluster_model_state_bytes": self.cluster_model_state_bytes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self, markdown: bool = False) -> str:
        """The bill as a text (or Markdown) table with GiB and share of the total."""
        total = self.per_gpu["total"]
        rows = [(c, self.per_gpu[c]) for c in CATEGORIES]
        head = (
            f"{self.model.name}: {self.n_params / 1e9:.2f} B params, {self.training.precision}, "
            f"{self.training.optimizer}, {self.layout.describe()} on {self.gpu.name} "
            f"(peak at {self.phase}, stage {self.stage})"
        )
        verdict = (
            f"{'fits' if self.fits else 'does NOT fit'}: headroom "
            f"{format_bytes(self.headroom_bytes)} of {format_bytes(self.gpu.total_bytes)}"
        )
        if markdown:
            lines = [f"**{head}**", "", "| category | bytes | GiB | share |", "|---|---:|---:|---:|"]
            lines += [f"| {c} | {b} | {b / 2**30:.2f} | {100 * b / max(total, 1):.1f}% |" for c, b in rows]
            return "\n".join([*lines, "", verdict])
        lines = [head, f"{'category':<12}{'bytes':>18}{'GiB':>10}{'share':>8}"]
        lines += [f"{c:<12}{b:>18,}{b / 2**30:>10.2f}{100 * b / max(total, 1):>7.1f}%" for c, b in rows]
        return "\n".join([*lines, verdict])

    def __str__(self) -> str:
        return self.table()


def estimate(
    model: Any,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    gpu: str | GPU | None = "H100-80GB",
    gpu_memory: str | int | None = None,
    layout: Layout | None = None,
    recompute: str = "none",
    grad_accum: int = 1,
    attention: str = "sdpa",
    dropout: float = 0.0,
    grads: str = "compute",
    offload_optimizer: bool = False,
    lora_rank: int = 0,
    base_quant: str | None = None,
    activation_model: str = "ops",
    device: str = "cuda",
    keep_logits: bool = True,
    persistent_grads: bool | None = None,
    foreach: bool | None = None,
    fused: bool = False,
    example_input: Any = None,
    loss_fn: Any = None,
) -> Bill:
    """Estimate the per-GPU peak memory of training ``model``.

    Args:
        model: a preset name, config.json path, dict, ModelSpec, gpumem.models config, or an
            ``nn.Module`` (real, meta or fake: see below).
        batch_size: micro-batch per GPU (default 1; for a module: its example's dim 0).
        seq_len: tokens per sample (default: the model's context; for a module: the example's).
        precision / optimizer / grads / offload_optimizer / lora_rank / base_quant: see Training.
        gpu / gpu_memory: a catalog name, or the memory of a GPU not in the catalog.
        layout: the parallel layout (default: one GPU).
        recompute: ``none``, ``selective``, ``full`` or ``every-K`` (checkpoint K layers at once).
        grad_accum: micro-batches per step (also the pipeline's micro-batch count).
        attention: ``sdpa`` (the backend PyTorch picks), ``flash``, ``efficient``,
            ``cpu-flash`` or ``eager``/``math`` (s² scores).
        activation_model: ``ops`` (what autograd saves) or ``korthikanti`` (the paper).
        device: ``cuda``, or ``cpu`` to compare with a CPU run (no context/NCCL reserve).
        keep_logits: the training loop holds the logits (``logits = model(x)`` lives until the
            next forward replaces it: through backward and the optimizer step).
        persistent_grads: gradients stay allocated across steps (default: when distributed or
            accumulating; plain single-GPU ``zero_grad(set_to_none=True)`` frees them).
        foreach / fused: torch.optim's step implementation (see Training.step_temp_bytes).
        example_input: for an ``nn.Module``: one micro-batch of its forward's inputs, a
            tensor, a tuple (positional) or a dict (keyword), real, meta or fake; dim 0 of every
            tensor is set to ``batch_size`` and dim 1 of integer (token id) tensors to
            ``seq_len`` when given. Or a function ``(batch_size, seq_len) -> inputs`` (called
            under fake tensors). Built-in ``gpumem.models`` modules default to their example batch.
        loss_fn: for an ``nn.Module``: ``output -> scalar loss`` (default: cross-entropy over the
            output's last dimension against integer targets; a scalar output or ``.loss`` is
            the loss itself).

    An ``nn.Module`` is never run, moved or changed, and nothing of its size is allocated:
    parameters are counted exactly (tied tensors once; trainable = ``requires_grad``; the
    precision sets the weight dtype as ``module.to(dtype)`` would, buffers count as weights),
    and a copy made of fake tensors runs one forward, loss and backward at the micro-batch under
    ``gpumem.profile``. Its saved activations per block and its widest backward moment become
    the peak terms; model states, layouts, the optimizer step and the CUDA reserve use the same
    formulas as presets. Assumptions (docs/estimator.md, "The nn.Module path"): blocks are the
    largest group of identical sibling modules; tensor parallelism splits every matrix and every
    saved tensor except those the size of a block's input (replicated unless ``layout.sp``);
    ``recompute="full"`` checkpoints every block of the copy (measured); ``"selective"``,
    ``every-K`` (K > 1), ``ep > 1``, LoRA arguments and the Korthikanti model need a preset or
    config. The pass runs on fake CUDA tensors when a GPU is present, else on fake CPU tensors
    (same sizes up to the 512-byte CUDA rounding; SDPA then takes the CPU kernel's shapes).

    Raises:
        ValueError / LookupError: bad sizes, unknown names, invalid layouts, with the reason.
    """
    from gpumem.estimator.module import is_module

    training = Training(precision, optimizer, grads, offload_optimizer, lora_rank, base_quant, foreach, fused)
    layout = layout or Layout()
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, gpu_memory)
    for name, value in (("batch_size", batch_size), ("grad_accum", grad_accum)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if is_module(model):
        from gpumem.estimator.module_estimate import estimate_module

        return estimate_module(
            model, training=training, layout=layout, gpu=g, batch_size=batch_size, seq_len=seq_len,
            recompute=recompute, grad_accum=grad_accum, attention=attention, dropout=dropout,
            activation_model=activation_model, device=device, keep_logits=keep_logits,
            persistent_grads=persistent_grads, example_input=example_input, loss_fn=loss_fn,
        )  # fmt: skip
    if example_input is not None or loss_fn is not None:
        raise ValueError("example_input and loss_fn apply to an nn.Module model only")
    batch_size = 1 if batch_size is None else batch_size
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    seq = _seq_len(spec, seq_len)
    layout.check(spec, seq_len=seq)
    if activation_model not in ("ops", "korthikanti"):
        raise ValueError(f"activation_model must be 'ops' or 'korthikanti', got {activation_model!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    plan = Plan(spec, training, g, seq, attention, dropout, activation_model, device, keep_logits)
    terms_by_stage = plan.terms(layout, batch_size, recompute, grad_accum, persistent_grads)
    return make_bill(
        spec, spec.n_params, terms_by_stage, layout=layout, training=training, gpu=g,
        cluster_model_state_bytes=plan.cluster_model_states(),
        inputs={"batch_size": batch_size, "seq_len": seq, "recompute": recompute,
                "grad_accum": grad_accum, "attention": plan.backend, "device": device},
        items=plan.layer_items(layout, batch_size),
    )  # fmt: skip


def make_bill(model: Any, n_params: int, terms_by_stage: list[list[float]], **fields: Any) -> Bill:
    """The Bill of the most loaded of the first and last pipeline stages' terms."""
    layout, gpu = fields["layout"], fields["gpu"]
    best, best_stage = None, 0
    stages = sorted({0, layout.pp - 1})
    for i, terms in zip(stages, terms_by_stage):
        out = peak.assemble(terms)
        if best is None or out[6] > best[6]:
            best, best_stage = out, i
    assert best is not None
    per_gpu = dict(zip(CATEGORIES, best[:7]))
    x = terms_by_stage[stages.index(best_stage)]
    # the held logits and the inputs inside the peak's activations (profiler: temporary, inputs)
    ids = x[peak.IDS] * (x[peak.INFLIGHT] if best[7] == 0 else 1)
    return Bill(
        model=model, n_params=n_params, per_gpu=per_gpu, fits=per_gpu["total"] <= gpu.total_bytes,
        headroom_bytes=gpu.total_bytes - per_gpu["total"], model_states=_steady_states(x),
        phase=PHASES[best[7]], stage=best_stage, held_logits=int(x[peak.HELD]),
        input_bytes=int(ids), **fields,
    )  # fmt: skip


def _steady_states(x) -> dict[str, int]:
    """Weights / gradients / optimizer per GPU with every gradient present (the ZeRO paper's
    accounting), independent of which phase peaks."""
    y = list(x)
    y[peak.G_PERSIST] = 1.0
    for k in (peak.A_LAYER, peak.A_FIRST, peak.A_LAST, peak.T_BWD0, peak.T_LAYER, peak.T_STEP,
              peak.A_END, peak.G_WALK, peak.P_PEND, peak.P_PEND_EXP, peak.HELD, peak.IDS,
              peak.GATHER, peak.CASTS, peak.COMM, peak.CONTEXT, peak.NCCL, peak.FRAG):  # fmt: skip
        y[k] = 0.0
    w, g, o = peak.assemble(y)[:3]
    return {"weights": w, "gradients": g, "optimizer": o, "total": w + g + o}




def _seq_len(spec: ModelSpec, seq_len: int | None) -> int:
    if spec.arch == "vit":
        return spec.n_tokens_per_sample
    if spec.arch == "resnet":
        return 1
    seq = spec.max_seq if seq_len is None else seq_len
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    return seq


@dataclass
class Plan:
    """Everything about a job except its layout and micro-batch; turns those into peak terms."""

    spec: ModelSpec
    training: Training
    gpu: GPU
    seq: int
    attention: str = "sdpa"
    dropout: float = 0.0
    activation_model: str = "ops"
    device: str = "cuda"
    keep_logits: bool = True

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def backend(self) -> str:
        a = self.attention
        if a in ("eager", "math"):
            return "math"
        if a in ("flash", "efficient", "cpu-flash"):
            return a
        if a != "sdpa":
            raise ValueError(f"unknown attention {a!r}; use sdpa, flash, efficient, cpu-flash, eager")
        if not self.cuda:
            return "cpu-flash" if self.dropout == 0 else "math"
        return "efficient" if self.training.compute_bytes == 4 else "flash"

    def workload(self, layout: Layout, batch: int) -> act.Workload:
        t = self.training
        return act.Workload(
            batch=batch, seq=self.seq, compute=t.compute_bytes,
            residual=4 if t.autocast else t.compute_bytes, autocast=t.autocast,
            attention=self.backend, dropout=self.dropout, cuda=self.cuda, tp=layout.tp,
            sp=layout.sp, keep_logits=self.keep_logits,
        )  # fmt: skip

    def layer_items(self, layout: Layout, batch: int) -> list[act.Item]:
        if not self.spec.is_decoder and self.spec.arch != "vit":
            return []
        return act.layer_items(self.spec, self.workload(layout, batch))

    def cluster_model_states(self) -> int:
        """Unique (unsharded, unreplicated) weights + gradients + optimizer state of the job."""
        tr, spec = self.training, self.spec
        trainable = self._lora_params(spec.n_layers, 1) if tr.lora_rank else spec.n_params
        return cluster_states(tr, trainable, spec.n_params if tr.lora_rank else 0)

    def _lora_params(self, n_layers: int, t: int) -> int:
        """LoRA adapters of rank r on every Linear of a layer: r·(in + out) each."""
        s, r = self.spec, self.training.lora_rank
        h, qd, kvd, f = s.hidden, s.n_heads * s.dhead, s.kv_heads * s.dhead, s.ffn
        per = (h + qd) + 2 * (h + kvd) + (qd + h)
        per += 3 * (h + f) if s.arch == "llama" else 2 * (h + f)
        return n_layers * r * per // t

    def stage_layers(self, pp: int) -> list[int]:
        return split_layers(self.spec.n_layers, pp)

    def terms(
        self, layout: Layout, batch: int, recompute: str, grad_accum: int,
        persistent_grads: bool | None,
    ) -> list[list[float]]:  # fmt: skip
        """The peak terms of the first and the last pipeline stage of ``layout``.

        Middle stages never exceed the first: it holds at least as many layers (the remainder
        of an uneven split goes to the first stages), at least as many in-flight micro-batches,
        and the embedding; the last stage holds the head and the loss.
        """
        spec, tr, t = self.spec, self.training, layout.tp
        pg = param_groups(spec)
        a_layer, t_end, a_end, g_walk, t_start, first, last, held, ids, ce0 = self._act_terms(
            layout.tp, layout.sp, batch, recompute)  # fmt: skip
        # k/v projections replicate across ranks when tp exceeds the KV heads
        kvp = 2 * spec.hidden * spec.kv_heads * spec.dhead if spec.n_heads else 0
        layer_tp = (pg.layer_tp - kvp) / t + kvp / min(t, max(spec.kv_heads, 1))
        out = []
        pp = layout.pp
        persist = grads_persist(layout, grad_accum, persistent_grads)
        layers = self.stage_layers(pp)
        for i in sorted({0, pp - 1}):
            n_l = layers[i]
            is_first, is_last = i == 0, i == pp - 1
            dense = n_l * (layer_tp + pg.layer_rep)
            if is_first:
                dense += pg.embed_tp / t + pg.embed_rep
            if is_last:
                dense += pg.head_tp / t + pg.head_rep
                if spec.tied_embeddings and pp > 1:
                    dense += pg.embed_tp / t  # Megatron keeps a copy of tied embeddings at the end
            expert = n_l * pg.layer_expert / (layout.ep * t)
            if tr.lora_rank:
                p_train, p_frozen = self._lora_params(n_l, t), dense
                p_exp_train, p_exp_frozen = 0.0, expert
            else:
                p_train, p_frozen, p_exp_train, p_exp_frozen = dense, 0.0, expert, 0.0
            trainable = p_train + p_exp_train
            x = [0.0] * peak.N_TERMS
            x[peak.P_TRAIN], x[peak.P_FROZEN] = p_train, p_frozen
            x[peak.P_EXP_TRAIN], x[peak.P_EXP_FROZEN] = p_exp_train, p_exp_frozen
            x[peak.A_LAYER], x[peak.N_LAYERS] = a_layer, n_l
            x[peak.W_BUFFERS] = spec.buffer_bytes * n_l / max(spec.n_layers, 1)
            x[peak.INFLIGHT] = inflight(layout, grad_accum, i)
            x[peak.A_FIRST] = first if is_first else 0.0
            x[peak.A_LAST] = last if is_last else 0.0
            grad_in = ce0 if is_last else batch * self.seq * spec.hidden * tr.compute_bytes / t
            if is_last and spec.is_decoder:
                # by the last layer's widest moment the loss and head have run: their saved
                # tensors are gone (the held logits stay), the head's weight grad exists
                head = (pg.embed_tp if spec.tied_embeddings else pg.head_tp) / t + pg.head_rep
                t_start += head * tr.grad_bytes - (last - held)
            x[peak.T_BWD0] = max(grad_in, t_start)
            x[peak.T_LAYER] = t_end
            x[peak.A_END] = a_end
            x[peak.HELD] = held if is_last else 0.0
            x[peak.IDS] = ids if is_first else 0.0
            x[peak.G_WALK] = g_walk
            # weight grads not yet produced at the end moment (inside the stage's first layer):
            # that layer's, and an untied embedding's (a tied one waits in autograd's buffer)
            if self.activation_model == "ops" and n_l and not persist:
                emb = (0.0 if spec.tied_embeddings else pg.embed_tp / t) + pg.embed_rep
                if tr.lora_rank:
                    x[peak.P_PEND] = self._lora_params(1, t)
                else:
                    x[peak.P_PEND] = layer_tp + pg.layer_rep + (emb if is_first else 0.0)
                    x[peak.P_PEND_EXP] = pg.layer_expert / (layout.ep * t)
            layer_params = (layer_tp + pg.layer_rep) + pg.layer_expert / (layout.ep * t)
            job_terms(x, tr, layout, self.gpu, self.cuda, trainable=trainable,
                      layer_params=layer_params, scratch=pg.step_scratch / t, persist=persist)  # fmt: skip
            out.append(x)
        return out

    def _act_terms(self, tp: int, sp: bool, batch: int, recompute: str) -> tuple[float, ...]:
        """(per-layer saved, end-of-backward temporary / activations / weight grads, start-of-
        backward transient, first-stage, last-stage, logits held, token ids, CE backward),
        cached: the planner asks for the same few combinations thousands of times."""
        key = (tp, sp, batch, recompute)
        cache = self.__dict__.setdefault("_acts_cache", {})
        if key not in cache:
            w = self.workload(Layout(dp=1, tp=tp, sp=sp), batch)
            layer = self._layer_acts(tp, sp, batch, recompute, w)
            first, last = self._ends(w)
            dec = self.spec.is_decoder and self.activation_model == "ops"
            held = act.sum_items([i for i in act.head_items(self.spec, w) if i.name == "logits"]) if dec else 0
            ids = act.sum_items([i for i in act.embed_items(self.spec, w) if i.name == "embed.ids"]) if dec else 0
            ce0 = act.ce_backward_bytes(self.spec, w) if self.spec.is_decoder else 0
            cache[key] = (*layer, first, last, float(held), float(ids), float(ce0))
        return cache[key]

    def _ends(self, w: act.Workload) -> tuple[float, float]:
        """Activations outside the layers: (first stage: embedding, last stage: head + loss)."""
        spec = self.spec
        if spec.arch == "resnet":
            return float(act.resnet_bytes(spec, w.batch, spec.image_size, w.compute)), 0.0
        if spec.arch == "vit":  # patch conv input (images) + classifier input; small
            img = w.batch * spec.channels * spec.image_size**2 * 4
            return float(img), float(w.batch * spec.hidden * w.compute + w.batch * 8)
        first = act.sum_items(act.embed_items(spec, w))
        last = act.sum_items(act.head_items(spec, w))
        if self.activation_model == "korthikanti":  # Megatron: ids 8sb, output layer + CE 4sbh(1 + v/h)
            first = 8 * w.tokens
            last = 4 * w.tokens * (spec.hidden + spec.vocab // w.tp)
        return float(first), float(last)

    def _layer_acts(self, tp: int, sp: bool, batch: int, recompute: str, w: act.Workload) -> tuple[float, ...]:
        """Under the recompute policy: (saved bytes per layer; at the widest moment of the
        stage's first layer's backward (the end of backward): temporary, activations and weight
        grads of that layer; the transient of the start of backward)."""
        spec = self.spec
        if spec.arch == "resnet":
            return 0.0, 0.0, 0.0, 0.0, 0.0
        every = _every(recompute)
        if self.activation_model == "korthikanti":
            mode = "full" if every else recompute
            full = act.korthikanti_layer_bytes(spec, batch, self.seq, tp, sp, "none",
                                               flash=self.backend != "math")  # fmt: skip
            saved = act.korthikanti_layer_bytes(spec, batch, self.seq, tp, sp, mode,
                                                flash=self.backend != "math")  # fmt: skip
            return float(saved / (every or 1)), float(full * (every or 1) if every else 0), 0.0, 0.0, 0.0
        items = act.layer_items(spec, w)
        full = act.sum_items(items)
        n_in = w.tokens // (w.tp if w.sp else 1) * spec.hidden * w.residual
        k = every or 0
        saved = {"none": full, "selective": act.sum_items(items, drop_core=True)}.get(recompute, n_in / (k or 1))
        m = bwd.layer_moment(spec, w, items, self.training.grad_bytes, recompute)
        # recomputed activations are temporaries again (the profiler's view); the norm's saved
        # input is the checkpointed block input itself when it is already fp32 (LayerNorm, or
        # the fp32 residual stream of RMSNorm)
        shared = n_in if (spec.norm == "layernorm" or w.residual == 4) else 0
        if k:
            # a block of k layers comes back at once: a bound over the block's backward that
            # keeps all k recomputed layers and one layer's weight grads pending
            t_end = (k - 1) * full + full - shared + m.temporary - m.freed
            a_end = n_in
        elif recompute == "selective":
            t_end, a_end = m.temporary, saved - m.freed
        else:
            t_end, a_end = m.temporary, full - m.freed
        # backward start: the last layer's widest moment (its recomputation included)
        t_start = m.excess + (full - shared if k else 0)
        return float(saved), float(t_end), float(a_end), float(m.grads), float(t_start)
def split_layers(n_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage; the remainder of an uneven split goes to the first stages."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def grads_persist(layout: Layout, grad_accum: int, persistent_grads: bool | None) -> bool:
    """Whether gradient buffers live across steps: given, or when distributed or accumulating
    (a plain single-GPU ``zero_grad(set_to_none=True)`` frees them)."""
    if persistent_grads is None:
        return grad_accum > 1 or layout.n_gpus > 1
    return persistent_grads


def inflight(layout: Layout, grad_accum: int, stage: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at the start of backward (1F1B:
    ``pp - stage``, at most the micro-batches per step; interleaving adds ``(pp-1)/(pp·vpp)``)."""
    pp = layout.pp
    interleave = 1 + (pp - 1) / (pp * layout.vpp) if layout.vpp > 1 else 1.0
    return (min(grad_accum, pp - stage) if pp > 1 else 1) * interleave


def job_terms(
    x: list[float], tr: Training, layout: Layout, gpu: GPU, cuda: bool, *, trainable: float,
    layer_params: float, scratch: float, persist: bool,
) -> None:  # fmt: skip
    """Fill the peak terms every model shares: state bytes and sharding, the optimizer step's
    temporaries, ZeRO/FSDP communication buffers, and the CUDA reserve.

    Args:
        trainable: trainable parameters on this rank before ZeRO sharding.
        layer_params: parameters of one layer (what ZeRO-3/FSDP gathers at once).
        scratch: elements a per-tensor optimizer step holds at once.
    """
    x[peak.W_BYTES], x[peak.W_FROZEN_BYTES] = tr.weight_bytes, tr.frozen_weight_bytes
    x[peak.G_BYTES], x[peak.O_BYTES] = tr.grad_bytes, tr.optimizer_bytes
    x[peak.N_SHARD] = layout.shard_degree(gpu.gpus_per_node)
    x[peak.N_SHARD_EXP] = layout.shard_degree(gpu.gpus_per_node, expert=True)
    x[peak.STAGE] = layout.stage
    opt_shard = x[peak.N_SHARD] if layout.stage >= 1 else 1
    x[peak.T_STEP] = tr.step_temp_bytes(int(trainable / opt_shard), int(scratch), cuda)
    if layout.stage >= 3:  # all-gather of a layer + prefetch of the next, reduce-scatter
        x[peak.GATHER] = layer_params * (2 * tr.weight_bytes + tr.grad_bytes)
    elif layout.stage in (1, 2):  # DeepSpeed's reduce and all-gather buckets
        x[peak.COMM] = min(DEEPSPEED_BUCKET, trainable) * (tr.grad_bytes + tr.weight_bytes)
    x[peak.G_PERSIST] = 1.0 if persist else 0.0
    if cuda:
        x[peak.CONTEXT] = gpu.context_bytes
        x[peak.NCCL] = gpu.nccl_bytes if layout.n_gpus > 1 else 0
        x[peak.FRAG] = gpu.fragmentation
    x[peak.OFFLOAD] = 1.0 if tr.offload_optimizer else 0.0


def cluster_states(tr: Training, trainable: float, frozen: float) -> int:
    """Unique weights + gradients + optimizer state of a job (no sharding, no replicas)."""
    return int(trainable * (tr.weight_bytes + tr.grad_bytes + tr.optimizer_bytes)
               + frozen * tr.frozen_weight_bytes)  # fmt: skip


def _every(recompute: str) -> int:
    if recompute in RECOMPUTE:
        return 1 if recompute == "full" else 0
    if recompute.startswith("every-"):
        try:
            k = int(recompute[6:])
        except ValueError:
            k = 0
        if k > 0:
            return k
    raise ValueError(f"unknown recompute {recompute!r}; use none, selective, full or every-K (K >= 1)")


def model_states(n_params: int, training: Training, layout: Layout, gpus_per_node: int = 8) -> dict[str, int]:
    """Per-GPU weights / gradients / optimizer of ``n_params`` dense parameters under ``layout``
    (data parallel and ZeRO only; the ZeRO paper's Figure 1 accounting). Same formula as
    :func:`estimate`, without a model shape."""
    x = [0.0] * peak.N_TERMS
    x[peak.P_TRAIN] = n_params / (layout.tp * layout.pp)
    x[peak.W_BYTES], x[peak.G_BYTES], x[peak.O_BYTES] = (
        training.weight_bytes, training.grad_bytes, training.optimizer_bytes)  # fmt: skip
    x[peak.N_SHARD] = x[peak.N_SHARD_EXP] = layout.shard_degree(gpus_per_node)
    x[peak.STAGE] = layout.stage
    x[peak.OFFLOAD] = 1.0 if training.offload_optimizer else 0.0
    return _steady_states(x)
