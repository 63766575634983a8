"""DeepSeek-V3 (`deepseek_v3`) in and out, transformers the judge: tiny models written by transformers'
`save_pretrained` (random non-zero biases, norm scales and router correction biases; latent attention with and
without a low-rank query, interleaved YaRN RoPE with mscale_all_dim; sigmoid routing within 2 of 4 groups, shared
experts, the first layer dense) give transformers' logits and loss on one device and on two meshes, its greedy
tokens, and export back bit-identically. A checkpoint with a multi-token-prediction layer (DeepSeek's layout) imports
it as spmdkit's MTP module (its loss DeepSeek's, computed with transformers' block), exports it bit-identically, and
drops it with one warning for a model without MTP."""

import json
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx
from hf_reference import assert_matches_on_mesh, load, logits, max_relative_error, randomize, save_tokenizer

import spmdkit
from spmdkit.errors import SpmdkitError, SpmdkitWarning
from spmdkit.interop import from_hf_config, load_model
from spmdkit.plan.layout import parameters
from spmdkit.sharding.logical import use_rules
from spmdkit.sharding.mesh import make_mesh
from spmdkit.sharding.rules import make_rules

VOCAB, SEQ = 96, 12
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 16, "rope_theta": 10_000.0}  # fmt: skip
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=3,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
    v_head_dim=5, attention_bias=True, max_position_embeddings=64, routed_scaling_factor=2.5, rope_interleave=True,
    rope_parameters=YARN, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
TOKENS = np.random.default_rng(7).integers(3, VOCAB, (8, SEQ))  # 8 rows: one per device of expert=4,data=2


