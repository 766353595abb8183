"""How a job spreads over GPUs: data, tensor, pipeline, context and expert parallelism, and
sharding.

``dp · tp · pp · cp`` is the number of GPUs. Context parallelism (``cp``) splits every sequence
over ``cp`` ranks (ring or all-gather attention, as Megatron and torchtitan do it); those ranks
hold the same parameters, so sharding (ZeRO, Megatron's distributed optimizer, FSDP) runs over
``dp · cp`` ranks. Experts follow Megatron-core's folding of the dense grid: the ``dp · cp · tp``
ranks of a pipeline stage are regrouped into ``ep`` expert-parallel × ``etp`` expert-tensor-
parallel × the experts' data parallelism, so ``ep · etp`` must divide ``dp · cp · tp`` and the
experts' data-parallel (sharding) degree is ``dp · cp · tp / (ep · etp)`` (the issue's
``dp · tp / (ep · etp)`` at ``cp = 1``). ``etp`` defaults to ``tp``. ZeRO stage 1/2/3 shards
optimizer state / + gradients / + weights over the data-parallel group; FSDP ``"full"`` is
ZeRO-3, ``"hybrid"`` shards within a node and replicates across nodes.

Example:
    >>> lay = Layout(dp=8, tp=8, pp=1, zero=1)
    >>> lay.check(resolve_model("llama-2-70b"), n_gpus=64)     # raises ValueError with reasons
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.estimator.model_spec import ModelSpec


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one training job.

    Attributes:
        dp: data-parallel degree. tp: tensor-parallel. pp: pipeline stages.
        ep: expert-parallel degree (MoE; ``ep · etp`` divides ``dp · cp · tp``).
        zero: ZeRO stage 0..3 over the data-parallel group (``dp · cp`` ranks).
        fsdp: None, ``"full"`` (= ZeRO-3) or ``"hybrid"`` (ZeRO-3 inside a node).
        sp: Megatron sequence parallelism (needs tp > 1).
        vpp: virtual pipeline stages per rank (interleaved 1F1B).
        cp: context-parallel degree: each sequence split over ``cp`` ranks.
        etp: expert tensor parallelism: each expert's matrices split over ``etp`` ranks
            (default: ``tp``, Megatron's default; must divide ``tp``).

    Example:
        >>> Layout(dp=4, tp=2, pp=1, zero=2).n_gpus
        8
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    fsdp: str | None = None
    sp: bool = False
    vpp: int = 1
    cp: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        bad = self._shape_errors()
        if bad:
            raise ValueError(f"invalid layout {self}: " + "; ".join(bad))

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """Ranks each expert's matrices are split over (``etp``, default ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The experts' data-parallel degree: ``dp · cp · tp / (ep · etp)``."""
        return self.dp * self.cp * self.tp // (self.ep * self.expert_tp)

    @property
    def stage(self) -> int:
        """The effective sharding stage: FSDP counts as ZeRO-3."""
        return 3 if self.fsdp else self.zero

    def shard_degree(self, gpus_per_node: int = 8, expert: bool = False) -> int:
        """Ranks a sharded state is split over: ``dp · cp`` (the experts' data-parallel degree
        for experts); hybrid: within a node."""
        group = self.expert_dp if expert else self.dp * self.cp
        if self.fsdp == "hybrid":
            per_node = max(1, gpus_per_node // (self.tp * self.pp)) if gpus_per_node else group
            return max(1, min(group, per_node))
        return group

    def _shape_errors(self) -> list[str]:
        out = []
        for name in ("dp", "tp", "pp", "ep", "vpp", "cp", "etp"):
            v = getattr(self, name)
            if name == "etp" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{name} must be an integer >= 1, got {v!r}")
        if out:
            return out
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.fsdp not in (None, "full", "hybrid"):
            out.append(f"fsdp must be None, 'full' or 'hybrid', got {self.fsdp!r}")
        if self.fsdp and self.zero not in (0, 3):
            out.append(
                f"fsdp={self.fsdp!r} already shards everything (ZeRO-3); drop zero={self.zero}"
            )
        etp = self.expert_tp
        if self.tp % etp:
            out.append(
                f"etp={etp} must divide tp={self.tp} (each expert is split over a subgroup of "
                "the tensor-parallel ranks; etp=1 keeps experts whole)"
            )
        if (self.dp * self.cp * self.tp) % (self.ep * etp):
            out.append(
                f"ep*etp = {self.ep}*{etp} = {self.ep * etp} must divide dp*cp*tp = "
                f"{self.dp * self.cp * self.tp} (Megatron folds the experts over the data-, "
                "context- and tensor-parallel ranks of a stage)"
            )
        if self.sp and self.tp == 1:
            out.append("sequence parallelism (sp) needs tp > 1")
        if self.vpp > 1 and self.pp == 1:
            out.append(f"vpp={self.vpp} (interleaved pipeline) needs pp > 1")
        return out

    def errors(
        self,
        model: ModelSpec,
        n_gpus: int | None = None,
        seq_len: int | None = None,
        even_split: bool = True,
    ) -> list[str]:
        """Every reason this layout cannot run ``model`` (empty when it can); ``even_split``
        False: the caller splits the pipeline itself (Megatron's uneven stages)."""
        out = []
        if n_gpus is not None and self.n_gpus != n_gpus:
            out.append(
                f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.n_gpus}, "
                f"not {n_gpus} GPUs"
            )
        m, t = model, self.tp
        if m.arch == "resnet":
            if t > 1 or self.pp > 1 or self.ep > 1 or self.cp > 1:
                out.append(
                    f"{m.name}: only data parallelism (with ZeRO/FSDP) is modelled for a ResNet"
                )
            return out
        if m.n_heads % t:
            out.append(f"attention heads {m.n_heads} not divisible by tp={t}")
        kv = m.kv_heads
        if kv % t and t % kv:
            out.append(f"KV heads {kv} neither divisible by tp={t} nor dividing it (replication)")
        if m.ffn % t:
            out.append(f"ffn size {m.ffn} not divisible by tp={t}")
        if self.pp > m.n_layers:
            out.append(f"pp={self.pp} exceeds the {m.n_layers} layers")
        if even_split and self.vpp > 1 and m.n_layers % (self.pp * self.vpp):
            out.append(f"{m.n_layers} layers not divisible by pp*vpp = {self.pp * self.vpp}")
        if self.ep > 1 or self.etp is not None:
            if not m.is_moe:
                what = f"ep={self.ep}" if self.ep > 1 else f"etp={self.etp}"
                out.append(f"{what} but {m.name} has no experts")
            elif m.n_experts % self.ep:
                out.append(f"{m.n_experts} experts not divisible by ep={self.ep}")
            elif m.moe_ffn % self.expert_tp:
                out.append(f"expert ffn size {m.moe_ffn} not divisible by etp={self.expert_tp}")
        if self.cp > 1:
            if m.arch == "vit":
                out.append("context parallelism (cp) splits token sequences: not for a ViT")
            elif seq_len is not None and seq_len % (2 * self.cp):
                out.append(
                    f"context parallelism splits seq_len {seq_len} into 2*cp = {2 * self.cp} "
                    "chunks (load-balanced causal attention): not divisible"
                )
        if self.sp and seq_len is not None and (seq_len // self.cp) % t:
            out.append(
                f"sequence parallelism splits the {seq_len // self.cp} tokens per rank, not "
                f"divisible by tp={t}"
            )
        return out

    def check(
        self,
        model: ModelSpec,
        n_gpus: int | None = None,
        seq_len: int | None = None,
        even_split: bool = True,
    ) -> None:
        """Raise ValueError listing every reason this layout cannot run ``model``."""
        bad = self.errors(model, n_gpus, seq_len, even_split)
        if bad:
            raise ValueError(
                f"layout {self.describe()} is invalid for {model.name}: " + "; ".join(bad)
            )

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.sp:
            parts.append("sp")
        if self.fsdp:
            parts.append(f"fsdp-{self.fsdp}")
        elif self.zero:
            parts.append(f"zero{self.zero}")
        return "/".join(parts)
