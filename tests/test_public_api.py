"""`spmdkit.sharding` exports exactly the names an importer needs, each resolvable and documented."""

import inspect

import spmdkit.sharding

EXPECTED = [
    "AXES",
    "CollectiveReport",
    "ExpertWeights",
    "MeshConfig",
    "PRESETS",
    "Rules",
    "Schedule",
    "abstract_state",
    "capacity",
    "collective_report",
    "constrain",
    "deinterleave_layers",
    "dense_moe",
    "describe_parallelism",
    "expert_ffn",
    "from_microbatches",
    "from_zigzag",
    "init_sharded",
    "interleave_layers",
    "logical_to_spec",
    "make_mesh",
    "make_rules",
    "make_schedule",
    "parameter_rows",
    "parameter_table",
    "pipeline_value_and_grad",
    "preset",
    "ring_attention",
    "state_shardings",
    "to_microbatches",
    "to_zigzag",
    "use_rules",
    "zigzag_indices",
]


def test_all_is_exactly_the_public_api():
    assert sorted(spmdkit.sharding.__all__) == EXPECTED
    assert len(set(spmdkit.sharding.__all__)) == len(spmdkit.sharding.__all__)


def test_every_name_resolves():
    namespace: dict = {}
    exec("from spmdkit.sharding import *", namespace)  # what `import *` gives a user
    for name in EXPECTED:
        assert getattr(spmdkit.sharding, name) is namespace[name]


def _own_docstring(obj: object) -> str:
    """The docstring written for `obj` itself: not inherited, not a dataclass's generated signature."""
    doc = (vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__) or ""
    return "" if doc.startswith(f"{obj.__name__}(") else doc.strip()


def test_every_function_and_class_has_a_docstring():
    exported = [getattr(spmdkit.sharding, name) for name in EXPECTED]
    undocumented = [
        obj.__name__
        for obj in exported
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and not _own_docstring(obj)
    ]
    assert not undocumented, f"exported without a docstring: {undocumented}"