def _save(directory, q_lora_rank):
    """A random model saved by transformers; its router correction biases (buffers, which `randomize` leaves at 0)
    drawn too, large enough to change which experts are chosen."""
    save_tokenizer(directory, VOCAB)
    model = randomize(tf.AutoModelForCausalLM.from_config(tf.DeepseekV3Config(q_lora_rank=q_lora_rank, **SHAPE)), 11)
    generator = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, transformers' logits of TOKENS) of a model with a low-rank query (q_lora_rank 12)."""
    directory = _save(tmp_path_factory.mktemp("deepseek_v3") / "model", 12)
    return directory, logits(load(directory), TOKENS)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same with a plain q_proj (q_lora_rank null)."""
    directory = _save(tmp_path_factory.mktemp("deepseek_v3_q_proj") / "model", None)
    return directory, logits(load(directory), TOKENS)


@pytest.mark.parametrize("variant", ["saved", "plain"])
def test_config_is_read_and_logits_match_transformers_on_one_device(variant, request):
    directory, theirs = request.getfixturevalue(variant)
    ours = load_model(directory)
    q_lora = json.loads((directory / "config.json").read_text())["q_lora_rank"] or 0
    expected = dict(
        kv_lora_rank=10, q_lora_rank=q_lora, qk_rope_head_dim=4, head_dim=10, v_head_dim=5, rope_interleave=True,
        rope_mscale_all_dim=0.8, qkv_bias=True, o_bias=True, experts=8, top_k=3, router_score="sigmoid",
        router_correction_bias=True, router_groups=4, router_top_groups=2, routed_scaling=2.5, expert_mlp=16,
        shared_expert=True, shared_expert_mlp=32, dense_layers=(0,), rope_type="yarn",
    )  # fmt: skip
    assert {k: getattr(ours.config, k) for k in expected} == expected
    assert max_relative_error(ours(TOKENS), theirs) <= 1e-4
    built = {".".join(map(str, path)).removesuffix(".scale"): value.shape for path, value in nnx.to_flat_state(
        nnx.state(ours, nnx.Param))}  # fmt: skip
    assert built == {name: shape for name, shape, _ in parameters(ours.config)}  # the planner's inventory


@pytest.mark.parametrize(
    ("variant", "mesh"),
    [("saved", "expert=4,data=2"), ("saved", "fsdp=2,tensor=2,expert=2"), ("plain", "fsdp=2,tensor=2,expert=2")],
)
def test_logits_and_training_loss_match_transformers_on_a_mesh(variant, mesh, request):
    directory, theirs = request.getfixturevalue(variant)
    assert_matches_on_mesh(directory, theirs, TOKENS, mesh)


def test_greedy_generation_matches_transformers(saved):
    directory, _ = saved
    prompt, new = [3, 17, 5, 90, 42, 8], 6
    ours = spmdkit.generate(directory, prompt, max_new_tokens=new, mesh="tensor=2", stop_tokens=())[0].tokens
    with torch.no_grad():
        theirs = load(directory).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert ours == theirs


def _tensors(directory):
    from safetensors.numpy import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


@pytest.mark.parametrize("variant", ["saved", "plain"])
def test_export_is_bit_identical_and_loads_in_transformers(variant, request, tmp_path):
    directory, theirs = request.getfixturevalue(variant)
    out = spmdkit.save_hf(load_model(directory), tmp_path / "hf", tokenizer=directory)  # no base: found by function
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    again = load(out)  # no missing or unexpected keys
    want, got = _tensors(directory), _tensors(out)
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].tobytes() == tensor.tobytes(), key
    assert max_relative_error(logits(again, TOKENS), theirs) <= 1e-6


def _with_mtp(source, directory):
    """`source` with a multi-token-prediction layer as DeepSeek-V3's checkpoints store it (model.layers.{L}, L =
    num_hidden_layers: the last layer's block tensors, enorm, hnorm, eh_proj [hidden, 2 x hidden], shared_head.norm
    and copies of the embedding and head), random non-zero values; config.json keeps num_nextn_predict_layers 1."""
    from safetensors.numpy import save_file

    directory.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (directory / file.name).write_bytes(file.read_bytes())
    tensors, rng, last = _tensors(source), np.random.default_rng(5), SHAPE["num_hidden_layers"]
    mtp = {}
    for name, value in tensors.items():
        if name.startswith(f"model.layers.{last - 1}."):
            noise = rng.standard_normal(value.shape).astype(np.float32)
            norm = value.ndim == 1 and name.endswith(("norm.weight", "layernorm.weight"))
            mtp[name.replace(f".{last - 1}.", f".{last}.", 1)] = 1 + 0.1 * noise if norm else 0.2 * noise
    hidden = SHAPE["hidden_size"]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{last}.{name}.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    mtp[f"model.layers.{last}.eh_proj.weight"] = (0.15 * rng.standard_normal((hidden, 2 * hidden))).astype(np.float32)
    mtp[f"model.layers.{last}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    mtp[f"model.layers.{last}.shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    save_file(tensors | mtp, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def mtp(saved, tmp_path_factory):
    """The directory of `saved` with a multi-token-prediction layer."""
    return _with_mtp(saved[0], tmp_path_factory.mktemp("deepseek_v3_mtp") / "model")


def _transformers_loads(directory):
    """transformers' model of `directory`: nothing missing, unexpected only the MTP layer's tensors (transformers
    skips DeepSeek-V3's, model.layers.61.*, by name; this one is model.layers.3)."""
    model, info = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    unexpected = info["unexpected_keys"]
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info.get("error_msgs")
    assert unexpected and all(name.startswith("model.layers.3.") for name in unexpected), unexpected
    return model.eval()


def test_multi_token_prediction_layers_import_and_export_bit_identically(saved, mtp, tmp_path):
    from spmdkit.interop.sources import source_model

    directory = mtp
    assert source_model(saved[0]).mtp_depth == 0  # its config counts 1 (transformers' default); its files hold none
    ours = load_model(directory)
    assert ours.config.mtp_depth == 1
    assert max_relative_error(ours(TOKENS), saved[1]) <= 1e-4  # the main model's logits: transformers'
    out = spmdkit.save_hf(ours, tmp_path / "hf", tokenizer=directory)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    want, got = _tensors(directory), _tensors(out)
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].tobytes() == tensor.tobytes(), key
    assert max_relative_error(logits(_transformers_loads(out), TOKENS), saved[1]) <= 1e-6
    from spmdkit.tools.hf_checkpoint import import_hf  # `spmdkit ckpt import-hf` keeps the layer too

    assert import_hf(directory, tmp_path / "ckpt").mtp_depth == 1
    again = spmdkit.save_hf(load_model(tmp_path / "ckpt"), tmp_path / "hf_again", tokenizer=directory)
    assert all(_tensors(again)[key].tobytes() == tensor.tobytes() for key, tensor in want.items())


