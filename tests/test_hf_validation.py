"""A Hugging Face config.json read as transformers reads it (transformers is the judge).

- Defaults: for every family, a config.json that leaves every key out but `model_type` (and one that gives only
  other sizes) reads as the config transformers' own config class makes of it (`AutoConfig.for_model`).
"""

import pytest
from transformers import AutoConfig

from spmdkit.interop.hf_config import FAMILIES, from_hf_config, function_of


def _read(hf: dict) -> dict:
    model = from_hf_config(hf)
    return {**function_of(model), "max_positions": model.max_positions}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_key_left_out_means_what_transformers_config_class_makes_of_it(model_type):
    """The whole function a config fixes, read from transformers' complete config (every key at its class's
    default, derived keys such as head_dim and layer_types spelled out) and from the same config with every key
    left out but those given: the same; with other sizes too, so that a derived default is not a constant."""
    for given in ({}, {"hidden_size": 1024, "num_hidden_layers": 7}):
        theirs = _read(AutoConfig.for_model(model_type, **given).to_dict())
        ours = _read({"model_type": model_type, **given})
        assert ours == theirs, {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs.get(k)}
