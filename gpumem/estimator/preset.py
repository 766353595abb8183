"""The estimate of a described model (preset, ``config.json``, ``ModelSpec``): its peak terms
from the activation rules (``activations.py``, ``backward.py``) and the shared job terms.

``PresetTerms`` holds everything about a job except its layout and micro-batch, and turns those
two into peak terms; the planner's sweep asks it for thousands of layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.estimator import activations as act
from gpumem.estimator import backward as bwd
from gpumem.estimator import finetune as ftn
from gpumem.estimator import hf_ops, inputs, lora_ops, peak, t5_ops, tune_compiled
from gpumem.estimator.bill import Bill, make_bill
from gpumem.estimator.frameworks import (
    cuda_graphs,
    megatron,
    titan_moe,
    titan_pipeline,
    torchtitan,
)
from gpumem.estimator.frameworks.conventions import (
    cp_exchange_bytes,
    default_fused_ops,
    default_keep_logits,
    loss_convention,
    upcasts_logits,
)
from gpumem.estimator.gpus import GPU
from gpumem.estimator.job import Job
from gpumem.estimator.knobs import MOE_IMBALANCE, check_attention
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import ParamGroups, param_groups
from gpumem.estimator.rank_shapes import fill_fragmentation
from gpumem.estimator.states import ParamMix, Training, ns_width
from gpumem.estimator.terms import (
    cluster_states,
    grads_persist,
    inflight,
    job_terms,
    recompute_every,
    stage_chunks,
)


def preset_seq_len(spec: ModelSpec, seq_len: int | None) -> int:
    """Tokens per sample: the given ``seq_len``, else the model's context (images: fixed);
    checked against the model (``inputs.seq_len``)."""
    return inputs.seq_len(spec, seq_len)[0]


@dataclass
class PresetTerms:
    """Everything about a job except its layout and micro-batch; turns those into peak terms."""

    spec: ModelSpec
    training: Training
    gpu: GPU
    seq: int
    attention: str = "sdpa"
    dropout: float = 0.0
    activation_model: str = "ops"
    device: str = "cuda"
    keep_logits: bool | None = None  # None: the framework's loop (frameworks.default_keep_logits)
    framework: str = "torch"
    moe_imbalance: float = MOE_IMBALANCE
    moe_dispatcher: str = "alltoall"
    moe_grouped_gemm: bool | None = None
    fused_ops: tuple[str, ...] | None = None
    knobs: megatron.MegatronKnobs = field(default_factory=megatron.MegatronKnobs)
    alloc_conf: AllocConf | None = None
    """The caching allocator's settings the fragmentation is simulated under (``rank_shapes``);
    None: the flat ``gpu.fragmentation`` fraction instead."""
    plan: ftn.AdapterPlan | None = None
    """A fine-tuning recipe's adapters (``finetune.describe``): the frozen base's rules
    (``lora_ops.py``) replace the fully trained model's."""
    graph_capture: bool = False
    """Megatron's CUDA-graph capture as the allocator sees it (``cuda_graphs.py``): the graphed
    parts alone, no embedding, head or loss; ``terms`` takes it where it is the larger."""
    target_seq: int | None = None
    """An encoder-decoder's target tokens per sample (None: ``seq``)."""

    @property
    def torchtune(self) -> bool:
        return self.plan is not None and self.plan.recipe.source == "torchtune"

    def __post_init__(self) -> None:
        if self.spec.is_encoder and not self.dropout:  # the config's attention dropout
            self.dropout = self.spec.attn_pdrop
        if self.spec.is_encoder_decoder and not self.dropout:  # T5's dropout_rate
            self.dropout = self.spec.pdrop

    @property
    def mcore(self) -> bool:
        """Megatron-core's own saved tensors and loss (``frameworks/megatron.py``), not the
        reference modules' or transformers'."""
        return self.framework == "megatron" and self.activation_model == "ops"

    @property
    def fused(self) -> frozenset[str]:
        """The fused kernels (default: the framework's, ``frameworks.default_fused_ops``)."""
        ops = default_fused_ops(self.framework) if self.fused_ops is None else self.fused_ops
        return frozenset(ops)

    @property
    def holds_logits(self) -> bool:
        """The loop holds the logits through backward (given, or the framework's loop)."""
        if self.keep_logits is None:  # torchtune's recipe drops them (``del logits``)
            return default_keep_logits(self.framework) and not self.torchtune
        return self.keep_logits

    @property
    def param_groups(self) -> ParamGroups:
        """The spec's parameter groups, computed once (the planner asks per layout)."""
        if "_pg" not in self.__dict__:
            self.__dict__["_pg"] = param_groups(self.spec)
        return self.__dict__["_pg"]

    @property
    def grouped_gemm(self) -> bool:
        """Experts as one grouped GEMM: Megatron and transformers (grouped_mm) by default;
        gpumem.models loops over experts."""
        if self.moe_grouped_gemm is not None:
            return self.moe_grouped_gemm
        return self.spec.is_hf or self.framework == "megatron"

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
        check_attention(a)  # what is left is sdpa
        if not self.cuda:
            return "cpu-flash" if self.dropout == 0 else "math"
        return "efficient" if self.training.compute_bytes == 4 else "flash"

    def workload(self, layout: Layout, batch: int, dense: bool = False) -> act.Workload:
        t = self.training
        return act.Workload(
            batch=batch,
            seq=self.seq,
            compute=t.compute_bytes,
            residual=4 if t.autocast else t.compute_bytes,
            autocast=t.autocast,
            attention=self.backend,
            dropout=self.dropout,
            cuda=self.cuda,
            tp=layout.tp,
            sp=layout.sp,
            keep_logits=self.holds_logits,
            # BERT's MLM loss is CrossEntropyLoss on the model's dtype, not ForCausalLMLoss
            upcast_logits=(upcasts_logits(self.framework) or self.torchtune)
            and not (self.spec.is_encoder or self.spec.is_encoder_decoder),
            cp=layout.cp,
            dense=dense,
            ep=layout.ep,
            etp=layout.expert_tp,
            moe_imbalance=self.moe_imbalance,
            grouped_gemm=self.grouped_gemm,
            fused=self.fused,
            eager=self.attention == "eager",
            target_seq=self.target_seq or 0,
        )

    def layer_items(self, layout: Layout, batch: int, dense: bool = False) -> list[act.Item]:
        if not self.spec.is_decoder and self.spec.arch != "vit":
            return []
        return self._items(self.workload(layout, batch, dense))

    def _items(self, w: act.Workload) -> list[act.Item]:
        if self.plan is not None and self.plan.recipe.adapters:
            return lora_ops.layer_items(self.spec, w, self.plan.typical, True, self.plan.recipe)
        if self.plan is not None and self.plan.recipe.compile_layers:
            return tune_compiled.compiled_layer_items(self.spec, w)
        if self.plan is not None:  # torchtune's full fine-tune: its modules' copies besides
            return hf_ops.layer_items(self.spec, w) + lora_ops.torchtune_copies(self.spec, w)
        if self.mcore and self.spec.is_decoder:
            return megatron.layer_items(self.spec, w, self.knobs, self.graph_capture)
        return hf_ops.layer_items(self.spec, w)

    def cluster_model_states(self) -> int:
        """Unique (unsharded, unreplicated) weights + gradients + optimizer state of the job."""
        tr, spec = self.training, self.spec
        if self.plan is not None and self.plan.recipe.adapters:
            trainable = ftn.adapter_params(self.plan, spec) + ftn.head_adapter_params(
                self.plan, spec
            )
            quant = ftn.quantized_params(self.plan, spec, range(spec.n_layers))
            frozen = spec.n_params - quant + quant * ftn.NF4_BYTES / tr.weight_bytes
            return cluster_states(tr, trainable, frozen)
        trainable = self._lora_params(spec.n_layers, 1) if tr.lora_rank else spec.n_params
        return cluster_states(tr, trainable, spec.n_params if tr.lora_rank else 0)

    def _lora_params(self, n_layers: int, t: int) -> int:
        """LoRA adapters of rank r on every Linear of a layer: r·(in + out) each (a recipe's:
        its typical layer's)."""
        if self.plan is not None:
            per = ftn.adapter_params(
                ftn.AdapterPlan((self.plan.typical,), False, self.plan.recipe), self.spec,
                range(1), t,
            )  # fmt: skip
            return n_layers * per
        s, r = self.spec, self.training.lora_rank
        h, qd, kvd, f = s.hidden, s.n_heads * s.dhead, s.kv_heads * s.dhead, s.ffn
        per = (h + qd) + 2 * (h + kvd) + (qd + h)
        per += 3 * (h + f) if s.arch == "llama" else 2 * (h + f)
        return n_layers * r * per // t

    def terms(
        self,
        layout: Layout,
        batch: int,
        recompute: str,
        grad_accum: int,
        persistent_grads: bool | None,
        stages: list[int] | None = None,
    ) -> list[list[float]]:
        """The peak terms of the pipeline ranks ``stages`` (default: those that can be the
        worst).

        Of identical layers, the first, second and last ranks bound every other: a middle rank
        never exceeds the second (it holds at most as many layers and in-flight micro-batches,
        and neither the embedding nor the head), which the planner relies on. An MoE with
        dense first layers breaks the symmetry (a later rank of all-MoE layers can exceed the
        second): then every rank is a candidate. Under Megatron's CUDA graphs a rank's terms
        are those of the larger of a step's peak and the capture's (``views`` keeps both).
        """
        st = _Stack.of(self, layout, batch, recompute, grad_accum, persistent_grads)
        if stages is None:
            pp = layout.pp
            stages = list(range(pp)) if st.pg.n_dense else sorted({0, min(1, pp - 1), pp - 1})
        rows, capture = self.views(st, stages)
        return rows if capture is None else cuda_graphs.larger(rows, capture)

    def views(
        self, st: _Stack, stages: list[int]
    ) -> tuple[list[list[float]], list[list[float]] | None]:
        """A step's peak terms of the ranks ``stages`` (``terms``), and under Megatron's CUDA
        graphs their capture's (``cuda_graphs.py``; None without graphs): the capture runs
        the graphed parts alone, before the first optimizer step with 0 warm-up steps."""
        rows = [stage_terms(self, st, i) for i in stages]
        if not (self.mcore and self.knobs.cuda_graph_scope) or self.graph_capture:
            return rows, None
        pt = replace(self, graph_capture=True)
        cst = _Stack.of(pt, st.layout, st.batch, st.recompute, st.grad_accum, st.persist)
        capture = [stage_terms(pt, cst, i) for i in stages]
        if self.knobs.cuda_graph_warmup_steps == 0:
            for x in capture:
                cuda_graphs.before_first_step(x, self.training.master_bytes)
        return rows, capture

    def _act_terms(
        self, layout: Layout, batch: int, recompute: str, dense: bool
    ) -> tuple[float, ...]:
        """(per-layer saved, end-of-backward temporary / activations / weight grads, start-of-
        backward transient, first-stage, last-stage, logits held, token ids, CE backward,
        per-layer communication) of a dense or an MoE layer, cached: the planner asks for the
        same few combinations thousands of times."""
        lay = layout
        dense = dense or not self.spec.is_moe
        key = (lay.tp, lay.sp, lay.cp, lay.ep, lay.expert_tp, batch, recompute, dense)
        cache = self.__dict__.setdefault("_acts_cache", {})
        if key not in cache:
            spec = self.spec
            w = self.workload(lay, batch, dense)
            layer = self._layer_acts(lay.tp, lay.sp, batch, recompute, w)
            first, last = self._ends(w)
            dec = spec.is_decoder and self.activation_model == "ops"
            held = (
                act.sum_items([i for i in hf_ops.head_items(spec, w) if i.name == "logits"])
                if dec
                else 0
            )
            ids = (
                act.sum_items([i for i in hf_ops.embed_items(spec, w) if i.name == "embed.ids"])
                if dec
                else 0
            )
            if self.graph_capture:  # the capture runs the graphed layers alone
                held = ids = 0
                ce0 = 0
            elif self.mcore and spec.is_decoder:
                ce0 = megatron.loss_transient(spec, w, "ce" in self.fused)
            else:
                ce0 = hf_ops.ce_backward_bytes(spec, w) if spec.is_decoder else 0
            comm = 0.0
            if spec.is_decoder and spec.n_heads:
                kv_width = (
                    spec.n_heads * (spec.qk_nope_dim + spec.qk_rope_dim + spec.v_head_dim)
                    if spec.is_mla
                    else 2 * spec.kv_heads * spec.dhead
                ) // max(1, min(lay.tp, spec.kv_heads if not spec.is_mla else lay.tp))
                comm += cp_exchange_bytes(
                    self.framework, lay.cp, w.tokens, kv_width // 2, w.compute
                )
            if spec.is_moe and not dense:
                comm += hf_ops.dispatch_bytes(spec, w, self.moe_dispatcher)
            cache[key] = (*layer[:5], first, last, float(held), float(ids), float(ce0), comm)
            cache[key] += (layer[5],)  # [11]: saved tensors the widest moment released
        return cache[key]

    def _ends(self, w: act.Workload) -> tuple[float, float]:
        """Activations outside the layers: (first stage: embedding, last stage: head + loss)."""
        spec = self.spec
        if spec.arch == "resnet":
            return float(act.resnet_bytes(spec, w.batch, spec.image_size, w.compute)), 0.0
        if spec.arch == "vit":  # patch conv input (images) + classifier input; small
            img = w.batch * spec.channels * spec.image_size**2 * 4
            return float(img), float(w.batch * spec.hidden * w.compute + w.batch * 8)
        if self.graph_capture:
            return 0.0, 0.0
        if self.mcore:
            first = act.sum_items(megatron.embed_items(spec, w, self.knobs))
            last = act.sum_items(megatron.head_items(spec, w, self.knobs))
            return float(first), float(last)
        first = act.sum_items(hf_ops.embed_items(spec, w))
        if self.plan is not None and self.plan.recipe.adapters:
            last = act.sum_items(lora_ops.head_items(spec, w, self.plan))
        else:
            last = act.sum_items(hf_ops.head_items(spec, w))
        if (
            self.activation_model == "korthikanti"
        ):  # Megatron: ids 8sb, output layer + CE 4sbh(1 + v/h)
            first = 8 * w.tokens
            last = 4 * w.tokens * (spec.hidden + spec.vocab // w.tp)
        return float(first), float(last)

    def _layer_acts(
        self, tp: int, sp: bool, batch: int, recompute: str, w: act.Workload
    ) -> tuple[float, ...]:
        """Under the recompute policy: (saved bytes per layer; at the widest moment of the
        stage's first layer's backward (the end of backward): temporary, activations and weight
        grads of that layer; the transient of the start of backward)."""
        spec = self.spec
        if spec.arch == "resnet":
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        every = recompute_every(recompute)
        if self.activation_model == "korthikanti":
            mode = "full" if every else recompute
            full = act.korthikanti_layer_bytes(
                spec, batch, w.local_seq, tp, sp, "none", flash=self.backend != "math"
            )
            saved = act.korthikanti_layer_bytes(
                spec, batch, w.local_seq, tp, sp, mode, flash=self.backend != "math"
            )
            return (
                float(saved / (every or 1)),
                float(full * (every or 1) if every else 0),
                0.0,
                0.0,
                0.0,
                0.0,
            )
        if recompute != "none" and spec.is_hf:  # transformers' checkpointing: no KV cache
            w = replace(w, kv_cache=False)
        items = self._items(w)
        full = act.sum_items(items)
        n_in = w.tokens // (w.tp if w.sp else 1) * spec.hidden * w.residual
        k = every or 0
        saved = {"none": full, "selective": act.sum_items(items, drop_core=True)}.get(
            recompute, n_in / (k or 1)
        )
        if self.plan is not None and self.plan.recipe.adapters:
            m = lora_ops.layer_moment(spec, w, items, self.plan.recipe, self.plan.typical)
        else:
            m = bwd.layer_moment(
                spec, w, items, self.training.grad_bytes, recompute,
                megatron.score_grads(w) if self.mcore else 2,
            )  # fmt: skip
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
        if k == 1 and spec.is_encoder_decoder:  # T5's checkpointed blocks (t5_ops)
            saved, t0, g0, t1 = t5_ops.checkpointed(spec, w, self.training.grad_bytes)
            return saved, t1, float(a_end), g0, t0 + g0, 0.0
        return (
            float(saved), float(t_end), float(a_end), float(m.grads), float(t_start),
            float(m.freed),
        )  # fmt: skip


@dataclass
class _Stack:
    """What every pipeline rank of one ``PresetTerms.terms`` call shares."""

    layout: Layout
    batch: int
    recompute: str
    grad_accum: int
    pg: ParamGroups
    persist: bool
    moe_tp: float  # an MoE (or any non-dense) layer's tensor-parallel parameters per rank
    dense_tp: float  # a dense layer's
    expert_layer: float  # a layer's expert parameters per rank
    split: bool  # Megatron's uneven pipeline split
    chunks_by_stage: list[list[range]]
    w8: float  # bytes per parameter of the fp8 weight copies (Megatron's TE)
    acts: dict[str, tuple[float, ...]]  # _act_terms of a dense and an MoE layer

    @classmethod
    def of(
        cls,
        pt: PresetTerms,
        layout: Layout,
        batch: int,
        recompute: str,
        grad_accum: int,
        persistent_grads: bool | None,
    ) -> _Stack:
        spec, t, pg = pt.spec, layout.tp, pt.param_groups
        # k/v projections replicate across ranks when tp exceeds the KV heads
        kvp = (
            2 * spec.hidden * spec.kv_heads * spec.dhead if spec.n_heads and not spec.is_mla else 0
        )
        kv_rep = kvp / min(t, max(spec.kv_heads, 1)) - kvp / t
        split = pt.framework == "megatron" and megatron.uneven(pt.knobs)
        pp, vpp = layout.pp, layout.vpp
        chunks = (
            megatron.stage_chunks(spec.n_layers, pp, vpp, pt.knobs) if split else []
        ) or stage_chunks(spec.n_layers, pp, vpp)
        return cls(
            layout=layout,
            batch=batch,
            recompute=recompute,
            grad_accum=grad_accum,
            pg=pg,
            persist=grads_persist(layout, grad_accum, persistent_grads),
            moe_tp=pg.layer_tp / t + kv_rep,
            dense_tp=pg.dense_tp / t + kv_rep,
            expert_layer=pg.layer_expert / (layout.ep * layout.expert_tp),
            split=split,
            chunks_by_stage=chunks,
            w8=megatron.fp8_weight_cache_bytes(pt.knobs) if pt.framework == "megatron" else 0.0,
            acts={
                kind: pt._act_terms(layout, batch, recompute, kind == "dense")
                for kind in ("dense", "moe")
            },
        )


@dataclass
class _Rank:
    """One pipeline rank's layers."""

    i: int
    chunks: list[range]
    n_l: int
    n_dense: int  # the dense layers (an MoE's dense first layers, or its pattern's)
    n_moe: int
    is_first: bool
    is_last: bool
    mtp: int  # MTP layers run on the last stage, of the model's last layer's kind
    mtp_dense: int
    first_kind: str  # backward ends in the stage's first layer and starts in its last
    last_kind: str

    @classmethod
    def of(cls, pt: PresetTerms, st: _Stack, i: int) -> _Rank:
        spec, pp = pt.spec, st.layout.pp
        chunks = [c for c in st.chunks_by_stage[i] if len(c)]
        n_l = sum(len(c) for c in chunks)
        n_dense = sum(spec.dense_in(c) for c in chunks)
        is_last = i == pp - 1
        mtp = spec.mtp_layers if is_last and pt.framework == "megatron" else 0
        dense_first = not spec.is_moe or (bool(chunks) and spec.is_dense_layer(chunks[0][0]))
        dense_last = not spec.is_moe or (bool(chunks) and spec.is_dense_layer(chunks[-1][-1]))
        return cls(
            i=i,
            chunks=chunks,
            n_l=n_l,
            n_dense=n_dense,
            n_moe=n_l - n_dense,
            is_first=i == 0,
            is_last=is_last,
            mtp=mtp,
            mtp_dense=mtp if spec.is_dense_layer(spec.n_layers - 1) else 0,
            first_kind="dense" if dense_first else "moe",
            last_kind="dense" if dense_last else "moe",
        )


def stage_terms(pt: PresetTerms, st: _Stack, i: int) -> list[float]:
    """The peak terms of pipeline rank ``i`` (``PresetTerms.terms``)."""
    spec, t, pg, layout = pt.spec, st.layout.tp, st.pg, st.layout
    r = _Rank.of(pt, st, i)
    x = [0.0] * peak.N_TERMS
    trainable, expert, mtp_tp = _fill_params(pt, st, r, x)
    _fill_buffers(pt, st, r, x, expert, mtp_tp)
    _fill_activations(pt, st, r, x)
    layer_params = max(
        st.moe_tp + pg.layer_rep + (st.expert_layer if spec.is_moe else 0.0),
        st.dense_tp + pg.dense_rep if spec.is_moe and r.n_dense else 0.0,
    )
    job_terms(
        x,
        pt.training,
        layout,
        pt.gpu,
        pt.cuda,
        trainable=trainable,
        layer_params=layer_params,
        scratch=pg.step_scratch / t,
        persist=st.persist,
        framework=pt.framework,
        layer_comm=max(st.acts["dense"][10], st.acts["moe"][10] if r.n_moe else 0.0),
        mix=preset_mix(spec, pg),
    )
    if pt.framework == "megatron":
        megatron.optimizer_shards(pt.knobs, layout, x)
    if pt.plan is not None:
        lora_ops.fill_recipe(
            pt.plan, spec, pt.workload(layout, st.batch), x, recipe_stage(pt, st, r)
        )
    if pt.alloc_conf is not None:
        fill_fragmentation(
            pt, pt.alloc_conf, x, layout, st.batch, st.recompute,
            first=r.is_first, last=r.is_last, moe=r.n_moe > r.n_dense,
        )  # fmt: skip
    return x


def recipe_stage(pt: PresetTerms, st: _Stack, r: _Rank) -> lora_ops.RecipeStage:
    """What ``lora_ops.fill_recipe`` needs of one pipeline rank."""
    return lora_ops.RecipeStage(
        layers=[i for c in r.chunks for i in c],
        first=r.is_first,
        last=r.is_last,
        recompute=st.recompute,
        typical=st.acts["dense"][0],
        layer_input=st.batch
        * pt.seq
        // st.layout.cp
        * pt.spec.hidden
        * pt.workload(st.layout, st.batch).residual,
        largest=pt.param_groups.largest_tensor / st.layout.tp,
        precision=pt.training,
        scratch=pt.param_groups.step_scratch / st.layout.tp,
        cuda=pt.cuda,
    )


def _fill_params(pt: PresetTerms, st: _Stack, r: _Rank, x: list[float]) -> tuple[float, ...]:
    """The rank's parameters, trainable and frozen: (trainable, expert, MTP's tp part)."""
    spec, t, pg, pp = pt.spec, st.layout.tp, st.pg, st.layout.pp
    if spec.is_moe:
        dense = r.n_dense * (st.dense_tp + pg.dense_rep) + r.n_moe * (st.moe_tp + pg.layer_rep)
    else:
        dense = r.n_l * (st.moe_tp + pg.layer_rep)
    if r.is_first:
        dense += pg.embed_tp / t + pg.embed_rep
    if r.is_last:
        dense += pg.head_tp / t + pg.head_rep
        if (spec.tied_embeddings or r.mtp) and pp > 1:
            dense += pg.embed_tp / t  # Megatron keeps a copy of tied embeddings at the end
    expert = r.n_moe * st.expert_layer
    mtp_tp = 0.0
    if r.mtp:
        m_tp, m_rep = (st.dense_tp, pg.dense_rep) if r.mtp_dense else (st.moe_tp, pg.layer_rep)
        mtp_tp, mtp_rep = megatron.mtp_params(spec, m_tp, m_rep, t)
        dense += mtp_tp + mtp_rep
        expert += (r.mtp - r.mtp_dense) * st.expert_layer
    if pt.plan is not None and pt.plan.recipe.adapters:
        layers = [i for c in r.chunks for i in c]
        p_train: float = ftn.adapter_params(pt.plan, spec, layers, t)
        p_train += ftn.head_adapter_params(pt.plan, spec, t) if r.is_last else 0
        quant = ftn.quantized_params(pt.plan, spec, layers, t)
        p_frozen: float = dense - quant + quant * ftn.NF4_BYTES / pt.training.weight_bytes
        p_exp_train, p_exp_frozen = 0.0, expert
    elif pt.training.lora_rank:
        p_train, p_frozen = pt._lora_params(r.n_l, t), dense
        p_exp_train, p_exp_frozen = 0.0, expert
    else:
        p_train, p_frozen, p_exp_train, p_exp_frozen = dense, 0.0, expert, 0.0
    x[peak.P_TRAIN], x[peak.P_FROZEN] = p_train, p_frozen
    x[peak.P_EXP_TRAIN], x[peak.P_EXP_FROZEN] = p_exp_train, p_exp_frozen
    return p_train + p_exp_train, expert, mtp_tp


def _fill_buffers(
    pt: PresetTerms, st: _Stack, r: _Rank, x: list[float], expert: float, mtp_tp: float
) -> None:
    """The rank's layer count, per-layer activations, buffers and in-flight micro-batches."""
    spec, layout, acts, n_l = pt.spec, st.layout, st.acts, r.n_l
    stage_acts = r.n_dense * acts["dense"][0] + r.n_moe * acts["moe"][0]
    x[peak.A_LAYER], x[peak.N_LAYERS] = (stage_acts / n_l if n_l else 0.0), n_l
    x[peak.W_BUFFERS] = spec.buffer_bytes * n_l / max(spec.n_layers, 1)
    if pt.framework == "megatron":  # library workspaces, and the pipeline inputs kept after
        x[peak.W_BUFFERS] += megatron.workspace_bytes(pt.cuda, bool(r.n_moe) and pt.grouped_gemm)
        if spec.is_decoder:
            x[peak.W_BUFFERS] += megatron.pipeline_input_bytes(
                pt.workload(layout, st.batch), spec.hidden, layout.pp, layout.vpp, r.i
            )
    if pt.mcore and pt.knobs.cuda_graph_scope:  # the CUDA graphs' static buffers
        x[peak.W_BUFFERS] += graph_static_bytes(pt, st, r)
    if st.w8:  # fp8 copies of the TE Linears' weights (not norms, biases, embedding, head)
        lin = r.n_dense * st.dense_tp + r.n_moe * st.moe_tp if spec.is_moe else n_l * st.moe_tp
        x[peak.W_BUFFERS] += st.w8 * (lin + expert + mtp_tp)
    # parameters kept in fp32 in a 16-bit model: their extra bytes, as weights
    x[peak.W_BUFFERS] += r.n_moe * spec.fp32_moe_params * max(0, 4 - pt.training.weight_bytes)
    x[peak.INFLIGHT] = inflight(layout, st.grad_accum, r.i)
    if st.split and n_l and layout.pp > 1:  # Megatron's uneven chunks weigh by their layers
        x[peak.INFLIGHT] = (
            megatron.inflight_layers(
                st.chunks_by_stage[r.i], layout.pp, layout.vpp, st.grad_accum, r.i
            )
            / n_l
        )


def graph_static_bytes(pt: PresetTerms, st: _Stack, r: _Rank) -> float:
    """What rank ``r``'s CUDA graphs keep allocated for their replays
    (``cuda_graphs.static_bytes``): a static input per graphed layer forward in flight, the
    output gradients of each kind of graph, the last input gradient."""
    spec, layout, scope = pt.spec, st.layout, pt.knobs.cuda_graph_scope
    w = pt.workload(layout, st.batch)
    chunks = st.chunks_by_stage[r.i]
    counts = [
        cuda_graphs.graphed_layers(scope, spec.dense_in(c), len(c) - spec.dense_in(c))
        for c in chunks
    ]
    mtp = cuda_graphs.graphed_layers(scope, r.mtp_dense, r.mtp - r.mtp_dense)
    counts[-1] += mtp  # MTP layers run in the last chunk
    if layout.pp > 1:
        inflight = megatron.inflight_layers(
            [range(n) for n in counts], layout.pp, layout.vpp, st.grad_accum, r.i
        )
    else:  # one micro-batch is captured
        inflight = sum(counts)
    boundary = (w.tokens // w.tp if w.sp else w.tokens) * spec.hidden * w.compute
    n_sp = w.tokens // w.tp if w.sp else w.tokens
    shared = bool(spec.n_shared_experts or spec.shared_ffn)
    kinds = [
        k
        for k, n in (("dense", r.n_dense + r.mtp_dense), ("moe", r.n_moe + r.mtp - r.mtp_dense))
        if n
    ]
    outputs = tuple(
        cuda_graphs.graph_outputs(scope, k == "moe", shared, boundary, n_sp * spec.n_experts * 4)
        for k in kinds
        if cuda_graphs.graphed_layers(scope, k == "dense", k == "moe")
    )
    mask = w.batch * w.local_seq * w.seq  # the attention mask's bools, [b, 1, s/cp, s]
    return cuda_graphs.static_bytes(scope, inflight, boundary, mask, outputs)


def _fill_activations(pt: PresetTerms, st: _Stack, r: _Rank, x: list[float]) -> None:
    """The rank's saved activations and the moments of its backward."""
    spec, tr, t, pg, layout, acts = pt.spec, pt.training, st.layout.tp, st.pg, st.layout, st.acts
    a_first_layer, a_last_layer = acts[r.first_kind], acts[r.last_kind]
    first, last, held, ids_b, ce0 = acts["dense"][5:10]
    x[peak.A_FIRST] = first if r.is_first else 0.0
    x[peak.A_LAST] = last if r.is_last else 0.0
    if r.mtp:  # MTP layers run once per micro-batch, after the last chunk: not in flight
        x[peak.A_LAST] += r.mtp_dense * acts["dense"][0] + (r.mtp - r.mtp_dense) * acts["moe"][0]
    if r.is_last and layout.pp > 1 and pt.mcore:
        x[peak.A_LAST] += megatron.deferred_wgrad_bytes(
            spec, pt.workload(layout, st.batch), pt.knobs, st.grad_accum
        )
    # the last layer's widest moment: its temporaries, and the weight grads it made
    t_start, g_start, gone = a_last_layer[4] - a_last_layer[3], a_last_layer[3], 0.0
    grad_in = (
        ce0 if r.is_last else st.batch * pt.seq // layout.cp * spec.hidden * tr.compute_bytes / t
    )
    if r.is_last and spec.is_decoder:
        # by the last layer's widest moment the loss and head have run: their saved
        # tensors are gone (the held logits stay), the head's weight grad exists
        head = (pg.embed_tp if spec.tied_embeddings else pg.head_tp) / t + pg.head_rep
        if pt.plan is not None and pt.plan.recipe.adapters:  # the head's adapter, if any
            head = ftn.head_adapter_params(pt.plan, spec, t)
        if spec.is_encoder_decoder:  # T5's tied head: its gradient waits in autograd's
            t_start += head * tr.grad_bytes  # buffer until both embeddings' backward
        else:
            g_start += head * tr.grad_bytes
        gone = last - held
    if t_start + g_start - gone > grad_in:
        if spec.encoder_head and st.recompute == "none":
            # a classifier's loss is small: the start is inside the last layer's post-LN
            # backward, whose released tensors are activations gone, not negative temporaries
            t_start, gone = t_start + a_last_layer[11], gone + a_last_layer[11]
        x[peak.T_BWD0], x[peak.G_START], x[peak.A_GONE] = t_start, g_start, gone
    else:
        x[peak.T_BWD0] = grad_in
    x[peak.T_LAYER] = a_first_layer[1]
    x[peak.A_END] = a_first_layer[2]
    if tr.autocast and st.recompute == "full" and r.n_l:  # the forward's end (peak.py)
        x[peak.CASTS] = r.n_dense * _casts(pt, st, True) + r.n_moe * _casts(pt, st, False)
    x[peak.HELD] = held if r.is_last else 0.0
    x[peak.IDS] = ids_b if r.is_first else 0.0
    x[peak.G_WALK] = a_first_layer[3]
    if spec.is_encoder_decoder and recompute_every(st.recompute) == 1:
        x[peak.G_WALK] = 0.0  # T5's end: the first layer's recomputation, before its grads
    _fill_pending(pt, st, r, x)


def _casts(pt: PresetTerms, st: _Stack, dense: bool) -> float:
    """Autocast's cached 16-bit weight copies of one checkpointed layer: nothing saved keeps
    them, the cache does until the forward ends."""
    items = pt.layer_items(st.layout, st.batch, dense)
    return float(sum(i.nbytes for i in items if i.name.startswith("autocast.")))


def _fill_pending(pt: PresetTerms, st: _Stack, r: _Rank, x: list[float]) -> None:
    """Weight grads not yet produced at the end moment (inside the stage's first layer):
    that layer's, and an untied embedding's (a tied one waits in autograd's buffer)."""
    spec, tr, t, pg = pt.spec, pt.training, st.layout.tp, st.pg
    first_is_moe = r.first_kind == "moe"
    layer_tp = st.moe_tp if first_is_moe else (st.dense_tp if spec.is_moe else st.moe_tp)
    layer_rep = pg.layer_rep if (first_is_moe or not spec.is_moe) else pg.dense_rep
    if pt.activation_model == "ops" and r.n_l and not st.persist:
        emb = (0.0 if spec.tied_embeddings else pg.embed_tp / t) + pg.embed_rep
        if tr.lora_rank:
            x[peak.P_PEND] = pt._lora_params(1, t)
        else:
            x[peak.P_PEND] = layer_tp + layer_rep + (emb if r.is_first else 0.0)
            x[peak.P_PEND_EXP] = st.expert_layer if first_is_moe else 0.0
        if spec.tied_embeddings and r.is_first and r.is_last and spec.is_decoder:
            # the head's gradient of a tied embedding waits in autograd's input buffer
            # (a temporary) until the embedding's own backward adds to it and
            # AccumulateGrad makes it the .grad
            tied = pg.embed_tp / t
            x[peak.P_PEND] += tied
            x[peak.T_LAYER] += tied * tr.grad_bytes


def estimate_preset(spec: ModelSpec, job: Job) -> Bill:
    """The bill of training a described model (see ``gpumem.estimate``; ``job.batch_size``
    None: the default, and the bill says so); ``job.alloc_conf``: simulate the caching
    allocator under it (None: the flat fragmentation fraction)."""
    batch_size = inputs.DEFAULT_BATCH_SIZE if job.batch_size is None else job.batch_size
    seq, seq_source = inputs.seq_len(spec, job.seq_len)
    layout, fw, acts = job.layout, job.framework, job.activations
    check_applies(spec, job)
    layout.check(spec, seq_len=seq, even_split=not megatron.uneven(job.megatron))
    terms = PresetTerms(
        spec,
        job.training,
        job.gpu,
        seq,
        acts.attention,
        acts.dropout,
        acts.activation_model,
        job.device,
        acts.keep_logits,
        fw,
        job.moe.imbalance,
        job.moe.dispatcher,
        job.moe.grouped_gemm,
        acts.fused_ops,
        job.megatron,
        job.alloc_conf,
        None if job.finetune is None else ftn.describe(job.finetune, spec),
        target_seq=acts.target_seq,
    )
    stages = list(range(layout.pp))
    capture = None
    if fw == "torchtitan":
        rows = titan_terms(spec, job, terms, batch_size, seq)
        stages = stages[: len(rows)]
        items = (
            titan_moe.layer_items(spec, layout, batch_size, seq, job.recompute)
            if spec.is_moe
            else torchtitan.layer_items(spec, layout, batch_size, seq, job.recompute)
        )
    else:
        st = _Stack.of(
            terms, layout, batch_size, job.recompute, job.grad_accum, job.persistent_grads
        )
        rows, capture = terms.views(st, stages)
        items = terms.layer_items(layout, batch_size)
    simulated = fw != "torchtitan" or titan_simulated(job, terms)
    conf = terms.alloc_conf
    return make_bill(
        spec,
        spec.n_params,
        rows,
        stages,
        capture_by_stage=capture,
        layout=layout,
        training=job.training,
        gpu=job.gpu,
        framework=fw,
        cluster_model_state_bytes=terms.cluster_model_states(),
        inputs=bill_inputs(spec, job, terms, batch_size, seq),
        sources=bill_sources(job, seq_source),
        items=items,
        alloc_conf=None if conf is None or not simulated else conf.text or "default",
        reserved_note="framework='torchtitan' keeps the flat share with pp, loss_chunks, "
        "persistent gradients or float8"
        if not simulated and conf is not None
        else job.reserved_note,
    )


def bill_sources(job: Job, seq_source: str) -> dict[str, str]:
    """Where each input of a described model's bill came from."""
    acts = job.activations
    fields = ("batch_size", "grad_accum", "recompute", "training", "given")
    return {
        **inputs.sources(seq_source=seq_source, **{k: getattr(job, k) for k in fields}),
        "float8": "given",
        "target_seq": "given" if acts.target_seq else "default: seq_len",
        "sharding": job.sharding,
        "pipeline": titan_pipeline.pipeline_source(job.torchtitan),
        "finetune": "given",
        "loss": "keep_logits given"
        if acts.keep_logits is not None
        else f"default: the {job.framework} loop",
    }


def titan_simulated(job: Job, terms: PresetTerms) -> bool:
    """torchtitan's step is simulated from its own allocation order (titan_trace), except for
    what that order does not cover (pipeline parallelism among them)."""
    tt = job.torchtitan
    return (
        job.layout.pp == 1
        and not terms.spec.is_moe
        and torchtitan.simulated(
            terms.alloc_conf, tt.loss_chunks, bool(job.persistent_grads), tt.fp8_recipe
        )
    )


def check_applies(spec: ModelSpec, job: Job) -> None:
    """A knob given for what the model or layout does not have is one line naming both.

    Raises:
        ValueError: an MoE dispatcher or grouped GEMM for a dense model; Megatron's optimizer
            instances without its distributed optimizer, or a pipeline layout without pp.
    """
    moe = [n for n, v in (("moe_dispatcher", job.moe.dispatcher != "alltoall"),
                          ("moe_grouped_gemm", job.moe.grouped_gemm is not None)) if v]  # fmt: skip
    if moe and not spec.is_moe:
        raise ValueError(
            f"{', '.join(moe)} applies to a mixture of experts; {spec.name} has no experts "
            "(leave it out)"
        )
    target = job.activations.target_seq
    if target is not None and not spec.is_encoder_decoder:
        raise ValueError(
            f"target_seq={target} is the decoder's length of an encoder-decoder (T5); "
            f"{spec.name} has one stack: give seq_len alone"
        )
    k = job.megatron
    if k.dist_opt_instances > 1 and job.layout.zero != 1:
        raise ValueError(
            f"dist_opt_instances={k.dist_opt_instances} splits Megatron's distributed optimizer "
            f"(zero=1); the layout has zero={job.layout.zero}"
        )
    if k.pipeline_layout is not None and job.layout.pp == 1:
        raise ValueError(
            f"pipeline_layout {k.pipeline_layout!r} places layers on pipeline ranks; the layout "
            "has pp=1 (give pp and vpp = its chunks / pp)"
        )


def titan_terms(spec: ModelSpec, job: Job, terms: PresetTerms, batch: int, seq: int) -> list:
    """The peak terms of each torchtitan rank (its dense Llama; its Qwen3-MoE: ``titan_moe``):
    one row, or one per pipeline rank (``titan_pipeline``)."""
    if spec.arch != "llama":
        raise ValueError(
            f"framework='torchtitan' models torchtitan's Llama and Qwen3-MoE; got {spec.name!r} "
            f"({spec.arch})"
        )
    if job.grad_accum != 1:
        raise ValueError("framework='torchtitan' models one micro-batch per step: grad_accum=1")
    if spec.tied_embeddings:
        raise ValueError(
            "framework='torchtitan' does not model tied embeddings yet (torchtitan's 1B/3B "
            "gather [tok_embeddings, norm, lm_head] as one FSDP unit for the whole step)"
        )
    tt = job.torchtitan
    if spec.is_moe:
        given = [n for n, on in (("loss_chunks", tt.loss_chunks), ("fp8_recipe", tt.fp8_recipe),
                                 ("compiled_loss", tt.compiled_loss),
                                 ("persistent_grads", job.persistent_grads)) if on]  # fmt: skip
        titan_moe.check_moe(spec, job.layout, job.recompute, given)
        cuda = job.device == "cuda"
        return [titan_moe.moe_terms(spec, job.layout, job.gpu, batch=batch, seq=seq,
                                    recompute=job.recompute, cuda=cuda)]  # fmt: skip
    common: dict[str, Any] = {
        "batch": batch,
        "seq": seq,
        "recompute": job.recompute,
        "cuda": job.device == "cuda",
        "persistent_grads": bool(job.persistent_grads),
    }
    if job.layout.pp > 1:
        return titan_pipeline.pipeline_terms(spec, job.layout, job.gpu, knobs=tt, **common)
    row = torchtitan.terms(
        spec,
        job.training,
        job.layout,
        job.gpu,
        **common,
        loss_chunks=tt.loss_chunks,
        fp8_recipe=tt.fp8_recipe,
        fsdp_float8_all_gather=tt.fsdp_float8_all_gather,
        alloc_conf=terms.alloc_conf,
        compiled_loss=tt.compiled_loss,
    )
    return [row]


def bill_inputs(
    spec: ModelSpec, job: Job, terms: PresetTerms, batch: int, seq: int
) -> dict[str, Any]:
    """The inputs a described model's bill states."""
    tt, fw = job.torchtitan, job.framework
    return {
        "batch_size": batch,
        "seq_len": seq,
        **({"target_seq": terms.target_seq or seq} if spec.is_encoder_decoder else {}),
        "recompute": job.recompute,
        "grad_accum": job.grad_accum,
        "attention": terms.backend,
        "device": job.device,
        "precision": job.training.precision,
        "optimizer": job.training.optimizer,
        "framework": fw,
        "loss": loss_convention(
            fw, terms.holds_logits, upcast=not (spec.is_encoder or spec.is_encoder_decoder)
        ),
        "fused_ops": tuple(sorted(terms.fused)),
        **({"finetune": lora_ops.recipe_label(terms.plan)} if terms.plan is not None else {}),
        **(
            {"float8": torchtitan.float8_label(tt.fp8_recipe, tt.fsdp_float8_all_gather)}
            if tt.fp8_recipe is not None
            else {}
        ),
        **({"compiled_loss": True} if tt.compiled_loss else {}),
        **({"sharding": sharding_label(job)} if fw == "torchtitan" else {}),
        **(
            {"pipeline": titan_pipeline.pipeline_label(tt, job.layout.pp, batch)}
            if fw == "torchtitan" and job.layout.pp > 1
            else {}
        ),
        **(
            {"moe_imbalance": job.moe.imbalance, "moe_dispatcher": job.moe.dispatcher}
            if spec.is_moe
            else {}
        ),
    }


def sharding_label(job: Job) -> str:
    """``fsdp-full over 8 ranks``: the sharding a framework that decides it runs."""
    lay = job.layout
    return f"fsdp-{lay.fsdp} over {lay.shard_degree(job.gpu.gpus_per_node)} ranks"


def preset_mix(spec: ModelSpec, pg: ParamGroups) -> ParamMix:
    """Matrices vs the rest of a described model (Muon's and Adafactor's split): the layers'
    tensor-parallel and expert parameters are the hidden matrices (their few biases included),
    embeddings and an untied head are matrices too; Adafactor's factored vectors approximated as
    rows + columns of the layers' seven (llama) or four (gpt2) matrices and of the vocabulary
    matrices."""
    total = pg.total or 1
    hidden = (pg.n_layers - pg.n_dense) * (pg.layer_tp + pg.layer_expert) + pg.n_dense * pg.dense_tp
    vocab_mats = (pg.embed_tp > 0) + (pg.head_tp > 0)
    mats = hidden + pg.embed_tp + pg.head_tp
    per_layer = 7 if spec.arch == "llama" else 4
    factored = pg.n_layers * per_layer * (spec.hidden + spec.ffn) + vocab_mats * (
        spec.vocab + spec.hidden
    )
    h, q, kv = spec.hidden, spec.n_heads * spec.dhead, spec.kv_heads * spec.dhead
    cands = [(q, h), (kv, h), (h, q), (spec.dense_layer_ffn, h), (h, spec.dense_layer_ffn)]
    if spec.is_moe:
        cands += [(spec.moe_ffn, h), (h, spec.moe_ffn)]
    return ParamMix(hidden / total, mats / total, factored / total, max(cands, key=ns_width))