def _mtp_reference(directory, inputs, targets, tmp_path):
    """DeepSeek-V3's MTP module 1 in torch, from the files: h' = eh_proj [enorm(emb(t_{i+1})); hnorm(h_i)] (h the
    last layer's output), transformers' own block (its MoE included) run on h' as the model's last layer, then
    shared_head (norm, head); the summed cross-entropy of t_{i+2}."""
    from safetensors.numpy import save_file

    tensors, prefix, last = _tensors(directory), "model.layers.3.", "model.layers.2."
    own = tuple(prefix + n for n in ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens."))
    block = {last + k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix) and not k.startswith(own)}
    swapped = tmp_path / "swapped"  # the model with the MTP block as its last layer: transformers loads it
    swapped.mkdir()
    for file in directory.iterdir():
        if file.suffix != ".safetensors":
            (swapped / file.name).write_bytes(file.read_bytes())
    rest = {k: v for k, v in tensors.items() if not k.startswith((prefix, last))}
    save_file(rest | block, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    layer = tf.AutoModelForCausalLM.from_pretrained(swapped, dtype=torch.float32).eval().model.layers[-1]
    main = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    t = {k: torch.tensor(v) for k, v in tensors.items() if k.startswith(own)}
    seen = {}
    main.model.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    eps = main.config.rms_norm_eps
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    with torch.no_grad():
        ids = torch.tensor(inputs)
        main(ids)
        h = (seen["h"][0] if isinstance(seen["h"], tuple) else seen["h"])[:, :-1]
        emb = torch.nn.functional.embedding(ids[:, 1:], t[prefix + "embed_tokens.weight"])
        x = torch.cat([rms(emb, t[prefix + "enorm.weight"]), rms(h, t[prefix + "hnorm.weight"])], -1)
        x = x @ t[prefix + "eh_proj.weight"].T
        rows, n = x.shape[:2]
        positions = torch.arange(n)[None].expand(rows, n)
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None].expand(rows, 1, n, n)
        out = layer(
            x, attention_mask=mask, position_ids=positions, position_embeddings=main.model.rotary_emb(x, positions)
        )
        out = out[0] if isinstance(out, tuple) else out
        head = rms(out, t[prefix + "shared_head.norm.weight"]) @ t[prefix + "shared_head.head.weight"].T
        flat = torch.tensor(targets)[:, 1:].reshape(-1)
        return torch.nn.functional.cross_entropy(head.reshape(-1, head.shape[-1]), flat, reduction="sum").item()


def test_the_imported_mtp_module_computes_deepseeks_mtp_loss(mtp, tmp_path):
    """spmdkit's MTP loss of the imported layer is the torch one's sum over the scored tokens (DeepSeek's 1/T)."""
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    theirs = _mtp_reference(mtp, inputs, targets, tmp_path) / inputs.size
    model = load_model(mtp)
    x, _ = model.hidden(inputs)
    ours, _ = model.mtp_loss(x, inputs, targets, np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape))
    assert float(ours) == pytest.approx(theirs, rel=1e-5)


def test_multi_token_prediction_layers_beyond_mtp_depth_are_dropped_with_one_warning(saved, mtp):
    """A model of mtp_depth 0 reads a checkpoint with an MTP layer: its tensors are dropped, with one warning."""
    from spmdkit.interop.sources import source_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_model(mtp, config=source_model(mtp).replace(mtp_depth=0))
    dropped = [w for w in caught if issubclass(w.category, SpmdkitWarning)]
    assert len(dropped) == 1 and "multi-token-prediction" in str(dropped[0].message)
    assert not hasattr(ours, "mtp") and max_relative_error(ours(TOKENS), saved[1]) <= 1e-4


