"""The OPD trainer: the losses, teacher replay, the FSDP training loop and its checkpoints."""
