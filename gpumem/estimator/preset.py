"""The estimate of a described model (preset, ``config.json``, ``ModelSpec``): its peak terms
from the activation rules (``activations.py``, ``backward.py``) and the shared job terms.

``PresetTerms`` holds everything about a job except its layout and micro-batch, and turns those
two into peak terms; the planner's sweep asks it for thousands of layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.estimator import activations as act
from gpumem.estimator import backward as bwd
from gpumem.estimator import inputs, peak
from gpumem.estimator.bill import Bill, make_bill
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.specs import ModelSpec, param_groups
from gpumem.estimator.states import Training
from gpumem.estimator.terms import (
    cluster_states,
    grads_persist,
    inflight,
    job_terms,
    recompute_every,
    split_layers,
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
            raise ValueError(
                f"unknown attention {a!r}; use sdpa, flash, efficient, cpu-flash, eager"
            )
        if not self.cuda:
            return "cpu-flash" if self.dropout == 0 else "math"
        return "efficient" if self.training.compute_bytes == 4 else "flash"

    def workload(self, layout: Layout, batch: int) -> act.Workload:
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
            keep_logits=self.keep_logits,
        )

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
        self,
        layout: Layout,
        batch: int,
        recompute: str,
        grad_accum: int,
        persistent_grads: bool | None,
    ) -> list[list[float]]:
        """The peak terms of the first and the last pipeline stage of ``layout``.

        Middle stages never exceed the first: it holds at least as many layers (the remainder
        of an uneven split goes to the first stages), at least as many in-flight micro-batches,
        and the embedding; the last stage holds the head and the loss.
        """
        spec, tr, t = self.spec, self.training, layout.tp
        pg = param_groups(spec)
        a_layer, t_end, a_end, g_walk, t_start, first, last, held, ids, ce0 = self._act_terms(
            layout.tp, layout.sp, batch, recompute
        )
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
            job_terms(
                x,
                tr,
                layout,
                self.gpu,
                self.cuda,
                trainable=trainable,
                layer_params=layer_params,
                scratch=pg.step_scratch / t,
                persist=persist,
            )
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
            held = (
                act.sum_items([i for i in act.head_items(self.spec, w) if i.name == "logits"])
                if dec
                else 0
            )
            ids = (
                act.sum_items([i for i in act.embed_items(self.spec, w) if i.name == "embed.ids"])
                if dec
                else 0
            )
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
            return 0.0, 0.0, 0.0, 0.0, 0.0
        every = recompute_every(recompute)
        if self.activation_model == "korthikanti":
            mode = "full" if every else recompute
            full = act.korthikanti_layer_bytes(
                spec, batch, self.seq, tp, sp, "none", flash=self.backend != "math"
            )
            saved = act.korthikanti_layer_bytes(
                spec, batch, self.seq, tp, sp, mode, flash=self.backend != "math"
            )
            return (
                float(saved / (every or 1)),
                float(full * (every or 1) if every else 0),
                0.0,
                0.0,
                0.0,
            )
        items = act.layer_items(spec, w)
        full = act.sum_items(items)
        n_in = w.tokens // (w.tp if w.sp else 1) * spec.hidden * w.residual
        k = every or 0
        saved = {"none": full, "selective": act.sum_items(items, drop_core=True)}.get(
            recompute, n_in / (k or 1)
        )
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


def estimate_preset(
    spec: ModelSpec,
    *,
    training: Training,
    layout: Layout,
    gpu: GPU,
    batch_size: int,
    seq_len: int | None,
    recompute: str,
    grad_accum: int,
    attention: str,
    dropout: float,
    activation_model: str,
    device: str,
    keep_logits: bool,
    persistent_grads: bool | None,
) -> Bill:
    """The bill of training a described model (see ``gpumem.estimate``)."""
    seq, seq_source = inputs.seq_len(spec, seq_len)
    layout.check(spec, seq_len=seq)
    if activation_model not in ("ops", "korthikanti"):
        raise ValueError(
            f"activation_model must be 'ops' or 'korthikanti', got {activation_model!r}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    terms = PresetTerms(
        spec, training, gpu, seq, attention, dropout, activation_model, device, keep_logits
    )
    return make_bill(
        spec,
        spec.n_params,
        terms.terms(layout, batch_size, recompute, grad_accum, persistent_grads),
        layout=layout,
        training=training,
        gpu=gpu,
        cluster_model_state_bytes=terms.cluster_model_states(),
        inputs={
            "batch_size": batch_size,
            "seq_len": seq,
            "recompute": recompute,
            "grad_accum": grad_accum,
            "attention": terms.backend,
            "device": device,
            "precision": training.precision,
            "optimizer": training.optimizer,
        },
        sources=inputs.sources(
            seq_source=seq_source,
            batch_size=batch_size,
            grad_accum=grad_accum,
            recompute=recompute,
            training=training,
        ),
        items=terms.layer_items(layout, batch_size),
    )