def test_an_mtp_layers_copy_of_the_head_that_differs_is_refused_in_one_line(mtp, tmp_path):
    from safetensors.numpy import save_file

    directory = tmp_path / "edited"
    directory.mkdir()
    for file in mtp.iterdir():
        if file.suffix != ".safetensors":
            (directory / file.name).write_bytes(file.read_bytes())
    tensors = _tensors(mtp)
    tensors["model.layers.3.shared_head.head.weight"] = tensors["model.layers.3.shared_head.head.weight"] * 2
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpmdkitError, match="shared_head.head.weight differs from lm_head.weight") as error:
        load_model(directory)
    assert "\n" not in str(error.value)


def test_ring_attention_takes_latent_attentions_head_dims(saved):
    """Context parallelism: q/k heads of 10 dims, values of 5 padded to 10, in the zigzag ring."""
    from spmdkit.parallel.context.zigzag import from_zigzag, zigzag_batch

    directory, theirs = saved
    mesh, rules = make_mesh("context=2,fsdp=4"), make_rules()
    model = load_model(directory, mesh=mesh, rules=rules)
    batch = zigzag_batch({"inputs": TOKENS, "positions": np.broadcast_to(np.arange(SEQ), TOKENS.shape)}, 2)
    with use_rules(rules, mesh):
        out = jax.jit(lambda m, b: m(b["inputs"], b["positions"]))(model, batch)
    assert max_relative_error(from_zigzag(np.asarray(out), axis=1, n=2), theirs) <= 1e-4


def test_heads_that_do_not_split_over_tensor_are_refused_in_one_line(saved):
    with pytest.raises(SpmdkitError, match=r"heads=4\) is not divisible by mesh axis tensor=8") as error:
        load_model(saved[0], mesh=make_mesh("tensor=8"), rules=make_rules())
    assert "\n" not in str(error.value)


def test_latent_attention_shapes_that_cannot_run_are_refused_in_one_line():
    hf = tf.DeepseekV3Config(q_lora_rank=12, **SHAPE).to_dict()
    for changes, words in (
        ({"num_key_value_heads": 2}, "must equal num_attention_heads"),
        ({"qk_rope_head_dim": 3}, "even qk_rope_head_dim"),
        ({"v_head_dim": 11}, "v_head_dim <= head_dim"),
        ({"n_group": 3}, "router_groups=3 must divide experts=8"),
    ):
        with pytest.raises(SpmdkitError, match=words) as error:
            from_hf_config(hf | changes)
        assert "\n" not in str(error.value)
    from spmdkit.models.lora import check_lora
    from spmdkit.models.lora_config import LoraConfig

    dense = from_hf_config(hf).replace(experts=0, dense_layers=(), router_score="softmax", router_correction_bias=False,
                                       router_groups=1, router_top_groups=1, shared_expert=False)  # fmt: skip
    with pytest.raises(SpmdkitError, match="--lora on latent attention"):
        check_lora(dense, LoraConfig(rank=4))


PUBLISHED_V3 = {  # deepseek-ai/DeepSeek-V3's config.json, less auto_map and its FP8 quantization_config
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_the_deepseek_v3_preset_is_its_published_config_and_counts_its_parameters():
    from spmdkit.models.presets import PRESETS

    preset = PRESETS["deepseek-v3"]
    imported = from_hf_config(PUBLISHED_V3)  # dispatch is the run's: an import drops nothing, as transformers
    assert imported.replace(dispatch=preset.dispatch) == preset
    assert imported.dispatch == ("dropless" if preset.experts else "capacity")
    with torch.device("meta"):
        reference = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**PUBLISHED_V3))
    parameters = sum(p.numel() for p in reference.parameters())
    corrections = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert preset.num_params() == parameters + corrections  # spmdkit holds the correction biases as parameters
    assert 671e9 < parameters < 672e9  # DeepSeek's 671B (its 14B of MTP weights not counted)
