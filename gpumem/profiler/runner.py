"""Profile N training steps of a built-in model or a local Hugging Face ``config.json``.

Used by ``gpumem profile``; handy in notebooks too:

    >>> from gpumem.profiler.runner import profile_model
    >>> rep = profile_model("llama", size="7b", batch_size=1, seq_len=4096, fake=True)
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpumem.profiler.extrapolate import PROFILED, NotExtrapolated, twin_problem
from gpumem.profiler.extrapolate import extrapolate as extrapolate_report
from gpumem.profiler.report import Report
from gpumem.profiler.samples import SampleRecorder

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
PRECISIONS = ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16")


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer | None:
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-4)


# what sizes a causal LM, under the names transformers' configs share (attribute_map gives the
# family's own names, e.g. GPT-2's n_embd); a config that leaves one out would silently get the
# family's default (a full-size model), so it is refused instead
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def hf_config(path: Path) -> Any:
    """The transformers config of a local ``config.json``, checked to give the fields that size
    the model (nothing is downloaded).

    Raises:
        ValueError: not JSON, no ``model_type``, an unknown family, a missing size field, or
            attention heads that do not divide (as ``gpumem estimate`` refuses them).
    """
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"{path} is a Hugging Face config: install transformers (pip install transformers)"
        ) from None
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); give a config.json") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{path} has no 'model_type'; it does not look like a transformers config")
    families = transformers.CONFIG_MAPPING  # lazy: its .get() finds nothing, `in` and [] do
    kind = raw["model_type"]
    family = families[kind] if isinstance(kind, str) and kind in families else None
    problem = _heads_problem(raw, getattr(family, "attribute_map", {}))
    if problem:  # else torch's truncated error from deep in the first forward pass
        raise ValueError(f"{path}: {problem}")
    errors: tuple[type[Exception], ...] = (ValueError, KeyError, TypeError)
    with contextlib.suppress(ImportError):  # transformers 5 validates through huggingface_hub
        from huggingface_hub.errors import StrictDataclassError

        errors += (StrictDataclassError,)
    try:
        cfg = transformers.AutoConfig.for_model(**raw)
    except errors as exc:
        raise ValueError(f"{path}: transformers cannot read it ({exc})") from None
    aliases = {v: k for k, v in getattr(cfg, "attribute_map", {}).items()}
    missing = [
        name
        for name in _HF_REQUIRED
        if name not in raw and not any(a in raw for a, std in aliases.items() if std == name)
    ]
    if missing:
        family = {std: a for a, std in aliases.items()}
        names = [f"{m} ({family[m]})" if m in family else m for m in missing]
        raise ValueError(
            f"{path}: model_type {raw['model_type']!r} needs {', '.join(names)}; the config "
            "gives none of them, so transformers would build its default size instead: add them"
        )
    return cfg


def _heads_problem(raw: dict, attribute_map: dict[str, str]) -> str | None:
    """What is wrong with a config's attention heads (its own names, or the family's aliases
    in ``attribute_map``: GPT-2's ``n_head``), None if nothing."""

    def field(name: str) -> tuple[str, int]:
        """(the name the config uses, its value; 0 when absent or not a positive int)."""
        key = name if name in raw else attribute_map.get(name, name)
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
        return key, 0

    (hn, hidden), (n, heads), (kn, kv) = (
        field(f) for f in ("hidden_size", "num_attention_heads", "num_key_value_heads")
    )
    if heads and hidden and raw.get("head_dim") is None and hidden % heads:
        return f"{hn} {hidden} is not divisible by {n} {heads}; change them, or give head_dim"
    if heads and kv and heads % kv:
        return (
            f"{n} {heads} is not a multiple of {kn} {kv}; grouped-query attention needs whole "
            "groups"
        )
    return None


# a config.json's dtype names -> profile precisions; transformers builds in the config's dtype
# unless told otherwise, so that is the default precision of a config.json
_CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def build_precision(model: str, precision: str | None) -> str:
    """The precision ``profile_model`` builds ``model`` in: ``precision`` when given, else the
    ``torch_dtype`` (``dtype``) of a config.json, else ``fp32``."""
    if precision is not None or not is_config_path(model):
        return precision or "fp32"
    try:
        raw = json.loads(Path(model).read_text())
    except (OSError, ValueError):
        return "fp32"  # the runner reports what is wrong with the file
    name = (raw.get("dtype") or raw.get("torch_dtype")) if isinstance(raw, dict) else None
    return _CONFIG_DTYPES.get(str(name).removeprefix("torch."), "fp32")


