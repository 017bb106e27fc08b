"""The jobs a user runs, each read top to bottom: SFT, OPD, planning, the matched-FLOPs comparison."""
