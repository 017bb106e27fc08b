"""The target, the DFlash drafter (build, load, save, check compatibility, read SpecForge checkpoints, the published drafters, the export check) and the one adapter that imports SpecForge."""