def _hf_model(path: Path, dtype: torch.dtype | None):
    import transformers

    cfg = hf_config(path)
    from gpumem.models import default_dtype

    # explicit: from_config would otherwise build in the config's dtype, whatever was asked
    # (transformers 5 calls the keyword dtype, 4 torch_dtype)
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with default_dtype(dtype):
        model = transformers.AutoModelForCausalLM.from_config(cfg, **{key: dtype or torch.float32})
    return model, getattr(cfg, "vocab_size", 32000)


def profile_model(
    model: str,
    *,
    size: str | None = None,
    batch_size: int = 2,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    precision: str | None = None,
    checkpointing: bool = False,
    fake: bool = False,
    device: str = "cpu",
    steps: int = 2,
    mode: str = "exact",
    progress: Any = None,
    alloc_conf: str | None = None,
    extrapolate: bool = False,
    notice: Any = None,
) -> Report:
    """Build ``model``, run ``steps`` training steps inside ``gpumem.profile``, return the report.

    Args:
        model: ``gpt2``, ``llama``, ``mixtral``, ``vit``, ``resnet``, or a path to a local
            transformers ``config.json`` (causal LMs; nothing is downloaded).
        size: preset size of a built-in model (see ``gpumem.models.PRESETS``; default
            ``tiny``); a config.json gives its own size, so a size with one is an error.
        precision: parameter dtype (``fp32``, ``bf16``, ``fp16``) or fp32 weights under autocast
            (``amp-bf16``, ``amp-fp16``); default: a config.json's ``torch_dtype``, else fp32
            (:func:`build_precision`).
        fake: build everything under ``gpumem.fake()``: any size, no memory.
        mode: ``"exact"`` or ``"light"`` (see :func:`gpumem.profile`).
        progress: called as ``progress(done, total, description)`` while the model is built and
            stepped (a CLI progress bar).
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` the report's simulated reserved peak follows
            (``None``: the environment's), checked before anything is built.
        extrapolate: under ``fake``, in exact mode, with a built-in transformer of more than 3
            blocks: profile the model with 1, 2 and 3 blocks and extrapolate (exactly, checked:
            ``gpumem.profiler.extrapolate``; no timeline and no simulated reserved peak then);
            where a check fails every block is profiled, with a :class:`FullProfileNotice`
            saying why (or ``notice(text)`` when given).

    Raises:
        ValueError: an unknown model or size, a bad count, a sequence longer than the model's,
            before anything is built.
    """
    from gpumem.allocator.alloc_conf import resolve

    conf = resolve(alloc_conf)  # a bad setting fails before anything is built
    precision = _checked_precision(model, size, optimizer, precision, batch_size, steps, seq_len)
    named = "tiny" if size is None else size
    cfg = None if is_config_path(model) else _builtin_config(model, named, seq_len)
    tick = progress or (lambda *a, **k: None)
    _check_device(torch.device(device), fake)
    job = _Job(
        model,
        batch_size,
        seq_len,
        optimizer,
        precision,
        checkpointing,
        fake,
        device,
        steps,
        mode,
        conf,
        progress,
    )
    run = functools.partial(_run, job)
    if extrapolate and not _not_extrapolated(cfg, fake, mode):
        try:
            return _extrapolated(run, cfg, steps, tick)
        except NotExtrapolated as exc:
            text = f"profiling all {cfg.num_layers} blocks (k-block extrapolation not used: {exc})"
            if notice is not None:
                notice(text)
            else:
                warnings.warn(text, FullProfileNotice, stacklevel=2)
    return run(cfg, tick, record=False).report()


