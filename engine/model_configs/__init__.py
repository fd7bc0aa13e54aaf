"""config.json of each registered model as its Hub repo states it (GLM-4.5V, GLM-4.5V-FP8,
gpt-oss-20b, gpt-oss-120b), so the full-size architectures can be built without a download
(benchmarks with random weights, planning before a pull). Values: the project's model notes,
which cite the Hub files. The FP8 repo's quantization_config is the channel-wise
compressed-tensors layout it is believed to use; the loader reads the real one from the file.
"""
from __future__ import annotations

import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent
NAMES = ("glm-4.5v", "glm-4.5v-fp8", "gpt-oss-20b", "gpt-oss-120b")


def model_config(name: str) -> dict:
    """A fresh copy of a registered model's config.json as a dict."""
    if name not in NAMES:
        raise KeyError(f"no built-in config for {name!r}; known: {', '.join(NAMES)}")
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())
