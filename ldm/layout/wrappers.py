"""The levels that wrappers add to parameter names, and where sharded checkpoints keep the model.

torch.compile (`_orig_mod.`), FSDP units (`_fsdp_wrapped_module.`) and activation checkpointing
(`_checkpoint_wrapped_module.`) add a level inside the module's names; none of them is in a
checkpoint we write (Lightning saves the bare module's state dict). Lightning's sharded FSDP
checkpoints store the module's state dict under the key `model`.
"""

WRAPPER_LEVELS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
SHARDED_MODULE_KEY = "model"


def without_wrapper_levels(name: str) -> str:
    """A parameter name as the bare module has it (levels of torch.compile / FSDP removed)."""
    for level in WRAPPER_LEVELS:
        name = name.replace(level, "")
    return name