def _checked_precision(
    model: str,
    size: str | None,
    optimizer: str,
    precision: str | None,
    batch_size: int,
    steps: int,
    seq_len: int | None,
) -> str:
    """``profile_model``'s checks, before anything is built; returns the precision to build in."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    precision = build_precision(model, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    for name, v in (("batch_size", batch_size), ("steps", steps)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    check_size(model, size)
    return precision


def _check_device(dev: torch.device, fake: bool) -> None:
    if dev.type == "cuda" and not torch.cuda.is_available():
        # fake CUDA tensors cannot record autograd without a usable CUDA device either (fake.py)
        what = "--device cuda"
        if fake:
            what = "--fake --device cuda trains on fake CUDA tensors, which"
        raise ValueError(
            f"{what} needs a torch build with a usable CUDA device; on this machine use --fake "
            "without --device (fake CPU tensors of any size: the same storages without the "
            "512-byte CUDA rounding)"
        )


@dataclass(frozen=True)
class _Job:
    """What ``profile_model`` was asked for, checked: each profile of it runs from this."""

    model: str
    batch_size: int
    seq_len: int | None
    optimizer: str
    precision: str
    checkpointing: bool
    fake: bool
    device: str
    steps: int
    mode: str
    conf: Any
    progress: Any

    @property
    def dev(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def amp(self) -> torch.dtype | None:
        return {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(self.precision)


def _build(job: _Job, cfg: Any) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (``cfg``: a built-in config, ``None``: the config.json) and one batch."""
    from gpumem.models import build_model, example_batch

    dev, dtype = job.dev, job.dtype
    if cfg is None:
        path = Path(job.model)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        net, vocab = _hf_model(path, dtype)
        net = net if job.fake else net.to(dev)
        seq = job.seq_len or 128
        x = torch.randint(0, vocab, (job.batch_size, seq), device=dev)
        y = x
        if job.checkpointing:
            net.gradient_checkpointing_enable()
    else:
        net = build_model(cfg, dtype=dtype)
        net = net if job.fake else net.to(dev)
        net.gradient_checkpointing = job.checkpointing
        x, y = example_batch(net.config, job.batch_size, job.seq_len, device=dev)
        if x.is_floating_point() and dtype is not None:
            x = x.to(dtype)
    return net, x, y


def _run(job: _Job, cfg: Any, tick: Any, record: bool) -> Any:
    """Build the model (``cfg``: a built-in config, ``None``: the config.json) and profile
    ``steps`` steps; ``record``: keep the samples ``extrapolate`` reads, after checking the
    blocks are twins. Returns the ``Profile``."""
    from gpumem.profiler import fake as fake_ctx
    from gpumem.profiler import profile

    dev = job.dev
    outer = (
        fake_ctx(device=job.device if dev.type != "cpu" else None)
        if job.fake
        else contextlib.nullcontext()
    )
    with outer:
        tick(0, None, "building the model")
        net, x, y = _build(job, cfg)
        net.train()
        if record and cfg.num_layers == max(PROFILED):  # the k-block builds share code
            problem = twin_problem(net, _blocks_fqn(net))
            if problem is not None:
                raise NotExtrapolated(f"the blocks are not identical twins: {problem}")
        opt = _optimizer(job.optimizer, net.parameters())
        blocks = _repeated_blocks(net)
        bar = _StepProgress(tick, job.steps, len(blocks))
        prof = profile(net, opt, mode=job.mode, alloc_conf=job.conf)
        if record:
            prof.recorder = SampleRecorder()
            prof.tracker.alloc_log = None  # no reserved simulation: it does not extrapolate
        with contextlib.ExitStack() as hooks:
            if job.progress is not None:
                hooks.callback(_watch_blocks(blocks, bar))
            with prof:
                _train(net, opt, x, y, job.steps, dev, job.amp, bar)
    bar.done()
    return prof


class FullProfileNotice(UserWarning):
    """``profile_model(extrapolate=True)`` profiled every block: the message says why."""


def _not_extrapolated(cfg: Any, fake: bool, mode: str) -> bool:
    """Whether the run is one k-block profiles could give: fake, exact mode, one of gpumem's
    transformers (a config.json's layers carry ``layer_idx``, a ResNet's stages differ) with
    more blocks than are profiled. Otherwise it is profiled whole, quietly: no check failed."""
    return not (
        fake
        and mode == "exact"
        and cfg is not None
        and cfg.arch != "resnet"
        and cfg.num_layers > max(PROFILED)
    )


def _extrapolated(run: Any, cfg: Any, steps: int, tick: Any) -> Report:
    """The report of ``cfg``'s N blocks from profiles with k = 1, 2, 3 of them; the progress
    runs over the three profiles."""
    units = {k: 1 + steps * (2 * k + 1) for k in PROFILED}
    total, done = sum(units.values()), 0
    runs = {}
    for k in PROFILED:

        def part(at: Any, _total: Any = None, what: Any = None, k: int = k, base: int = done):
            label = f"{k}-block profile" + (f": {what}" if what else "")
            tick(base + (at or 0), total, label)

        prof = run(cfg.replace(num_layers=k), part, record=True)
        assert prof.recorder is not None
        runs[k] = (prof.report(), prof.recorder.samples, prof.recorder.root_calls)
        done += units[k]
    rep = extrapolate_report(runs, _blocks_fqn(prof.model), cfg.num_layers)
    tick(total, total)
    return rep


