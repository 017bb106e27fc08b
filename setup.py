"""specforge-opd: on-policy distillation (Draft-OPD) for DFlash draft models on SpecForge.

Pinned runtime dependencies live in requirements.lock and are installed by
scripts/setup_env.sh (SpecForge must go in with --no-deps, which setup.py cannot
express), so install_requires lists only what the package imports directly.
"""
from setuptools import find_packages, setup

setup(
    name="specforge-opd",
    version="0.1.0",
    description="Draft-OPD: on-policy distillation for speculative-decoding draft models",
    python_requires=">=3.11",
    packages=find_packages(include=["specforge_opd", "specforge_opd.*"]),
    package_data={"specforge_opd": ["fixtures/**/*", "fixtures/*", "models/published/**/*", "models/published/*"]},
    install_requires=[
        "torch>=2.11",
        # no upper pin: SGLang 0.5.23 pins transformers 5.19 and torch 2.14 in its own env;
        # requirements.lock pins what this project is tested with
        "transformers>=5.8.1",
        "safetensors",
        "pydantic>=2",
        "pyyaml",
        "tqdm",
        "numpy",
    ],
    extras_require={
        # client side of the SGLang modes: the server lives in its own env/image
        "sglang": ["aiohttp", "requests"],
        "gpu": ["flash-attn", "liger-kernel"],
    },
    entry_points={
        "console_scripts": ["specforge-opd=specforge_opd.cli:main"],
        # SGLang loads this in its worker for native-mode rollouts (docs/sglang.md).
        "sglang.srt.plugins": ["specforge_opd_native = specforge_opd.sglang.native:register"],
    },
)
