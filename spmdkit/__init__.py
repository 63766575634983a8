"""spmdkit: train Llama-style transformers across many accelerators with JAX's SPMD compiler.

`spmdkit.load_model(path, mesh=None, rules=None, dtype=..., step=None)` and `spmdkit.save_hf(model, out_dir,
tokenizer=...)` (from `spmdkit.interop`) and `spmdkit.generate(model, prompts, ...)` (from `spmdkit.inference`) load
on first use, so that `import spmdkit` stays light (no JAX). A script of your own that `spmdkit launch` (or srun, or
mpirun) starts as several processes joins their job with `spmdkit.distributed.join()` (`import spmdkit.distributed`),
first thing, before JAX computes anything; `spmdkit train` joins by itself.

Your own Flax NNX module, sharded by logical names (`spmdkit.sharding`). It runs as written on 8 devices; on a CPU
machine run it with `JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8`::

    import jax
    from flax import nnx
    from spmdkit.sharding import constrain, init_sharded, make_mesh, make_rules, use_rules

    class Mlp(nnx.Module):  # x [batch, patch, embed]; "patch" and "channels" are names of your own
        def __init__(self, rngs: nnx.Rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 64)), out_sharding=("embed", "channels"))

        def __call__(self, x):
            return constrain(x @ self.w[...], ("batch", "patch", "channels"))  # acts inside use_rules only

    rules = make_rules(extra={"patch": None, "channels": "tensor"})  # also: rules.to_flax(), Rules.from_flax(pairs)
    x = jax.numpy.ones((8, 16, 32))
    for mesh in (make_mesh("fsdp=4,tensor=2"), make_mesh("data=1", devices=jax.devices()[:1])):
        model = init_sharded(lambda: Mlp(nnx.Rngs(0)), mesh, rules)  # every parameter born in its shards
        with jax.set_mesh(mesh), use_rules(rules, mesh):
            print(model.w[...].sharding.spec, float(jax.jit(lambda m: (m(x) ** 2).mean())(model)))  # same loss
"""

from spmdkit._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {  # public name -> the module that defines it
        "generate": "spmdkit.inference.api",
        "load_model": "spmdkit.interop",
        "save_hf": "spmdkit.interop",
    },
)
