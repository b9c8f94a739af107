"""Context-parallel plans for diffusers models that ship none, and `enable_parallelism(model, config)`, which applies
diffusers' own plan or the one here. Independent of sage attention: the plans are correct in full precision too.

HunyuanVideoTransformer3DModel (text-to-video; `image_condition_type` None or "latent_concat"). What has to stay
right when the joint [video, text] sequence is split over the ranks, and how the plan keeps it:

- Video tokens: the patch embedder's output is split on the sequence dim, the RoPE table (cos, sin; one row per
  video token, the same (frame, height, width) order) on its first dim, and `proj_out`'s output is gathered back:
  rank r holds video tokens [r L/W, (r+1) L/W) with their own rotary rows, as in Flux's plan.
- Text tokens: the token refiner (`context_embedder`, full self-attention over the text with the text mask, and a
  masked mean) runs on the whole text on every rank, and its output is split on the sequence dim. Its attention
  layers therefore see replicated input and need no parallel config (declared to the sage adapter's model check).
- The text key-padding mask: the model builds the joint mask from `encoder_attention_mask.sum(1)` (valid text
  tokens first, padding at the tail: the whole mask becomes "first n text tokens valid"). With the text split, rank
  r's text tokens are [r T/W, (r+1) T/W), and its local count of valid tokens is the sum of its chunk of the mask,
  which is again "first n of the chunk valid". So the plan splits `encoder_attention_mask` at the model's input (the
  mask the model builds is then right for the local [video chunk, text chunk] layout), and a hook on
  `context_embedder` gathers it back for the refiner (`GatherInputHook`, one all-gather of a (B, T) mask).
- Each rank's local sequence is [its video chunk, its text chunk]; diffusers' Ulysses template gathers the local
  masks in rank order, the same order it gathers K/V in, and the sage adapter does the same for ring attention
  (`diffusers_parallel`); attention does not depend on the order of the keys, so the permuted layout is exact.

The token-replace variant (image-to-video, `image_condition_type="token_replace"`) treats the first frame's tokens
apart by position, which a split sequence breaks: it is refused.

Why a helper and not automatic: sage_patch wraps no existing method of diffusers (enabling sage must not change what
`enable_parallelism` does), and the plan needs one hook diffusers' plan format cannot express. The helper calls
diffusers' `enable_parallelism` with the plan and adds that hook; it works with or without sage enabled. This module
imports diffusers (the adapter never imports it, so `import sage_patch` stays free of it).
"""
from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.context_parallel import EquipartitionSharder, ModuleForwardMetadata
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.utils.torch_utils import unwrap_module

from sage_patch.integrations.diffusers_parallel import REPLICATED_ATTR

_GATHER_HOOK = "sage_patch_cp_gather---{}"


def hunyuan_video_plan() -> dict:
    """diffusers ContextParallelModelPlan for HunyuanVideoTransformer3DModel (module docstring)."""
    In, Out = ContextParallelInput, ContextParallelOutput
    return {
        "": {"encoder_attention_mask": In(split_dim=1, expected_dims=2)},
        "x_embedder": {0: In(split_dim=1, expected_dims=3, split_output=True)},
        "context_embedder": {0: In(split_dim=1, expected_dims=3, split_output=True)},
        "rope": {0: In(split_dim=0, expected_dims=2, split_output=True),
                 1: In(split_dim=0, expected_dims=2, split_output=True)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    }


# model class name -> (plan, {submodule: input argument gathered back}, layer-name globs whose input is replicated)
_SHIPPED = {
    "HunyuanVideoTransformer3DModel": (hunyuan_video_plan, {"context_embedder": "attention_mask"},
                                       ("context_embedder.*",)),
}


def _check_supported(model) -> None:
    if type(model).__name__ == "HunyuanVideoTransformer3DModel" and \
            getattr(model.config, "image_condition_type", None) == "token_replace":
        raise ValueError("HunyuanVideoTransformer3DModel with image_condition_type='token_replace' is not supported "
                         "under context parallelism (its first-frame tokens are handled by position)")


def plan_for(model) -> dict:
    """The context-parallel plan for `model`: the one shipped here for its class, else diffusers' `_cp_plan`."""
    shipped = _SHIPPED.get(type(model).__name__)
    if shipped is not None:
        _check_supported(model)
        return shipped[0]()
    plan = getattr(model, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no context-parallel plan (neither diffusers' _cp_plan nor one "
                         f"shipped by sage_patch: {sorted(_SHIPPED)}); pass cp_plan= to model.enable_parallelism if "
                         f"you have a correct one")
    return plan


def install_plan_hooks(model) -> None:
    """What a shipped plan needs beyond diffusers' `apply_context_parallel` (after it ran with `plan_for(model)`):
    the input-gather hooks, and the replicated layers declared to the sage adapter."""
    shipped = _SHIPPED.get(type(model).__name__)
    cp = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)
    if shipped is None or cp is None:
        return
    for name, arg in shipped[1].items():
        registry = HookRegistry.check_if_exists_or_initialize(model.get_submodule(name))
        registry.register_hook(GatherInputHook(arg, 1, cp), _GATHER_HOOK.format(name))
    object.__setattr__(model, REPLICATED_ATTR, shipped[2])


def remove_plan_hooks(model) -> None:
    """The inverse of `install_plan_hooks` (for code that undoes enable_parallelism, which diffusers itself does not
    offer: with diffusers' `remove_context_parallel(model, plan_for(model))` and the processors' config reset)."""
    shipped = _SHIPPED.get(type(model).__name__)
    if shipped is None:
        return
    for name in shipped[1]:
        HookRegistry.check_if_exists_or_initialize(model.get_submodule(name)).remove_hook(_GATHER_HOOK.format(name))
    if REPLICATED_ATTR in model.__dict__:
        object.__delattr__(model, REPLICATED_ATTR)


def enable_parallelism(model, config, *, cp_plan=None):
    """`model.enable_parallelism(config=config, cp_plan=...)` with the plan for the model (`plan_for`; cp_plan
    overrides it) and the hooks that plan needs. Use it for HunyuanVideo; for models with diffusers' own plan it is
    the same as calling enable_parallelism."""
    model.enable_parallelism(config=config, cp_plan=cp_plan if cp_plan is not None else plan_for(model))
    if cp_plan is None:
        install_plan_hooks(model)
    return model


class GatherInputHook(ModelHook):
    """Gathers one input argument of a module back to its whole length over the context-parallel mesh (the reverse of
    a plan's ContextParallelInput split, for a module that needs the whole tensor), with diffusers' own collective."""

    def __init__(self, arg: str, dim: int, cp_config):
        super().__init__()
        self.arg, self.dim, self.cp_config = arg, dim, cp_config
        self.meta = None

    def initialize_hook(self, module):
        self.meta = ModuleForwardMetadata(_cls=unwrap_module(module).__class__)
        return module

    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        val, is_kwarg, index = self.meta._get_parameter_from_args_kwargs(self.arg, args, kwargs)
        if isinstance(val, torch.Tensor):
            wire = val.to(torch.uint8) if val.dtype == torch.bool else val   # bool as bytes: every backend has them
            val = EquipartitionSharder.unshard(wire, self.dim, self.cp_config._flattened_mesh).to(val.dtype)
            if is_kwarg:
                kwargs[self.arg] = val
            else:
                args[index] = val
        return tuple(args), kwargs
