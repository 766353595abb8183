"""The training frameworks' conventions: whose buffers, recipes and options a bill follows.

The core formulas (``activations``, ``backward``, ``terms``, ``peak``) are the same for every
framework; what differs is priced here, one module per framework.

Modules:

    conventions        which framework's buffer conventions a bill follows, and their cost
    cuda_graphs        Megatron's per-layer CUDA graphs: a step's, the capture's and the static view
    deepspeed          DeepSpeed ZeRO's knobs (``ZeroConfig``), buffers, offload and formulas
    megatron           Megatron-LM's knobs (``MegatronKnobs``), TE tensors, loss, fp8, pipeline
    torchtitan         torchtitan's recipe (``TorchtitanKnobs``): modules, SAC, loss, FSDP units
    titan_trace        torchtitan's step as allocations on FSDP2's streams (its reserved memory)
    titan_compile      torchtitan's Inductor-compiled loss (--training.compile): what it keeps
    titan_schedules    torchtitan's pipeline stages (its split) and each rank's schedule order
    titan_pipeline     torchtitan under pp: what each pipeline rank holds, moment by moment
    titan_moe          torchtitan's Qwen3-MoE: router, dispatch, grouped experts, their buffers
"""
