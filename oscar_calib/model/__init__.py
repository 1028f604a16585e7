"""Models: which model a MODEL argument names (:mod:`.source`), loading (:mod:`.load`, the one way
every tool gets a :class:`~.load.LoadedModel`), geometry and fingerprints (:mod:`.geometry`),
big-model placement (:mod:`.placement`), the architecture registry (:mod:`.registry`), per-model
YAML configs (:mod:`.configs`) and capture of post-RoPE Q/K/V through transformers' attention
interface (:mod:`.capture`)."""
