"""The target, the DFlash drafter (build, load, save, check compatibility, the published drafters, the export check) and the one adapter that imports SpecForge."""
