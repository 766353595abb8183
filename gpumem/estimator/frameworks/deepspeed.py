"""DeepSpeed ZeRO's conventions: its ``zero_optimization`` knobs, the buffers its ZeRO-1/2/3 code
keeps, the pinned host memory of offload, and its own published estimator's formulas.

What lives on one GPU, read from the ZeRO code (``deepspeed/runtime/zero/``), Ψ trainable
parameters on the rank, N ranks sharing the ZeRO state, bf16/fp16 mixed precision:

==================  ===========================================================================
16-bit weights      ZeRO-1/2: the whole flat ``bit16_groups_flat`` (2Ψ, ``stage_1_and_2.py``);
                    ZeRO-3: the partition ``fp16_partitioned_groups_flat`` (2Ψ/N, ``stage3.py``);
                    ``offload_param`` (ZeRO-3 only) moves the partition to pinned host memory
fp32 master         ``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``: 4Ψ/N
optimizer state     Adam's two fp32 moments of the master partition: 8Ψ/N
16-bit gradients    ZeRO-1: every ``.grad`` (2Ψ), reduced at the accumulation boundary;
                    ZeRO-2: ``grads_in_partition`` (2Ψ/N): each gradient is copied into the IPG
                    bucket as backward makes it, reduced, and only this rank's slice is kept
                    (``reduce_independent_p_g_buckets_and_remove_grads``, ``copy_grads_in_
                    partition``); ZeRO-3: ``grad_partitions_flat_buffer`` (2Ψ/N). With ZeRO the
                    gradients accumulate in the model dtype (``engine.get_data_types``:
                    ``grad_accum_dtype = model_dtype``)
IPG bucket          ``contiguous_gradients`` (default on): ``reduce_bucket_size`` elements of the
                    16-bit dtype (``setup_buckets``; ZeRO-3: ``_setup_for_real_optimizer``),
                    two of them when ``overlap_comm`` at ZeRO-1/2 (double buffering); allocated
                    at its full size whatever the model's size
fp32 gradients      made in the step only: ``flatten(averaged_gradients).to(fp32)`` (4Ψ/N, with
                    the 2Ψ/N flattened 16-bit copy alive while it is made), freed after the step
all-gather          ZeRO-1/2 gather the updated weights in place (``all_gather_into_tensor`` into
                    the flat buffer): ``allgather_bucket_size`` costs nothing on torch >= 1.13
ZeRO-3 gather       the current module's parameters, what ``stage3_prefetch_bucket_size`` fetches
                    ahead (while fewer than ``stage3_max_live_parameters`` are live), and at the
                    turn from forward to backward the trailing parameters reused within
                    ``stage3_max_reuse_distance`` (``partitioned_param_coordinator.py``
                    ``__params_to_release``: a module whose next use is within the distance is
                    not released; forward's remaining modules plus backward's first ones count,
                    so about half the distance stays gathered); one layer's full 16-bit
                    gradients before they are copied into the IPG bucket
==================  ===========================================================================

So gpumem's ``deepspeed`` bill keeps 2Ψ + 2Ψ/N + 12Ψ/N of model states at ZeRO-2 (t5-3b on 8
GPUs: 9.96 GiB) plus the IPG bucket (1 GB at the default 5e8 elements in bf16) and, in the
step, 6Ψ/N of fp32 gradients and their flattened source. DeepSpeed's own
``estimate_zero2_model_states_mem_needs`` prints 4Ψ + 16Ψ/N (15.93 GB): it keeps the full 16-bit
gradients (2Ψ) and the fp32 gradient partition (4Ψ/N) as if both lived through the step, and
no bucket. The code keeps neither at the same time: the full gradients exist at ZeRO-2 only
one bucket at a time, and the fp32 partition only in the step. gpumem follows the code (what is
allocated at the peak); :func:`published_estimate` reproduces DeepSpeed's formulas exactly, for
comparison.

Offload (``offload_optimizer`` / ``offload_param`` to ``cpu``) moves the master weights,
optimizer state and fp32 gradients (and ZeRO-3's 16-bit partitions) to pinned host memory:
:func:`host_bytes` is that bill per node (``Bill.host_bytes``), the bare sum; DeepSpeed's
estimator multiplies its figures by ``additional_buffer_factor`` (1.5) as headroom. Not billed:
ZeRO-1/2 offload's GPU staging buffer of the largest parameter
(``temp_grad_buffer_for_gpu_offload``) and the norms and biases that
``stage3_param_persistence_threshold`` keeps unpartitioned (well under 0.1 % of a transformer).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig) defaults; ds_config spellings
_OFFLOAD = ("none", "cpu")
_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
}
# ds_config keys that change no memory gpumem bills (accepted so a real ds_config loads)
_IGNORED = {
    "stage",
    "reduce_scatter",
    "allgather_partitions",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters",
    "use_multi_rank_bucket_allreduce",
    "stage3_model_persistence_threshold",
    "memory_efficient_linear",
}


@dataclass(frozen=True)
class ZeroConfig:
    """The memory knobs of DeepSpeed's ``zero_optimization`` section (its key names, its
    defaults). ``overlap_comm=None`` is DeepSpeed's dynamic default: on at ZeRO-3, else off.

    Example:
        >>> ZeroConfig.from_dict({"reduce_bucket_size": 2e8, "offload_optimizer": "cpu"})
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and v.is_integer() and f.type == "int":
                v = int(v)  # ds_config sizes are often written 5e8
                object.__setattr__(self, f.name, v)
            if f.name.startswith("offload_"):
                v = offload_device(v)
                object.__setattr__(self, f.name, v)
                if v not in _OFFLOAD:
                    raise ValueError(
                        f"deepspeed {f.name} must be one of {', '.join(_OFFLOAD)}, got {v!r}"
                    )
            elif f.type in ("bool", "bool | None"):
                if not (isinstance(v, bool) or (v is None and f.name == "overlap_comm")):
                    raise ValueError(f"deepspeed {f.name} must be true or false, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"deepspeed {f.name} must be an integer >= 0, got {v!r}")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any] | ZeroConfig | None) -> ZeroConfig:
        """From a ds_config's ``zero_optimization`` dict (or a whole ds_config holding one).
        Sizes may be floats (``5e8``); offload may be ``"cpu"`` or ``{"device": "cpu", ...}``.

        Raises:
            ValueError: an unknown key or a bad value, naming the valid ones.
        """
        if isinstance(cfg, ZeroConfig):
            return cfg
        cfg = dict(cfg or {})
        if isinstance(cfg.get("zero_optimization"), dict):
            cfg = dict(cfg["zero_optimization"])
        known = {f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in cfg.items():
            name = _ALIASES.get(key, key)
            if name in _IGNORED:
                continue
            if name not in known:
                raise ValueError(
                    f"unknown deepspeed key {key!r}; choose from {', '.join(sorted(known))}"
                )
            if name.startswith("offload_"):
                value = offload_device(value)
            elif value == "auto":
                raise ValueError(
                    f"deepspeed {key}='auto' is filled in by the HF Trainer; give a number "
                    "(it sets reduce_bucket_size = hidden², stage3_prefetch_bucket_size = "
                    "0.9·hidden², stage3_param_persistence_threshold = 10·hidden)"
                )
            elif isinstance(value, float) and value.is_integer():
                value = int(value)
            out[name] = value
        return cls(**out)

    @staticmethod
    def stage_of(cfg: dict[str, Any] | ZeroConfig | None) -> int | None:
        """The ZeRO ``stage`` a ds_config dict names (None when it names none)."""
        if not isinstance(cfg, dict):
            return None
        zero = cfg.get("zero_optimization", cfg)
        stage = zero.get("stage") if isinstance(zero, dict) else None
        return None if stage is None else int(stage)

    def overlap(self, stage: int) -> bool:
        return stage == 3 if self.overlap_comm is None else self.overlap_comm


def offload_device(value: Any) -> Any:
    """An offload setting as DeepSpeed's device name: ``{"device": "cpu", ...}``, ``"CPU"``,
    ``True`` (the ``--offload-optimizer`` / ``offload_optimizer=True`` spellings) -> ``"cpu"``;
    ``None`` / ``False`` -> ``"none"``; anything else as given (checked by ``ZeroConfig``)."""
    if isinstance(value, dict):
        value = value.get("device", "none")
    if value is None or value is False:
        return "none"
    if value is True:
        return "cpu"
    return value.lower() if isinstance(value, str) else value


def gpu_buffers(
    cfg: ZeroConfig,
    stage: int,
    *,
    trainable: float,
    layer_params: float,
    weight_bytes: float,
    grad_bytes: float,
) -> tuple[float, float]:
    """(steady, gathered) bytes of DeepSpeed's buffers on one GPU (see the module table).

    ``steady``: the IPG bucket(s), through backward and (conservatively) the step. ``gathered``
    (ZeRO-3, forward and backward only): the live unsharded parameters and one layer's
    unsharded gradients.

    Args:
        trainable: trainable parameters on this rank before sharding.
        layer_params: parameters of one layer (one module gathered at a time).
    """
    if stage < 1:
        return 0.0, 0.0
    buckets = 0 if not cfg.contiguous_gradients else (2 if cfg.overlap(stage) and stage < 3 else 1)
    steady = buckets * cfg.reduce_bucket_size * weight_bytes  # the model dtype's bucket
    if stage < 3:
        return float(steady), 0.0
    retained = min(cfg.stage3_max_reuse_distance / 2, trainable)
    prefetch = min(
        cfg.stage3_prefetch_bucket_size,
        max(0.0, cfg.stage3_max_live_parameters - layer_params - retained),
    )
    live = min(trainable, layer_params + retained + prefetch)
    return float(steady), live * weight_bytes + layer_params * grad_bytes


def step_bytes(cfg: ZeroConfig, stage: int, trainable_shard: float, master: bool) -> float:
    """The step's temporary on one GPU: the fp32 gradient partition and the flattened 16-bit
    copy it is made from (ZeRO-1/2 ``step``; ZeRO-3 ``_prepare_fp32_grad_for_sub_group``, one
    ``sub_group_size`` group at a time)."""
    if not master:
        return 0.0
    n = min(trainable_shard, cfg.sub_group_size) if stage >= 3 else trainable_shard
    return n * (4 + 2)


def host_bytes(
    cfg: ZeroConfig,
    stage: int,
    *,
    trainable: float,
    n_shard: int,
    gpus_per_node: int,
    state_bytes: float,
    weight_bytes: float = 2,
) -> int:
    """Pinned host memory of one node under offload (0 without), in bytes.

    Per GPU, for its ZeRO partition of ``trainable / n_shard`` parameters: ``offload_optimizer``
    keeps the fp32 master and optimizer state (``state_bytes`` per parameter, master included),
    the fp32 gradient partition (4 B, pinned at init: ``initialize_optimizer_states``) and a
    16-bit copy for the way back (ZeRO-1/2 ``param_buffer_of_bit16_for_cpu_offload_groups``;
    ZeRO-3's 16-bit ``grad_partitions_flat_buffer``); ``offload_param`` (ZeRO-3) the 16-bit
    parameter partition. Times the GPUs of a node.
    """
    per_param = 0.0
    if cfg.offload_optimizer == "cpu":
        per_param += state_bytes + 4 + weight_bytes
    if cfg.offload_param == "cpu" and stage >= 3:
        per_param += weight_bytes
    return int(trainable / max(n_shard, 1) * per_param * gpus_per_node)


def published_estimate(
    total_params: int | float,
    *,
    stage: int,
    largest_layer_params: int | float = 0,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer: bool = True,
    offload_param: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) as DeepSpeed's own estimator computes them:
    ``estimate_zero2_model_states_mem_needs`` (``stage_1_and_2.py``) and
    ``estimate_zero3_model_states_mem_needs`` (``stage3.py``), same arguments (``cpu_offload`` is
    ``offload_optimizer``, ``cpu_offload_params`` is ``offload_param``), same integer
    truncations. DeepSpeed prints them ``f"{b / 2**30:.2f}GB"``.

    This is DeepSpeed's formula, not gpumem's bill: see the module docstring for the difference.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if stage in (1, 2):
        if offload_optimizer:
            gpu = 2 * total_params
            cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
        else:
            gpu = 4 * total_params + int(16 * total_params / total_gpus)
            cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
        return int(cpu), int(gpu)
    if stage != 3:
        raise ValueError(f"DeepSpeed's estimator covers ZeRO stages 1-3, got stage={stage!r}")
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if offload_optimizer:
        if offload_param:
            gpu = largest
            k = 18 * gpus_factor
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            k = 16 * gpus_factor
        cpu = total_params * (k if zero_init else max(4 * num_gpus_per_node, k))
        cpu *= additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        base = largest_layer_params if zero_init else total_params
        cpu = base * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def knobs_from_cli(pairs: list[str] | None, path: str | None) -> dict[str, Any] | None:
    """The ``deepspeed=`` dict of ``--ds-config FILE`` (a ds_config JSON: its
    ``zero_optimization`` section) and ``--deepspeed KEY=VALUE`` pairs on top (numbers such as
    ``5e8``, ``true``/``false``, ``cpu``/``none``); None when neither is given.

    Raises:
        ValueError: an unreadable file or a pair without ``=``.
    """
    if not pairs and not path:
        return None
    out: dict[str, Any] = {}
    if path:
        import json

        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--ds-config {path}: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--ds-config {path}: a ds_config is a JSON object")
        out.update(cfg.get("zero_optimization", cfg) if isinstance(cfg, dict) else {})
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(
                f"--deepspeed takes KEY=VALUE (e.g. reduce_bucket_size=2e8), got {pair!r}"
            )
        out[key.strip()] = _value(text.strip())
    return out


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() else number