def _blocks_fqn(net: torch.nn.Module) -> str:
    """The name of the list ``_repeated_blocks`` picks."""
    blocks = _repeated_blocks(net)
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.ModuleList) and blocks and list(m) == blocks:
            return name
    return ""


def _train(net, opt, x, y, steps: int, dev: torch.device, amp, bar: _StepProgress) -> None:
    for i in range(steps):
        bar.step(i)
        with torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext():
            out = net(x)
            logits = out.logits if hasattr(out, "logits") else out
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        if opt is not None:
            bar.optimizer()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del out, logits, loss


class _StepProgress:
    """``progress(done, total, description)`` in units of work: the build, then per step each
    repeated block's forward and backward and the optimizer step, so a large model's bar moves
    layer by layer."""

    def __init__(self, tick: Any, steps: int, blocks: int) -> None:
        self.tick, self.steps, self.blocks = tick, steps, blocks
        self.per_step = 2 * blocks + 1
        self.total = 1 + steps * self.per_step
        self.index = 0
        self.at = 0
        self.fwd = self.bwd = 0
        tick(1, self.total, "model built")

    def _show(self, at: int, what: str) -> None:
        self.at = min(max(self.at, at), self.total)
        self.tick(self.at, self.total, f"step {self.index + 1} of {self.steps}: {what}")

    def step(self, i: int) -> None:
        self.index, self.fwd, self.bwd = i, 0, 0
        self._show(1 + i * self.per_step, "forward")

    def forward(self) -> None:
        self.fwd += 1
        self._show(
            1 + self.index * self.per_step + self.fwd, f"forward block {self.fwd}/{self.blocks}"
        )

    def backward(self) -> None:
        self.bwd += 1
        done = 1 + self.index * self.per_step + self.blocks + self.bwd
        self._show(done, f"backward block {self.bwd}/{self.blocks}")

    def optimizer(self) -> None:
        self._show(1 + self.index * self.per_step + 2 * self.blocks, "optimizer step")

    def done(self) -> None:
        self.tick(self.total, self.total)


def _repeated_blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the ``ModuleList`` holding the most parameters (a transformer's layers;
    not the experts inside one), or none."""
    lists = [m for m in net.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def _watch_blocks(blocks: list[torch.nn.Module], bar: _StepProgress) -> Any:
    """Hooks that move ``bar`` as each block's forward and backward runs; returns their
    removal. They run no tensor op (a forward pre-hook, and a hook on the block's output
    gradient), so the profile is the same with and without them; forwards recomputed inside
    backward (checkpointing) are not counted again."""
    graph_task = torch._C._current_graph_task_id

    def pre(_mod: Any, _args: Any) -> None:
        if graph_task() == -1:
            bar.forward()

    def post(_mod: Any, _args: Any, out: Any) -> None:
        if isinstance(out, (tuple, list)) and out:  # transformers' layers of some versions
            out = out[0]
        if graph_task() == -1 and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad: bar.backward())

    handles = [
        h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))
    ]

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove


def is_config_path(model: str) -> bool:
    """Whether ``model`` names a config.json rather than a built-in model."""
    path = Path(model)
    return path.suffix == ".json" or path.is_file()


def check_size(model: str, size: str | None) -> None:
    """A preset size picks a built-in model's shape; with a config.json it would be ignored.

    Raises:
        ValueError: a size given with a config.json.
    """
    if size is not None and is_config_path(model):
        raise ValueError(
            f"--size {size} picks a built-in model's preset; {model} sets its own size "
            "(hidden_size, num_hidden_layers, ...): leave --size out"
        )


def _builtin_config(model: str, size: str, seq_len: int | None) -> Any:
    from gpumem.models import get_config

    cfg = get_config(model, size)
    if seq_len is not None and cfg.arch not in ("vit", "resnet") and seq_len > cfg.seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds {model} {size}'s {cfg.seq_len} positions; use "
            f"--seq-len {cfg.seq_len} or less, or a larger --size"
        )
    return cfg
